"""Pictures of a KV policy: what it keeps, what that costs, how tight its page bound is.

`show` decodes a few tokens of a real prompt (by default a passkey prompt on the embedded essays, so
the needle is visible) with a `Decoder` and draws, from the audit hook (`DecodeSession.audit`):

1. for the chosen layers and query heads, the dense attention mass of each decode step over the
   context, page by page, with the tokens the policy kept outlined;
2. the dropped mass ``δ = 1 − Σ_kept p`` of every layer (mean over steps and heads, with its spread);
3. for page policies (a cache that keeps page summaries), each page's upper bound (Quest's box, the
   key sketch) against the true best logit of the page.

`trace_policy` returns the recorded data (`PolicyTrace`, an audit `Recorder`) and `draw` makes the
figure from it; `show` is the two in one. `policyzoo show` is the command line (`eval.show_cli`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Sequence

import numpy as np
import torch
from torch import Tensor

from ..cache import SKETCH, PagedKVCache
from ..kernels import reference
from ..kv.base import KVSelector
from ..selection import Selection
from .audit import dense_attention_probs
from .metrics import dropped_mass

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from ..proj import ProjectionSparsifier

BoundChoice = Literal["auto", "box", "sketch", "none"]
BOUND_CHOICES = ("auto", "box", "sketch", "none")
# The cache summaries each page bound reads.
_BOUND_NEEDS = {"box": ("page_min", "page_max"), "sketch": ("page_min", "page_max", SKETCH)}
MAX_STEPS = 64  # rows of a heat map; more would not be readable
MASS_FLOOR = 1e-4  # the colour scale's and the δ axis's lower end


# ------------------------------------------------------------------------------------ checks
def matplotlib_module(name: str) -> Any:
    """Import a matplotlib module, or say which extra installs it."""
    import importlib

    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        raise ModuleNotFoundError("the pictures need matplotlib: pip install 'policyzoo[plot]'") from None


def page_bounds(policy: KVSelector | None, bound: str = "auto") -> tuple[str, ...]:
    """The page bounds the picture of ``policy`` draws: ``"auto"``, every bound its cache can give
    (``("box",)``, ``("box", "sketch")`` or none); ``"box"`` or ``"sketch"``, that one (a `ValueError`
    when the policy's cache does not keep what it reads); ``"none"``, none."""
    if bound not in BOUND_CHOICES:
        raise ValueError(f"bound must be one of {', '.join(BOUND_CHOICES)}, got {bound!r}")
    kept = set(policy.summaries) if policy is not None else set()
    available = tuple(kind for kind, needs in _BOUND_NEEDS.items() if kept.issuperset(needs))
    if bound == "auto":
        return available
    if bound == "none":
        return ()
    if bound not in available:
        name = type(policy).__name__ if policy is not None else "dense decoding"
        missing = " / ".join(n for n in _BOUND_NEEDS[bound] if n not in kept)
        raise ValueError(f"bound={bound!r}: {name}'s cache keeps no {missing}, so there is no {bound} "
                         f"page bound to draw (it has: {', '.join(available) or 'none'}; a page policy such as "
                         f"quest{':0.1,bound=sketch' if bound == 'sketch' else ''} has one)")  # fmt: skip
    return (bound,)


def check_steps(steps: int) -> None:
    """A `ValueError` unless ``steps`` (decode steps, a heat map's rows) is an int in 1..`MAX_STEPS`."""
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"steps must be an int in 1..{MAX_STEPS}, got {steps!r}")


def check_indices(values: Sequence[int], count: int, what: str) -> tuple[int, ...]:
    """``values`` as a tuple of distinct indices below ``count`` (``what``: ``"layer"`` or ``"head"``,
    for the message); a `ValueError` names the first bad one."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise ValueError(f"{what}s must be a non-empty list of {what} indices, got {values!r}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < count:
            raise ValueError(f"{what}s: {v!r} is not a {what} of the model, which has {count} (0..{count - 1})")
    if len(set(values)) != len(values):
        raise ValueError(f"{what}s: {list(values)} names a {what} twice")
    return tuple(values)


# ---------------------------------------------------------------------------------- recorder
@dataclass
class PolicyTrace:
    """An audit `Recorder` (`DecodeSession.audit`) that keeps what the pictures need, for batch row 0.

    Every layer: ``dropped[layer]``, per step ``float32[H]`` (δ per query head), and ``keep[layer]``,
    per step the kept fraction of the visible tokens averaged over KV heads. The chosen ``layers`` and
    query ``heads`` also get, per step, over the row's visible slots ``start .. length-1``:
    ``probs[layer]`` ``float32[len(heads), n]`` (dense attention) and ``kept[layer]``
    ``bool[len(heads), n]`` (the selection of each head's KV head, `Selection.token_mask`); and over
    the cache's pages, ``best[layer]`` ``float32[len(heads), P]`` (the page's best logit
    ``scale·q·k``, ``-inf`` on pages with nothing visible) and ``bound[(kind, layer)]`` (each kind of
    ``bounds``: `reference.quest_page_bound`, `reference.sketch_page_bound`).
    """

    layers: tuple[int, ...]
    heads: tuple[int, ...]
    bounds: tuple[str, ...] = ()
    needle: tuple[int, ...] = ()  # prompt positions to mark (the pass key's tokens)
    label: str = ""
    prompt_tokens: int = 0
    start: int = 0  # the row's first visible slot: prompt position 0
    page_size: int = 16
    group: int = 1  # query heads per KV head
    dropped: dict[int, list[Tensor]] = field(default_factory=lambda: defaultdict(list))
    keep: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    probs: dict[int, list[Tensor]] = field(default_factory=lambda: defaultdict(list))
    kept: dict[int, list[Tensor]] = field(default_factory=lambda: defaultdict(list))
    best: dict[int, list[Tensor]] = field(default_factory=lambda: defaultdict(list))
    bound: dict[tuple[str, int], list[Tensor]] = field(default_factory=lambda: defaultdict(list))
    proj_keep: list[float] = field(default_factory=list)

    @property
    def steps(self) -> int:
        """Decode steps recorded (those of the first chosen layer)."""
        return len(self.probs[self.layers[0]])

    def record_attention(
        self, layer: int, q: Tensor, cache: PagedKVCache, sel: Selection, out: Tensor, scale: float, attention: str = "softmax"
    ) -> None:
        """Keep one decode step of one layer (the `Recorder` hook; ``attention``: the model's, ``"softmax"`` or ``"entmax"``)."""
        keys, valid = cache.keys[layer], cache.token_valid()
        p = dense_attention_probs(q, keys, cache.start, cache.length, scale, attention)
        self.dropped[layer].append(dropped_mass(p, sel, valid)[0].cpu())
        self.keep[layer].append(float((sel.kept_tokens(valid)[0] / valid[0].sum().clamp(min=1)).mean()))
        if layer not in self.layers:
            return
        self.start, self.page_size, self.group = int(cache.start[0]), cache.page_size, q.shape[1] // keys.shape[1]
        heads, kv_heads = list(self.heads), [h // self.group for h in self.heads]
        span = slice(self.start, int(cache.length))
        self.probs[layer].append(p[0, heads, span].cpu())
        self.kept[layer].append(sel.token_mask(keys.shape[2])[0, kv_heads, span].cpu())
        self.best[layer].append(_page_best_logits(q, cache, layer, scale)[0, heads].cpu())
        for kind in self.bounds:
            self.bound[(kind, layer)].append(_page_bound(kind, q, cache, layer, scale)[0, heads].cpu())

    def record_projection(self, name: str, keep: Tensor) -> None:
        """Keep the projection's kept fraction (for the title)."""
        self.proj_keep.append(float(keep.float().mean()))


def _page_best_logits(q: Tensor, cache: PagedKVCache, layer: int, scale: float) -> Tensor:
    """``float32[B, H, P]``: the best ``scale·q·k`` of each page's visible tokens (``-inf``: none)."""
    keys = cache.keys[layer].float()
    b, h, d = q.shape
    h_kv, n = keys.shape[1], keys.shape[2]
    logits = torch.einsum("bkgd,bknd->bkgn", q.float().view(b, h_kv, h // h_kv, d), keys) * scale
    logits = logits.reshape(b, h, n).masked_fill(~cache.token_valid()[:, None, :], -torch.inf)
    return logits.view(b, h, n // cache.page_size, cache.page_size).amax(-1)


def _page_bound(kind: str, q: Tensor, cache: PagedKVCache, layer: int, scale: float) -> Tensor:
    """``float32[B, H, P]``: the page bound of ``kind`` per query head, ``-inf`` on pages with nothing visible."""
    lo, hi = cache.page_min[layer], cache.page_max[layer]
    if kind == "sketch":
        return reference.sketch_page_bound(q, cache.key_sketch[layer], lo, hi, cache.start, cache.length, scale)
    seen = cache.token_valid().view(q.shape[0], -1, cache.page_size).any(-1)  # [B, P]
    return reference.quest_page_bound(q, lo, hi, scale).masked_fill(~seen[:, None, :], -torch.inf)


# ------------------------------------------------------------------------------------ decode
def trace_policy(
    model: Any,
    tokenizer: Any,
    kv: KVSelector | str | None,
    *,
    proj: ProjectionSparsifier | str | None = None,
    prompt: str | Tensor | None = None,
    n_tokens: int = 1024,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    steps: int = 8,
    bound: BoundChoice = "auto",
    progress: bool = False,
) -> PolicyTrace:
    """Decode ``steps`` tokens of a prompt with ``Decoder(model, kv=kv, proj=proj)`` and record them.

    ``kv`` and ``proj`` are policies or spec strings (``"quest:0.1"``, ``"topk:0.5"``). ``prompt`` is
    text, token ids ``[1, T]``, or ``None``: a passkey prompt of about ``n_tokens`` tokens on the
    embedded essays (`assets.passkey_prompt`), whose pass key is marked. ``layers`` (default: the
    middle one) and query ``heads`` (default: the first of each KV group, at most 4) are the heat
    maps' (every pair); ``bound`` as `page_bounds`. Arguments are checked before the decode.
    """
    from ..decoder import Decoder
    from ..spec import parse_kv, parse_proj

    kv_policy = parse_kv(kv) if isinstance(kv, str) else kv
    proj_policy = parse_proj(proj) if isinstance(proj, str) else proj
    names = [_label(given) for given, built in ((kv, kv_policy), (proj, proj_policy)) if built is not None]
    bounds = page_bounds(kv_policy, bound)
    check_steps(steps)
    cfg = model.config
    n_heads, n_kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    layers = check_indices(layers if layers is not None else [cfg.num_hidden_layers // 2], cfg.num_hidden_layers, "layer")
    heads = check_indices(heads if heads is not None else list(range(0, n_heads, n_heads // n_kv))[:4], n_heads, "head")
    ids, needle = _prompt_ids(tokenizer, prompt, n_tokens)
    trace = PolicyTrace(layers, heads, bounds, needle, " + ".join(names) or "dense", ids.shape[1])
    dec = Decoder(model, kv=kv_policy, proj=proj_policy)
    with dec.session.audit(trace):  # the decode's steps report to `trace` (generate's own audit stays off)
        dec.generate(ids.to(dec.device), max_new_tokens=steps + 1, eos_token_id=[], progress=progress)
    if trace.steps != steps:
        raise RuntimeError(f"the audit recorded {trace.steps} decode steps of layer {layers[0]}, expected {steps}")
    return trace


def _label(policy: Any) -> str:
    """A policy's name for a title: its spec as written, or its repr."""
    text = policy if isinstance(policy, str) else repr(policy)
    return text if len(text) <= 90 else text[:89] + "…"


def _prompt_ids(tokenizer: Any, prompt: str | Tensor | None, n_tokens: int) -> tuple[Tensor, tuple[int, ...]]:
    """``(ids [1, T], needle positions)`` of the prompt (the pass key's tokens for the default one)."""
    if isinstance(prompt, Tensor):
        if prompt.dim() == 1:
            prompt = prompt[None]
        if prompt.dim() != 2 or prompt.shape[0] != 1 or prompt.is_floating_point():
            raise ValueError(f"prompt must be one row of token ids ([T] or [1, T]), got {prompt.dtype} {tuple(prompt.shape)}")
        return prompt.long(), ()
    if tokenizer is None:
        raise ValueError("a tokenizer is needed for a text prompt or the default passkey prompt (or pass prompt= token ids)")
    if isinstance(prompt, str):
        return tokenizer(prompt, return_tensors="pt").input_ids.long(), ()
    if prompt is not None:
        raise TypeError(f"prompt must be text, token ids or None, got {type(prompt).__name__}")
    from ..assets import passkey_prompt

    ids, key = passkey_prompt(tokenizer, n_tokens)
    return ids, _find(ids[0].tolist(), tokenizer(key, add_special_tokens=False).input_ids)


def _find(ids: list[int], part: list[int]) -> tuple[int, ...]:
    """The positions of every token of each occurrence of ``part`` in ``ids``."""
    m = len(part)
    return tuple(i + j for i in range(len(ids) - m + 1) if ids[i : i + m] == part for j in range(m))


# -------------------------------------------------------------------------------------- draw
def show(
    model: Any,
    tokenizer: Any,
    kv: KVSelector | str | None,
    *,
    proj: ProjectionSparsifier | str | None = None,
    prompt: str | Tensor | None = None,
    n_tokens: int = 1024,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    steps: int = 8,
    bound: BoundChoice = "auto",
    progress: bool = False,
) -> "Figure":
    """The picture of a KV policy on ``model``: `trace_policy` (same arguments), then `draw`.

    Returns a matplotlib `Figure`: ``fig.savefig("quest.png")`` writes it, and a notebook with
    ``%matplotlib inline`` shows it."""
    return draw(trace_policy(model, tokenizer, kv, proj=proj, prompt=prompt, n_tokens=n_tokens, layers=layers, heads=heads,
                             steps=steps, bound=bound, progress=progress))  # fmt: skip


def draw(trace: PolicyTrace) -> "Figure":
    """The figure of a `PolicyTrace`: a heat map per chosen (layer, head), the dropped mass per layer
    and, when ``trace.bounds`` names any, the page bounds against the best logits.

    Its axes carry labels (``ax.get_label()``): ``"attention L<layer> H<head>"``, ``"dropped mass"``,
    ``"page bound"`` and ``"colour bar"``."""
    figure = matplotlib_module("matplotlib.figure")  # a Figure of its own: no pyplot state to close
    pairs = [(layer, i) for layer in trace.layers for i in range(len(trace.heads))]
    fig = figure.Figure(figsize=(11.0, 1.0 + 1.15 * len(pairs) + 3.4), layout="constrained")
    grid = fig.add_gridspec(len(pairs) + 1, 2, height_ratios=[1.0] * len(pairs) + [2.9])
    maps = [fig.add_subplot(grid[row, :]) for row in range(len(pairs))]
    for ax in maps[1:]:
        ax.sharex(maps[0])
    meshes = [_attention_map(ax, trace, layer, i) for ax, (layer, i) in zip(maps, pairs)]
    bar = fig.colorbar(meshes[0], ax=maps, fraction=0.025, pad=0.01)
    bar.set_label(f"dense attention mass\nper page of {trace.page_size}", fontsize=8)
    bar.ax.set_label("colour bar")
    maps[-1].set_xlabel("prompt position (tokens); the decoded tokens follow")
    _map_legend(maps[0], bool(trace.needle))
    _dropped_panel(fig.add_subplot(grid[-1, 0] if trace.bounds else grid[-1, :]), trace)
    if trace.bounds:
        _bound_panel(fig.add_subplot(grid[-1, 1]), trace)
    fig.suptitle(_title(trace), fontsize=11)
    return fig


def _title(trace: PolicyTrace) -> str:
    keep = np.mean([k for ks in trace.keep.values() for k in ks])
    delta = torch.cat([d for ds in trace.dropped.values() for d in ds]).mean().item()
    proj = f", projections keep {np.mean(trace.proj_keep):.0%}" if trace.proj_keep else ""
    return (f"{trace.label}\n{trace.prompt_tokens}-token prompt, {trace.steps} decode steps; kept {keep:.0%} of the context "
            f"(mean over layers), mean δ {_mass(delta)}{proj}")  # fmt: skip


def _mass(x: float) -> str:
    """A probability mass for a title: three decimals, or two digits and an exponent when tiny."""
    return f"{x:.3f}" if x >= 1e-3 or x == 0 else f"{x:.1e}"


def _attention_map(ax: "Axes", trace: PolicyTrace, layer: int, i: int) -> Any:
    """One heat map: steps × pages of the dense attention mass, the kept tokens outlined."""
    from matplotlib.collections import PatchCollection
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Rectangle

    probs, kept = trace.probs[layer], trace.kept[layer]
    n = probs[-1].shape[-1]
    edges = _page_edges(trace.start, n, trace.page_size)
    mass = np.full((len(probs), len(edges) - 1), np.nan)
    for s, p in enumerate(probs):
        sums = np.add.reduceat(p[i].double().numpy(), edges[:-1][edges[:-1] < p.shape[-1]])
        mass[s, : len(sums)] = sums
    mesh = ax.pcolormesh(edges, np.arange(len(probs) + 1), np.ma.masked_invalid(np.maximum(mass, MASS_FLOOR)),
                         cmap="viridis", norm=LogNorm(MASS_FLOOR, 1.0), rasterized=True)  # fmt: skip
    boxes = [Rectangle((a, s), b - a, 1) for s, k in enumerate(kept) for a, b in kept_runs(k[i])]
    ax.add_collection(PatchCollection(boxes, facecolor="none", edgecolor="#ff3b3b", linewidth=0.8))
    if trace.needle:
        ax.plot(trace.needle, [-0.05] * len(trace.needle), "v", color="orange", markersize=5, clip_on=False)
    ax.set_xlim(0, n)
    ax.set_ylim(len(probs), 0)  # step 1 on top
    ax.set_ylabel("step", fontsize=8)
    ax.set_yticks(np.arange(len(probs)) + 0.5, [str(s + 1) for s in range(len(probs))], fontsize=6)
    ax.tick_params(axis="x", labelsize=7)
    head = trace.heads[i]
    delta = torch.stack(trace.dropped[layer])[:, head].mean().item()
    ax.set_title(f"layer {layer}, head {head} (KV head {head // trace.group}): δ {_mass(delta)} (mean over steps)",
                 fontsize=8, loc="left")  # fmt: skip
    ax.set_label(f"attention L{layer} H{head}")
    return mesh


def _page_edges(start: int, n: int, page: int) -> np.ndarray:
    """The positions where the cache's pages begin within ``n`` visible slots from ``start``, and ``n``."""
    first = -(-start // page) * page - start  # the first page boundary at or after position 0
    return np.unique(np.concatenate([[0], np.arange(first, n, page), [n]]))


def kept_runs(mask: Tensor) -> list[tuple[int, int]]:
    """``[(a, b), ...]``: the runs ``a .. b-1`` of consecutive true entries of a 1-D bool mask."""
    m = np.concatenate([[False], mask.numpy().astype(bool), [False]])
    change = np.flatnonzero(m[1:] != m[:-1])
    return list(zip(change[0::2].tolist(), change[1::2].tolist()))


def _map_legend(ax: "Axes", needle: bool) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(facecolor="none", edgecolor="#ff3b3b", label="kept by the policy")]
    if needle:
        handles.append(Line2D([], [], marker="v", color="orange", linestyle="none", label="pass key (needle)"))
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncols=2, fontsize=7, frameon=False, borderaxespad=0.1)


def _dropped_panel(ax: "Axes", trace: PolicyTrace) -> None:
    """δ per layer: the mean over steps and query heads, the 10–90% band and the largest."""
    layers = sorted(trace.dropped)
    values = [torch.stack(trace.dropped[layer]).flatten().numpy() for layer in layers]
    low, high = (np.array([np.percentile(v, q) for v in values]) for q in (10, 90))
    floor = MASS_FLOOR / 10
    ax.fill_between(layers, np.maximum(low, floor), np.maximum(high, floor), color="tab:blue", alpha=0.25, label="10–90% of steps × heads")
    ax.plot(layers, np.maximum([v.mean() for v in values], floor), "o-", color="tab:blue", markersize=3, label="mean")
    ax.plot(layers, np.maximum([v.max() for v in values], floor), ":", color="tab:red", label="largest")
    for layer in trace.layers:
        ax.axvline(layer, color="grey", linewidth=0.6, linestyle="--")
    ax.set_yscale("log")
    ax.set_ylim(floor, 1.5)
    ax.set_xlabel("layer (dashed: the heat maps')")
    ax.set_ylabel("dropped mass δ = 1 − Σ kept p")
    ax.set_title("dropped attention mass per layer", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_label("dropped mass")


def _bound_panel(ax: "Axes", trace: PolicyTrace) -> None:
    """Each page's bound against its best logit at the last step, for the chosen layers and heads."""
    colours = {"box": "tab:orange", "sketch": "tab:purple"}
    lo, hi, top = np.inf, -np.inf, -np.inf  # the best logits' range, for the diagonal; the largest bound
    for kind in trace.bounds:
        best, bound, kept = _last_step_pages(trace, kind)
        over = bound - best
        label = f"{kind} bound: {over.mean():.1f} nats over on average (least {over.min():.2f})"
        ax.scatter(best[kept], bound[kept], s=12, color=colours[kind], label=f"{label}; filled: kept")
        ax.scatter(best[~kept], bound[~kept], s=12, facecolors="none", edgecolors=colours[kind])
        lo, hi, top = min(lo, best.min()), max(hi, best.max()), max(top, bound.max())
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8, label="bound = best logit")
    ax.set_xlabel("true best logit of the page, scale·q·k")
    ax.set_ylabel("the page's upper bound")
    layers = ", ".join(map(str, trace.layers))
    ax.set_title(f"page bounds at the last step (layer{'s' * (len(trace.layers) > 1)} {layers}, the maps' heads)", fontsize=9)
    ax.grid(alpha=0.3)
    # Room under the diagonal, where no bound lies, for the legend.
    ax.set_ylim(lo - 0.4 * (top - lo), top + 0.05 * (top - lo))
    ax.legend(fontsize=7, loc="lower right")
    ax.set_label("page bound")


def _last_step_pages(trace: PolicyTrace, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(best, bound, kept)`` of every visible page of the chosen layers and heads at the last step
    (``kept``: the policy kept a token of the page)."""
    best, bound, kept = [], [], []
    for layer in trace.layers:
        k = trace.kept[layer][-1].numpy()
        edges = _page_edges(trace.start, k.shape[-1], trace.page_size)
        pages = slice(trace.start // trace.page_size, trace.start // trace.page_size + len(edges) - 1)
        best.append(trace.best[layer][-1][:, pages].flatten().numpy())
        bound.append(trace.bound[(kind, layer)][-1][:, pages].flatten().numpy())
        kept.append(np.maximum.reduceat(k, edges[:-1], axis=-1).flatten())
    return np.concatenate(best), np.concatenate(bound), np.concatenate(kept).astype(bool)

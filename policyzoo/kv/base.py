"""Shared machinery of the KV policies: state, budgets, scorers, GQA aggregation, sinks/window and
the top-k chooser. A policy is a small dataclass that composes these pieces in `select`.

Everything here works on tensors of static shape (the cache capacity, a fixed ``K_max``) and never
synchronises with the host, so a compiled decode step does not recompile as the context grows.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, is_dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence

import torch
from torch import Tensor, nn

from .. import kernels
from ..cache import SKETCH, SUMMARIES, PagedKVCache
from ..selection import Selection
from ..workers import Workers
from .context import ContextStore, StepContext

Aggregate = Literal["sum", "max"]


@dataclass
class KVState:
    """What a policy sees of one layer: the cache, visibility, the softmax scale, the policies'
    states for this layer (`layer_state_of`) and the step context (`context`)."""

    cache: PagedKVCache
    layer: int
    scale: float
    # Each policy's state for this layer and request, by policy (`layer_state_of`); the session
    # clears them before each request.
    layer_states: dict[int, Any] = field(default_factory=dict)
    contexts: ContextStore | None = field(default=None, repr=False)  # the session's; None: standalone
    # The kernels' scratch buffers for this device (`kernels.Workspace`); None: each launch makes its own.
    workspace: kernels.Workspace | None = field(default=None, repr=False)
    # Worker processes for a policy's CPU work (`policyzoo.workers`), the session's; None: this process.
    workers: Workers | None = field(default=None, repr=False)

    @property
    def context(self) -> StepContext:
        """This layer's `StepContext` (step index, previous selections, hidden state, request state).

        A state made outside a decode session (tests, a hand-driven cache) gets one of its own, at
        step 0 with nothing recorded.
        """
        if self.contexts is None:
            self.contexts = ContextStore(self.cache.num_layers, self.cache.device)
        return self.contexts.view(self.layer)

    def layer_state_of(self, policy: KVSelector) -> Any:
        """``policy``'s state for this layer and request (`KVSelector.new_layer_state`), made on first
        use and kept across steps."""
        state = self.layer_states.get(id(policy))
        if state is None:
            state = self.layer_states[id(policy)] = policy.new_layer_state()
        return state

    def share_layer_state(self, policy: KVSelector, owner: KVSelector) -> None:
        """Let ``policy`` read ``owner``'s state for this layer (a copy of ``owner`` with another
        budget that scores from the same prefill, as `Certified` keeps)."""
        self.layer_states[id(policy)] = self.layer_state_of(owner)

    def request_for(self, policy: KVSelector) -> object | None:
        """``context.request``: ``policy``'s state for this request (`KVSelector.new_request`). A
        session makes it before each prefill; a state made outside one (tests, a hand-driven cache)
        makes it here on first use."""
        contexts = self.contexts
        if contexts is None:
            contexts = self.contexts = ContextStore(self.cache.num_layers, self.cache.device)
        if contexts.request is None:
            contexts.request = policy.new_request()
        return contexts.request

    @property
    def keys(self) -> Tensor:
        return self.cache.keys[self.layer]

    @property
    def values(self) -> Tensor:
        return self.cache.values[self.layer]

    @property
    def page_size(self) -> int:
        return self.cache.page_size

    def token_valid(self) -> Tensor:
        return self.cache.token_valid()

    def page_valid(self) -> Tensor:
        return self.cache.page_counts() > 0

    def num_valid(self) -> Tensor:
        """``int64[B]``: visible tokens per row."""
        return (self.cache.length - self.cache.start).clamp(min=0)


class KVSelector:
    """Base class of KV policies.

    Life cycle per layer: `prefill` once after the dense prefill, `select` every decode step (after
    the step's token is written), `append` after each write.

    What a policy needs and offers is declared here, once, as class attributes (or properties where it
    depends on the policy's parameters); the session, the compiler and the audit read these and
    nothing else, and a wrapper (`kv.wrapper.PolicyWrapper`) derives each from the policy it wraps.
    """

    # The cache page size the policy needs (``None``: any).
    page_size: int | None = None
    # The page summaries `select` reads (names from `cache.SUMMARIES`): the Decoder's cache keeps
    # and refreshes only these. All of them unless a policy says otherwise, so that a policy written
    # before this attribute existed still finds what it reads.
    summaries: tuple[str, ...] = SUMMARIES
    # The parts of the step context `select` reads beyond the step index and the request state
    # (`kv.context.PARTS`: "previous", "below", "hidden", "rotary"); the session keeps only these.
    step_context: tuple[str, ...] = ()
    # The slot multiple a prompt's end is placed on (``None``: the page size), so that the units a
    # policy chooses group the same tokens of a row in any batch (`DecodeSession.prompt_slot`).
    slot_alignment: int | None = None
    # The attention of the model the policy serves: "softmax", or "entmax" (1.5-entmax models; the
    # attention function then attends with entmax in prefill and decode).
    attention: Literal["softmax", "entmax"] = "softmax"
    # Whether `prefill` builds per-request state the decode steps need: such a policy cannot start
    # from a dense prefix computed elsewhere (`DecodeSession.load_prefix`), and its prompt is
    # prefilled in one forward (its prefill sees the whole prompt). Undeclared, a policy that
    # overrides `prefill` is taken to have one (the safe side); the built-ins declare it.
    @property
    def own_prefill(self) -> bool:
        return type(self).prefill is not KVSelector.prefill

    # Whether selections carry ``log_weight`` (sampling corrections): a certificate, which needs the
    # unweighted normaliser, cannot take them.
    weighted: bool = False
    # Whether `select` at layer l also makes layer l+1's selection and hands it over through the step
    # context (`Forecast`): it must then run exactly once per layer and step, in layer order, so a
    # wrapper that runs it twice, skips it or changes its budget by layer cannot take it.
    selects_ahead: bool = False
    # Whether `select` depends on its layer only through the layer's tensors (not through
    # ``state.layer`` or per-layer constants of its own): one compiled decoder layer can then serve
    # every layer (`policyzoo.regional`). A subclass whose `select` reads ``state.layer`` sets False.
    layer_invariant: bool = False
    # Whether the policy rescores candidates exactly in a second stage (``rescore`` > 0).
    two_stage: bool = False

    def new_request(self) -> object | None:
        """A fresh state object for one request (one batch of sequences), shared by every layer as
        ``state.context.request``: the session makes it before each prefill and drops it with the
        request. A typed object (a dataclass), not a dict of string keys; ``None`` (the default):
        the policy keeps no state across layers. Tensors in it follow the step context's rule: made
        in `prefill` (eager), updated in place."""
        return None

    def new_layer_state(self) -> Any:
        """A fresh state object for one layer of one request (a dataclass of the policy's own), kept
        across steps and read as ``state.layer_state_of(self)``; the session drops it with the
        request. ``None`` (the default): the policy keeps no per-layer state. Tensors in it follow the
        step context's rule: made in `prefill` (eager), updated in place."""
        return None

    def reset_random(self) -> None:
        """Restart the policy's random stream from its seed (a policy that samples), so that a
        request's draws do not depend on the requests before it; nothing for the others."""

    def attach(self, model: nn.Module) -> None:
        """Called once when a Decoder takes the policy for ``model`` (before it moves the policy's
        learned parts to the model's device): a policy that builds or checks something against the
        model's weights or shapes does it here (`Forecast` starts its heads from the model's)."""

    def prefill(self, state: KVState, q: Tensor, k: Tensor, v: Tensor) -> None:
        """Called once per layer after the dense prefill; ``q [B, H, T, D]``, ``k, v [B, H_kv, T, D]``."""

    def finish_prefill(self, states: Sequence[KVState]) -> None:
        """Complete the prefill of ``states`` (layers whose `prefill` has run) before their first
        `select`. The session calls it once after the prompt's forward, with every layer's state (and
        for one layer at once where a select follows its prefill directly): a policy whose prefill
        hands work to other processes (`CommunityKV`'s graph partitions) waits for it here, so the
        work of all layers runs at once, beside the forward."""

    def select(self, state: KVState, q: Tensor) -> Selection:
        """Return the entries the query ``q [B, H, D]`` attends to."""
        raise NotImplementedError  # abstract

    def append(self, state: KVState, k: Tensor, v: Tensor) -> None:
        """Called after each decode token is written (the cache keeps page summaries itself)."""

    # ----------------------------------------------------------- the next layer's selection
    # A policy whose `select` at layer l already makes layer l+1's selection says so here; an
    # offloaded layer l+1 then fetches those pages while layer l runs (`offload.PageCache.prefetch`).

    def predicts_layer(self, layer: int) -> bool:
        """Whether layer ``layer``'s selection is made while layer ``layer - 1`` selects (fixed per
        layer: a compiled step decides by it)."""
        return False

    def next_layer_selection(self, state: KVState, sel: Selection) -> Selection | None:
        """Layer ``state.layer + 1``'s selection at this step, after this layer's `select` returned
        ``sel``: a selection wherever `predicts_layer(state.layer + 1)`, else ``None``."""
        return None

    # ------------------------------------------------------------------ learned parameters
    # A policy may own parameters: any attribute that is an `nn.Module` (a scoring head, say). The
    # Decoder moves them to the model's device and dtype; `save` and `load` keep them in a
    # safetensors file together with the policy's parameters (its dataclass fields).

    def modules(self) -> dict[str, nn.Module]:
        """The policy's learned parts: its attributes that are `nn.Module`s, by name."""
        return {name: value for name, value in vars(self).items() if isinstance(value, nn.Module)}

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every learned parameter (none for a policy without modules)."""
        for module in self.modules().values():
            yield from module.parameters()

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "KVSelector":
        """Move the learned parts (floating-point tensors take ``dtype``); returns the policy."""
        for module in self.modules().values():
            module.to(device=device, dtype=dtype)
        return self

    def state_dict(self) -> dict[str, Tensor]:
        """``{"<module>.<name>": tensor}`` of every learned part."""
        return {f"{name}.{key}": value for name, module in self.modules().items() for key, value in module.state_dict().items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> "KVSelector":
        """Load `state_dict` output into the learned parts, strictly: every key, every shape."""
        modules = self.modules()
        owner = type(self).__name__
        unknown = sorted({key.split(".", 1)[0] for key in state} - set(modules))
        if unknown:
            raise ValueError(f"{owner} has no learned part {unknown[0]!r} (its parts: {sorted(modules) or 'none'})")
        for name, module in modules.items():
            part = {key.split(".", 1)[1]: value for key, value in state.items() if key.split(".", 1)[0] == name}
            try:
                module.load_state_dict(part, strict=True)
            except RuntimeError as e:
                raise ValueError(f"{owner}.{name}: the saved tensors do not fit ({e})") from None
        return self

    def save(self, path: str | Path) -> Path:
        """Write the learned parts and the policy's parameters to a safetensors file."""
        from safetensors.torch import save_file

        if not self.modules():
            raise ValueError(f"{type(self).__name__} has no learned parameters to save")
        tensors = {key: value.detach().contiguous().cpu() for key, value in self.state_dict().items()}
        meta = {"policy": type(self).__name__, "params": json.dumps(policy_params(self))}
        save_file(tensors, str(path), metadata=meta)
        return Path(path)

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> "KVSelector":
        """A policy of this class built with the parameters saved in ``path`` (``overrides`` replace
        some, e.g. the budget), its learned parts loaded from the file."""
        meta, tensors = read_policy_file(path, cls.__name__)
        params = {**json.loads(meta.get("params", "{}")), **overrides}
        return cls(**params).load_state_dict(tensors)


def read_policy_file(path: str | Path, owner: str) -> tuple[dict[str, str], dict[str, Tensor]]:
    """``(metadata, tensors)`` of a policy file that `KVSelector.save` (or a subclass's) wrote for
    class ``owner``; a clear error for a missing file or another policy's."""
    from ..files import read_safetensors

    meta, tensors = read_safetensors(path, "no policy file", f"is not a safetensors file written by {owner}.save")
    if meta.get("policy") != owner:
        what = f"a {meta['policy']} policy" if "policy" in meta else f"{meta['kind']!r} data" if "kind" in meta else "no policyzoo policy"
        raise ValueError(f"{str(path)!r} holds {what}, not {owner}")
    return meta, tensors


def policy_params(policy: KVSelector) -> dict[str, Any]:
    """A policy's JSON-ready parameters: its dataclass fields that the constructor takes."""
    if not is_dataclass(policy):
        return {}
    out = {}
    for f in fields(policy):
        value = getattr(policy, f.name)
        if f.init and isinstance(value, (bool, int, float, str, type(None), list, tuple)):
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


# ------------------------------------------------------------------------------------ budgets
@dataclass(frozen=True)
class Budget:
    """A number of tokens (``int > 0``) or a keep ratio of the visible context (``float in (0, 1]``)."""

    value: int | float

    def __post_init__(self) -> None:
        check_budget(self.value, "budget")

    @property
    def is_ratio(self) -> bool:
        return isinstance(self.value, float)

    def k_max(self, capacity: int) -> int:
        """Static selection width for a cache of ``capacity`` entries."""
        if self.is_ratio:
            return max(1, min(capacity, math.ceil(self.value * capacity - 1e-9)))
        return max(1, min(capacity, int(self.value)))

    def count(self, n_valid: Tensor) -> Tensor:
        """Entries to keep given ``n_valid`` visible entries (a tensor; no host sync)."""
        if self.is_ratio:
            # The epsilon absorbs float error (0.07 * 100 is 7.000000000000001, which must keep 7).
            return torch.ceil(n_valid.double() * self.value - 1e-9).long()
        return torch.full_like(n_valid, int(self.value))


# The largest token count a policy parameter may hold: far beyond any context, and small enough that
# position arithmetic on it (``start + sinks``, ``length - window``) cannot overflow int64.
MAX_COUNT = 2**62


def check_budget(value: object, name: str) -> None:
    """Raise a clear error unless ``value`` is a positive token count or a keep ratio in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be an int (tokens) or a float keep ratio, got {type(value).__name__}")
    if isinstance(value, float) and not 0.0 < value <= 1.0:
        raise ValueError(f"{name} as a keep ratio must be in (0, 1], got {value}")
    if isinstance(value, int) and not 0 < value <= MAX_COUNT:
        raise ValueError(f"{name} must be a positive number of tokens (at most 2**62), got {value}")


def check_count(value: object, name: str, minimum: int = 0, maximum: int | None = MAX_COUNT) -> None:
    """Raise a clear error unless ``value`` is an int in ``[minimum, maximum]`` (``None``: no maximum)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {'2**62' if maximum == MAX_COUNT else maximum}, got {value}")


# ------------------------------------------------------------------------------------ scorers
def exact_scores(state: KVState, q: Tensor) -> Tensor:
    """``float32[B, H, N]``: exact ``scale·q·k`` for every cache slot (reads all keys)."""
    b, h, d = q.shape
    keys = state.keys
    qg = q.to(keys.dtype).view(b, keys.shape[1], h // keys.shape[1], d)
    # In the cache's dtype (matmuls accumulate in fp32): upcasting the keys first would write and
    # re-read a float copy of the whole cache every step.
    s = torch.matmul(qg, keys.transpose(-1, -2)).float() * state.scale
    return s.reshape(b, h, -1)


PageBound = Literal["box", "sketch"]
PAGE_BOUNDS = ("box", "sketch")


def check_page_bound(value: object) -> None:
    """A page policy's ``bound``: ``"box"`` (Quest's min/max) or ``"sketch"`` (the 4-bit key sketch)."""
    if value not in PAGE_BOUNDS:
        raise ValueError(f"bound must be one of {PAGE_BOUNDS}, got {value!r}")


def bound_summaries(bound: PageBound) -> tuple[str, ...]:
    """The cache summaries a page bound of kind ``bound`` reads."""
    return ("page_min", "page_max", SKETCH) if bound == "sketch" else ("page_min", "page_max")


def page_bound_scores(state: KVState, q: Tensor, bound: PageBound = "box") -> Tensor:
    """``float32[B, H, P]``: an upper bound of ``scale·q·k`` per page and query head.

    ``"box"``: Quest's ``Σ_d max(q_d·min_d, q_d·max_d)`` from the page min/max, which overshoots a
    page's best key by many nats on real models (13 on SmolLM2, pages of 16). ``"sketch"``: the best
    per-token bound of the page from the 4-bit key sketch (`kernels.sketch_page_bound`), about a nat
    over; ``-inf`` on pages without visible tokens."""
    c = state.cache
    if bound == "sketch":
        return kernels.sketch_page_bound(q, c.key_sketch[state.layer], c.page_min[state.layer], c.page_max[state.layer],
                                         c.start, c.length, state.scale)
    return kernels.quest_page_bound(q, c.page_min[state.layer], c.page_max[state.layer], state.scale)


def group_page_bounds(state: KVState, q: Tensor, bound: PageBound = "box") -> Tensor:
    """``float32[B, H_kv, P]``: the largest page bound over each GQA group's query heads, ``-inf`` on
    pages without visible tokens. Equal to ``aggregate_groups(page_bound_scores(...), ..., "max")``,
    but the kernel folds the group itself, so the per-head bounds ``[B, H, P]`` are never written."""
    c = state.cache
    if bound == "sketch":
        return kernels.sketch_page_bound(q, c.key_sketch[state.layer], c.page_min[state.layer], c.page_max[state.layer],
                                         c.start, c.length, state.scale, "max")
    out = kernels.quest_page_bound_grouped(q, c.page_min[state.layer], c.page_max[state.layer], state.scale, "max")
    return out.masked_fill(~state.page_valid()[:, None, :], -torch.inf)


def token_bound_scores(state: KVState, q: Tensor) -> Tensor:
    """``float32[B, H, N]``: an upper bound of ``scale·q·k_t`` for every cache slot from the key
    sketch (`reference.sketch_token_bound`), ``-inf`` where the slot is not visible. Reads the sketch
    of the whole cache: for certificates and audits, not for a fast selection."""
    c = state.cache
    tb = kernels.reference.sketch_token_bound(q, c.key_sketch[state.layer], c.page_min[state.layer], c.page_max[state.layer], state.scale)
    return tb.masked_fill(~state.token_valid()[:, None, :], -torch.inf)


def aggregate_groups(scores: Tensor, valid: Tensor, num_kv_heads: int, how: Aggregate) -> Tensor:
    """Fold per-query-head logits ``[B, H, N]`` into one score per KV head ``[B, H_kv, N]``.

    ``"max"`` keeps the largest logit of the group; ``"sum"`` sums the group's softmax
    probabilities (the selection then maximises the group's kept mass). Invalid entries are -inf.
    """
    b, h, n = scores.shape
    s = scores.view(b, num_kv_heads, h // num_kv_heads, n).masked_fill(~valid[:, None, None, :], -torch.inf)
    if how == "max":
        out = s.amax(2)
    elif how == "sum":
        out = torch.softmax(s, dim=-1).nan_to_num(0.0).sum(2)
    else:
        raise ValueError(f"aggregate must be 'sum' or 'max', got {how!r}")
    return out.masked_fill(~valid[:, None, :], -torch.inf)


# ------------------------------------------------------------------------------ sinks, window
def forced_tokens(state: KVState, sinks: int, window: int) -> Tensor:
    """``bool[B, N]``: the first ``sinks`` and the last ``window`` visible tokens of each row."""
    pos = torch.arange(state.cache.capacity, device=state.keys.device)
    return forced_at(state, pos.expand(state.cache.batch, -1), sinks, window)


def forced_at(state: KVState, slots: Tensor, sinks: int, window: int) -> Tensor:
    """`forced_tokens` at ``slots int64[B, ...]`` only (the same shape): the flags of a few slots
    without building, or gathering from, a tensor the size of the cache."""
    shape = (slots.shape[0],) + (1,) * (slots.dim() - 1)
    start, length = state.cache.start.view(shape), state.cache.length.reshape(-1, *shape[1:])
    return state.cache.visible_at(slots) & ((slots < start + sinks) | (slots >= length - window))


def forced_pages(state: KVState, sinks: int, window: int) -> Tensor:
    """``bool[B, P]``: pages holding any forced token (the last page is always forced).

    Computed in page space (the visible slot range of each page against the sink and window
    ranges), not by folding `forced_tokens` over the whole capacity: a step then touches P
    entries, not P·page.
    """
    c = state.cache
    first, last = c.page_spans()
    holds_sink = first < c.start[:, None] + sinks
    holds_window = last > c.length - max(window, 1)
    return (first < last) & (holds_sink | holds_window)


def forced_pages_at(state: KVState, pages: Tensor, sinks: int, window: int) -> Tensor:
    """`forced_pages` at the page ids ``pages int[B, ...]`` only (the same shape), from the pages'
    visible spans: the flags of a few listed pages without building the flags of every page."""
    c = state.cache
    shape = (pages.shape[0],) + (1,) * (pages.dim() - 1)
    lo = pages.long() * c.page_size
    start, length = c.start.view(shape), c.length.reshape(-1, *shape[1:])
    first, last = torch.maximum(lo, start), torch.minimum(lo + c.page_size, length)
    return (first < last) & ((first < start + sinks) | (last > length - max(window, 1)))


def page_budget(state: KVState, budget: Budget, page: int, sinks: int, window: int, owner: str) -> tuple[int, Tensor]:
    """``(k_max, count)`` in pages for a page policy: ``budget`` tokens become ``ceil(budget / page)``
    pages, a ratio applies to the visible pages; ``k_max`` always has room for the forced pages."""
    k_max = page_k_max(state, budget, page, sinks, window, owner)
    n_visible = state.page_valid().sum(-1)
    count = budget.count(n_visible) if budget.is_ratio else Budget(math.ceil(budget.value / page)).count(n_visible)
    return k_max, count


def page_k_max(state: KVState, budget: Budget, page: int, sinks: int, window: int, owner: str) -> int:
    """`page_budget`'s static width alone (its count is then the policy's `Budget`, `page_count_rule`)."""
    if state.page_size != page:
        raise ValueError(f"{owner}(page={page}) needs a cache with page_size={page}, got {state.page_size}")
    n_pages = state.cache.num_pages
    k_max = budget.k_max(n_pages) if budget.is_ratio else min(n_pages, math.ceil(budget.value / page))
    # Sinks and window may each straddle one more page than their length needs.
    n_forced = math.ceil(sinks / page) + math.ceil(max(window, 1) / page) + 2
    return max(k_max, min(n_pages, n_forced))


def page_count_rule(budget: Budget, page: int) -> tuple[float, int]:
    """`page_budget`'s count as the rule a fused selection evaluates on the device
    (`kernels.select_pages`): ``(ratio, 0)`` for a keep ratio of the visible pages, else
    ``(0.0, ceil(budget / page))`` pages."""
    return (float(budget.value), 0) if budget.is_ratio else (0.0, math.ceil(budget.value / page))


# ------------------------------------------------------------------------------------ chooser
def round_for_ranking(scores: Tensor) -> Tensor:
    """``float32`` scores rounded to 8 significant bits (bf16 precision, to nearest), ``±inf`` kept.

    Done on the bits with integer ops: a cast to bf16 and back is no rounding under torch.compile,
    which keeps fused intermediates in fp32 (`kernels.reference.round_for_ranking`).
    """
    return kernels.reference.round_for_ranking(scores)


def fused_rows(n: int) -> bool:
    """Whether a choice over rows of ``n`` given scores is one launch (`kernels.select_scores`);
    longer rows take the steps (the masks, the ranking, `select_top`), faster there
    (`kernels.ops.select_pages.MAX_SCORES_ROW`)."""
    return kernels.select_scores_takes(n)


def choose_topk(scores: Tensor, forced: Tensor, k_max: int, count: Tensor, block: int = 1, *,
                workspace: kernels.Workspace | None = None) -> Selection:
    """Keep the forced entries plus the best-scoring others, at most ``count`` per row.

    Args:
        scores: ``[B, H_kv, N]``, ``-inf`` where the entry is invalid.
        forced: ``bool[B, N]`` (or ``[B, H_kv, N]``) entries always kept (they outrank every score).
        k_max: static width of the selection.
        count: entries wanted, ``int64[B]`` per row or ``[B, H_kv]`` per KV head; raised to the
            number of forced entries, capped at ``k_max`` and at the number of valid entries.
        workspace: the kernels' scratch (`KVState.workspace`); None: the kernel makes its own.

    The kept entries come in ascending position order (the reads then follow memory order). Rows of
    up to `kernels.ops.select_pages.MAX_SCORES_ROW` entries are one launch (`kernels.select_scores`); longer
    ones take the steps (`choose_topk_steps`: `kernels.select_top` after the masks), with the same result.

    Scores are ranked at bf16 precision (8 significant bits), and ties go to the lowest position.
    The same score computed by a compiled and an eager step can differ in its last bits (Inductor
    sums in another order), which would break near-ties differently; rounded, they tie, so both
    paths keep the same entries. Scores that round to the same bf16 value count as equal: they differ
    by less than one bf16 step, at most 2^-7 (0.8%) of their size.
    """
    b, h_kv, n = scores.shape
    if fused_rows(n):  # the masks, counts, ranking and selection in one launch
        indices, kept = kernels.select_scores(scores, forced, count, k_max, workspace=workspace)
        return Selection(indices=indices, count=kept, block=block)
    return choose_topk_steps(scores, forced, k_max, count, block, workspace=workspace)


def choose_topk_steps(scores: Tensor, forced: Tensor, k_max: int, count: Tensor, block: int = 1, *,
                      workspace: kernels.Workspace | None = None) -> Selection:
    """`choose_topk` as the steps it is made of: the masks and counts in torch, then `select_top`
    (its histograms for long bf16 rows). The fused kernel's specification, and the path of rows
    longer than it takes."""
    b, h_kv, n = scores.shape
    valid = scores > -torch.inf
    forced = (forced if forced.dim() == 3 else forced[:, None, :]) & valid
    ranked = round_for_ranking(torch.where(forced, torch.inf, scores))
    if n > kernels.SELECT_TOP_ROW:  # too long for one program: the kernel takes it in bf16 (exact here)
        ranked = ranked.to(torch.bfloat16)
    n_forced = forced.sum(-1)
    n_valid = valid.sum(-1)
    want = torch.maximum(count if count.dim() == 2 else count[:, None], n_forced).clamp(max=k_max)
    kept = torch.minimum(want, n_valid).int()
    idx = kernels.select_top(ranked.reshape(b * h_kv, n), kept.reshape(-1), k_max, workspace=workspace)
    return Selection(indices=idx.view(b, h_kv, k_max), count=kept, block=block)


# ------------------------------------------------------------------------------- second stage
def check_rescore(value: object, name: str = "rescore") -> None:
    """A page policy's ``rescore`` (or ``nominate``): 0 (off) or a candidate factor of at least 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value == 0 or 1 <= value < math.inf):
        raise ValueError(f"{name} must be 0 (off) or a finite candidate factor >= 1, got {value!r}")


def candidate_budget(k_max: int, count: Tensor, factor: float, n_pages: int) -> tuple[int, Tensor]:
    """``(k_max, count)`` of the candidate pages of a two-stage selection: ``factor`` times the kept
    pages (rounded up), within the cache's pages.

    ``factor`` is taken as the nearest fraction ``p/q`` with ``q <= 64`` (exact for whole numbers and
    halves), so that the counts are integer arithmetic: Inductor's Triton code failed on the float
    ``ceil`` of an int64 count on CUDA (torch 2.11)."""
    ratio = Fraction(factor).limit_denominator(64)
    p, q = ratio.numerator, ratio.denominator
    wide = min(n_pages, -(-k_max * p // q))
    return wide, torch.div(count * p + (q - 1), q, rounding_mode="floor").clamp(max=wide)


def selection_logits(state: KVState, q: Tensor, pages: Selection, agg: str = "none") -> tuple[Tensor, Tensor, Tensor]:
    """``(logits float32[B, H_kv, G, N], slots int64[B, H_kv, N], valid bool[B, H_kv, N])``: the exact
    ``scale·q·k`` of every token of the selection ``pages`` (a second stage's candidates, or any
    token or page selection; slots in its order, ascending for a policy's; ``-inf`` where invalid),
    or with ``agg="max"`` the group's best, ``[B, H_kv, N]``. Reads the selection's keys, not its
    values."""
    slots, entry = pages.token_positions()
    slots = slots.clamp(max=state.cache.capacity - 1)
    valid = entry & state.cache.visible_at(slots)
    logits = kernels.gathered_logits(q, state.keys, slots, state.scale, agg)
    return logits.masked_fill(~(valid if agg == "max" else valid[:, :, None, :]), -torch.inf), slots, valid


def rescore_pages(
    state: KVState, q: Tensor, pages: Selection, count: Tensor, k_max: int, sinks: int, window: int,
    aggregate: Aggregate = "max",
) -> Selection:
    """Stage two of a page policy: exact logits over the tokens of its candidate ``pages``, then the
    forced tokens (sinks, window, the step's own token) and the best others, ``count`` tokens at most
    (``k_max`` wide), as a token selection.

    It reads the candidates' keys, not their values: `AttentionTopK`'s exact scores, over the
    candidates only. A page bound ranks pages by how high a key *could* score; here the tokens
    compete on how high they do. ``aggregate`` folds the GQA group as `aggregate_groups` does.
    """
    if aggregate == "max":  # the group's max inside the kernel: the per-head logits are never written
        scores, slots, valid = selection_logits(state, q, pages, "max")
    else:
        logits, slots, valid = selection_logits(state, q, pages)
        scores = torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(2).masked_fill(~valid, -torch.inf)
    # The step's own token is always kept, as a page policy always keeps the last page.
    forced = forced_at(state, slots, sinks, max(window, 1)) & valid
    chosen = choose_topk(scores, forced, min(k_max, slots.shape[-1]), count, workspace=state.workspace)
    return Selection(torch.gather(slots, 2, chosen.indices.long()).int(), chosen.count, block=1)


def page_log_mass(state: KVState, q: Tensor, bounds: Tensor, pages: Selection) -> Tensor:
    """``float32[B, H, P]``: per query head, each page's log softmax numerator ``log Σ_{t∈p} e^{z_t}``:
    exact for the candidate ``pages`` (from their keys), estimated elsewhere (``-inf`` on empty pages).

    The estimate starts from the bound ``u_p + log n_p`` (``bounds [B, H, P]``) and subtracts how far
    that bound overshot the exact value on this head's candidates (their mean). The bound alone
    overshoots by many nats on real models, so next to exact values it would outrank every
    candidate. Outside the candidates this is an estimate, not a bound: fine for ranking and for a
    sampling distribution, which any positive probabilities keep unbiased."""
    b, h, n_pages = bounds.shape
    h_kv, page = state.keys.shape[1], pages.block
    logits, _, _ = selection_logits(state, q, pages)
    exact = torch.logsumexp(logits.view(b, h_kv, h // h_kv, pages.k_max, page), dim=-1)  # [B, H_kv, G, K]
    counts = state.cache.page_counts()[:, None, :].float()  # [B, 1, P]
    mass = (bounds + counts.log()).view(b, h_kv, h // h_kv, n_pages)
    ok = pages.entry_valid()[:, :, None, :] & (exact > -torch.inf)
    ids = torch.where(ok, pages.indices.long()[:, :, None, :], n_pages)  # invalid entries land in spare slot P
    bound_at = torch.gather(mass, 3, ids.clamp(max=n_pages - 1))
    over = torch.where(ok, bound_at - exact, 0.0).sum(-1, keepdim=True) / ok.sum(-1, keepdim=True).clamp(min=1)
    spare = torch.cat([mass - over, mass.new_zeros(b, h_kv, h // h_kv, 1)], dim=-1)
    return spare.scatter(3, ids, torch.where(ok, exact, 0.0))[..., :n_pages].reshape(b, h, n_pages)


def nominate_pages(state: KVState, q: Tensor, scores: Tensor, forced: Tensor, k_max: int, count: Tensor,
                   factor: float) -> Selection:
    """Two-level page choice: the cheap page ``scores`` (the box bound, group-folded, ``[B, H_kv, P]``)
    nominate ``factor`` times the pages as candidates (`candidate_budget`); the key-sketch bound of
    those candidates alone ranks them, and the best ``count`` (forced pages first) are kept, ascending.

    The sketch's codes are read for the candidates only, so the step reads the box summaries, plus
    ``factor`` times the budget's codes, not the sketch of the whole cache. A page the box does not
    nominate is never kept: the fidelity rests on the box ranking the right page in its top
    ``factor × budget``, which is much weaker than ranking it in its top budget."""
    wide, wide_count = candidate_budget(k_max, count, factor, state.cache.num_pages)
    candidates = choose_topk(scores, forced, wide, wide_count, block=state.page_size, workspace=state.workspace)
    listed = candidates.indices.masked_fill(~candidates.entry_valid(), -1)  # -1: the kernel's empty entry
    forced = forced if forced.dim() == 3 else forced[:, None, :].expand_as(scores)
    forced_listed = torch.gather(forced, 2, listed.clamp(min=0).long()) & (listed >= 0)
    return rank_candidates(state, q, candidates, forced_listed, k_max, count)


def rank_candidates(state: KVState, q: Tensor, candidates: Selection, forced: Tensor, k_max: int,
                    count: Tensor) -> Selection:
    """Keep the best ``count`` of the candidate ``pages`` by their key-sketch bound (the group's max),
    the candidates flagged in ``forced`` (``bool``, shaped as their indices) first; ascending."""
    c = state.cache
    listed = candidates.indices.masked_fill(~candidates.entry_valid(), -1)  # -1: the kernel's empty entry
    sketch = kernels.sketch_page_bound(q, c.key_sketch[state.layer], c.page_min[state.layer], c.page_max[state.layer],
                                       c.start, c.length, state.scale, "max", listed)  # [B, H_kv, wide]
    chosen = choose_topk(sketch, forced, min(k_max, candidates.k_max), count, workspace=state.workspace)
    # Candidates ascend and so do the chosen entries: the kept page ids ascend too.
    return Selection(torch.gather(candidates.indices, 2, chosen.indices.long()), chosen.count, block=state.page_size)


def box_pages(state: KVState, q: Tensor, k_max: int, count: Tensor | Budget, sinks: int, window: int) -> Selection:
    """The top pages by the box bound folded by each group's max (`group_page_bounds`), the pages of
    the ``sinks`` and ``window`` first (`forced_pages`), at most ``count`` per row (a tensor, or the
    policy's `Budget` of the visible pages), ascending: `choose_topk` of those, with the bound and
    the choice in one launch (`kernels.select_pages`: neither the bounds nor the flags are written)."""
    c, page = state.cache, state.page_size
    if not kernels.select_pages_takes(c.num_pages):
        if isinstance(count, Budget):
            count = kernels.reference.page_count(state.page_valid().sum(-1), *page_count_rule(count, page))
        return choose_topk(group_page_bounds(state, q, "box"), forced_pages(state, sinks, window), k_max, count,
                           block=page, workspace=state.workspace)
    ratio, pages = page_count_rule(count, page) if isinstance(count, Budget) else (0.0, 0)
    indices, kept = kernels.select_pages(q, c.page_min[state.layer], c.page_max[state.layer], c.start, c.length,
                                         state.scale, k_max, None if isinstance(count, Budget) else count, page,
                                         sinks, window, ratio, pages, workspace=state.workspace)
    return Selection(indices, kept, block=page)


def choose_pages(
    state: KVState, q: Tensor, scores: Tensor | None, forced: Tensor | None, k_max: int, count: Tensor | Budget, *,
    rescore: float = 0.0, nominate: float = 0.0, sinks: int = 0, window: int = 0, aggregate: Aggregate = "max",
) -> Selection:
    """A page policy's choice from its page ``scores``: the top pages (`choose_topk`), or with
    ``nominate`` >= 1 the best by key sketch among that many times the pages (`nominate_pages`; the
    ``scores`` are then the box bound's, folded by group max). With ``rescore`` >= 1, that many times
    the pages are chosen so, as candidates of which `rescore_pages` keeps the best tokens (the same
    token budget).

    ``scores=None`` (and ``forced=None``): the pages are ranked by the box bound folded by the group's
    max, the pages of ``sinks`` and ``window`` forced, and that choice is one launch (`box_pages`);
    ``count`` may then be the policy's `Budget`, evaluated on the device. The same selection as the
    scores of `group_page_bounds` and the flags of `forced_pages`."""
    page, n_pages = state.page_size, state.cache.num_pages
    if isinstance(count, Budget) and (rescore or nominate or scores is not None):
        count = kernels.reference.page_count(state.page_valid().sum(-1), *page_count_rule(count, page))
    k_pages, pages_count = candidate_budget(k_max, count, rescore, n_pages) if rescore else (k_max, count)
    if nominate and scores is None:
        wide, wide_count = candidate_budget(k_pages, pages_count, nominate, n_pages)
        candidates = box_pages(state, q, wide, wide_count, sinks, window)
        listed = candidates.indices.masked_fill(~candidates.entry_valid(), -1)
        forced_listed = forced_pages_at(state, listed.clamp(min=0), sinks, window) & (listed >= 0)
        pages = rank_candidates(state, q, candidates, forced_listed, k_pages, pages_count)
    elif nominate:
        pages = nominate_pages(state, q, scores, forced, k_pages, pages_count, nominate)
    elif scores is None:
        pages = box_pages(state, q, k_pages, pages_count, sinks, window)
    else:
        pages = choose_topk(scores, forced, k_pages, pages_count, block=page, workspace=state.workspace)
    if not rescore:
        return pages
    return rescore_pages(state, q, pages, count * page, k_max * page, sinks, window, aggregate)

"""`Forecast`: a learned next-layer block selector (SparDA's Forecast projection, Fu et al., 2026).

At layer ``l`` a small projection of the hidden state entering the layer, one head per GQA group,
predicts a query for layer ``l + 1``; scored against layer ``l + 1``'s compressed keys, it chooses the
blocks that layer attends to, one layer ahead (so a cache that lives elsewhere can fetch them while
layer ``l`` runs). Layer 0 has a head of its own that predicts its own query.

Compressed keys, blocks and scores (the InfLLM-V2 geometry SparDA uses):

- a compressed key is the mean of the visible keys in a window of ``kernel`` tokens, windows every
  ``stride`` tokens (32 and 16): the policy keeps one mean key per page of ``stride`` tokens (in the
  cache's dtype, updated in place as tokens are appended) and, the score being linear in the key,
  scores a window as the token-weighted mean of its pages' scores;
- a block of ``block`` tokens (64) scores the largest of the windows that overlap it;
- the blocks holding the first ``sinks`` and the last ``window`` tokens are always kept, the step's
  own block too, then the best others up to the budget (in blocks).

With ``rescore=r`` (our extension, not SparDA's) the forecast only nominates: ``r`` times the
budget's blocks are chosen one layer ahead (what a prefetch fetches), and the layer, which knows its
own query, keeps the budget's blocks among them, ranked by their best exact logit (the group's max
over the block's keys, `kv.choose.selection_logits`): the predicted query need only rank a needle's
block among the candidates, not among the budget. The selection stays one of blocks, so an
offloaded layer's page cache serves it and the attention reads whole pages.

The heads (`ForecastHeads`) are the policy's learned parameters: a parameter-free RMS norm, then a
rank-``rank`` projection to ``H_kv · D``, rotated with the model's own rotary embedding of the step's
token (`StepContext.rotary`). Untrained heads start from the model's query projections
(`ForecastHeads.from_model`: the next layer's grouped query projection, truncated to the rank by
SVD); ``recipes/forecast`` trains them against the next layer's attention over blocks.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _compat
from ..selection import Selection
from .base import Budget, KVSelector, KVState, check_count, policy_params, read_policy_file
from .choose import candidate_budget, check_rescore, choose_topk, selection_logits
from .registry import register


class ForecastHeads(nn.Module):
    """One low-rank head per layer: head ``i`` predicts layer ``i``'s query, one per GQA group
    (``[..., H_kv, D]``, before the rotary embedding), from the hidden state entering layer ``i - 1``
    (head 0: entering layer 0).

    ``down [L, d_model, rank]`` and ``up [L, rank, H_kv · D]``: ``rank · (d_model + H_kv · D)``
    parameters per layer.
    """

    def __init__(self, num_layers: int, hidden: int, kv_heads: int, head_dim: int, rank: int = 32) -> None:
        super().__init__()
        for name, value in {"num_layers": num_layers, "hidden": hidden, "kv_heads": kv_heads, "head_dim": head_dim, "rank": rank}.items():
            check_count(value, name, minimum=1)
        self.kv_heads, self.head_dim = kv_heads, head_dim
        # (H_kv, D) again as a tensor, saved with the weights so that a file alone rebuilds the heads
        self.register_buffer("geometry", torch.tensor([kv_heads, head_dim]))
        g = torch.Generator().manual_seed(0)
        self.down = nn.Parameter(torch.randn(num_layers, hidden, rank, generator=g) / math.sqrt(hidden))
        self.up = nn.Parameter(torch.randn(num_layers, rank, kv_heads * head_dim, generator=g) / math.sqrt(rank))

    @property
    def num_layers(self) -> int:
        return self.down.shape[0]

    @property
    def rank(self) -> int:
        return self.down.shape[2]

    def forward(self, hidden: Tensor, layer: int) -> Tensor:
        """``[..., H_kv, D]`` (fp32): head ``layer``'s query from ``hidden [..., d_model]``.

        The products run in the heads' dtype (bf16 on a bf16 model: fp32 accumulation), so a decode
        step reads the weights once, without widened copies."""
        x = hidden.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        down, up = self.down[layer], self.up[layer]
        out = (x.to(down.dtype) @ down) @ up
        return out.float().unflatten(-1, (self.kv_heads, self.head_dim))

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> "ForecastHeads":
        """Heads of the shapes ``tensors`` (a `state_dict`, keys ``down`` and ``up``) hold, loaded."""
        try:
            down, up, geometry = tensors["down"], tensors["up"], tensors["geometry"]
        except KeyError:
            raise ValueError(f"Forecast heads need tensors 'down', 'up' and 'geometry', got {sorted(tensors)}") from None
        layers, hidden, rank = down.shape
        kv_heads, head_dim = (int(x) for x in geometry)
        heads = cls(layers, hidden, kv_heads, head_dim, rank)
        try:
            heads.load_state_dict(tensors, strict=True)
        except RuntimeError as e:
            raise ValueError(f"Forecast heads: the saved tensors do not fit ({e})") from None
        return heads

    @classmethod
    def from_model(cls, model: nn.Module, rank: int | None = None) -> "ForecastHeads":
        """Heads initialised from ``model``'s own query projections (untrained, but a useful start):
        head ``i`` is layer ``i``'s query projection (its input norm's gain folded in), the query
        heads of each GQA group summed, truncated to ``rank`` (``None``: `default_rank`) by SVD. A
        model whose attention has no ``q_proj`` gets random heads."""
        rank = default_rank(model) if rank is None else rank
        config = model.config
        hidden, heads = config.hidden_size, config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        layers = _compat.decoder_layers(model)
        out = cls(len(layers), hidden, kv_heads, head_dim, rank)
        with torch.no_grad():
            for i, (block, attn) in enumerate(zip(layers, _compat.attention_modules(model))):
                q_proj = getattr(attn, "q_proj", None)
                q_proj = getattr(q_proj, "linear", q_proj)  # a projection a Decoder wrapped holds the linear
                if q_proj is None or q_proj.weight.shape != (heads * head_dim, hidden):
                    continue
                w = q_proj.weight.float().view(kv_heads, heads // kv_heads, head_dim, hidden).sum(1)  # [H_kv, D, d]
                w = w.reshape(kv_heads * head_dim, hidden).T  # [d, H_kv·D]
                gain = getattr(getattr(block, "input_layernorm", None), "weight", None)
                if gain is not None and gain.shape == (hidden,):
                    w = w * gain.float()[:, None]
                u, s, vh = torch.linalg.svd(w, full_matrices=False)
                r = min(rank, s.shape[0])
                out.down[i].zero_()[:, :r] = u[:, :r] * s[:r].sqrt()
                out.up[i].zero_()[:r] = s[:r].sqrt()[:, None] * vh[:r]
        return out


# The most the heads may add to the model, as a share of its parameters (SparDA adds 0.41% to an 8B
# model with full-rank heads of two KV groups; with eight groups full rank would be 1.7%).
MAX_SHARE = 0.004


def default_rank(model: nn.Module) -> int:
    """The largest power of two, at most the head dimension, whose heads stay within `MAX_SHARE` of
    ``model``'s parameters (16 for SmolLM2-135M, 128 for an 8B Llama)."""
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_rank = len(_compat.decoder_layers(model)) * (config.hidden_size + kv_heads * head_dim)
    allowed = MAX_SHARE * sum(p.numel() for p in model.parameters()) / per_rank
    rank = 1
    while rank * 2 <= min(head_dim, allowed):
        rank *= 2
    return rank


def parameter_share(heads: ForecastHeads, model: nn.Module) -> float:
    """The heads' parameters as a fraction of ``model``'s."""
    return sum(p.numel() for p in heads.parameters()) / sum(p.numel() for p in model.parameters())


def rotate(x: Tensor, rotary: tuple[Tensor, Tensor] | None) -> Tensor:
    """``x [B, H, D]`` rotated as the model rotates its queries (the half-split rotary embedding of
    HF models; ``cos, sin [B, D_rot]`` with ``D_rot <= D``: the first ``D_rot`` channels rotate)."""
    if rotary is None:
        return x
    cos, sin = (t.float()[:, None, :] for t in rotary)
    r = cos.shape[-1]
    head, tail = x[..., :r], x[..., r:]
    x1, x2 = head.chunk(2, dim=-1)
    return torch.cat([head * cos + torch.cat([-x2, x1], dim=-1) * sin, tail], dim=-1)


# Pages per pass of `page_means`: its fp32 temporaries stay near a gigabyte at the 8B shape, where a
# whole layer at once would take 8 GiB at 1M tokens.
MEAN_CHUNK_PAGES = 8192


def page_means(keys: Tensor, valid: Tensor, page: int, chunk_pages: int = MEAN_CHUNK_PAGES) -> Tensor:
    """``[B, H_kv, P, D]`` (fp32): each page's mean visible key (zero on an empty page), from
    ``keys [B, H_kv, P·page, D]`` and ``valid bool[B, P·page]``, ``chunk_pages`` pages at a time."""
    b, h, n, d = keys.shape
    pages = n // page
    k = keys.view(b, h, pages, page, d)
    m = valid.view(b, 1, pages, page, 1)
    out = torch.empty(b, h, pages, d, dtype=torch.float32, device=keys.device)
    for lo in range(0, pages, chunk_pages):
        hi = min(pages, lo + chunk_pages)
        seen = m[:, :, lo:hi].float()
        out[:, :, lo:hi] = (k[:, :, lo:hi].float() * seen).sum(3) / seen.sum(3).clamp(min=1)
    return out


def block_scores(page_scores: Tensor, counts: Tensor, kernel_pages: int, block_pages: int) -> Tensor:
    """``[B, H, NB]``: each block's score, the largest score of the windows that overlap it.

    ``page_scores [B, H, P]`` are scores of the pages' mean keys and ``counts [B, P]`` their visible
    tokens; a window of ``kernel_pages`` pages from page ``j`` scores the token-weighted mean of its
    pages' scores (the score of its mean key). Windows and blocks without visible tokens are ``-inf``.

    Written as sums and maxima of shifted slices, not unfolds, so that a compiled step computes it
    in one pointwise kernel over the blocks.
    """
    m, n = kernel_pages, block_pages
    p = page_scores.shape[-1]
    nb = -(-p // n)
    c = counts[:, None, :].float()
    weighted = torch.where(c > 0, page_scores * c, 0.0)
    # Windows start at pages -(m-1) .. nb·n-1 (index i is start i-m+1): that many windows, each over
    # m consecutive pages of the padded page arrays.
    w = nb * n + m - 1
    pad = (m - 1, w - p)
    weighted, c = F.pad(weighted, pad), F.pad(c.expand_as(page_scores), pad)
    num = sum(weighted[..., t : t + w] for t in range(m))
    den = sum(c[..., t : t + w] for t in range(m))
    starts = torch.arange(w, device=page_scores.device) - (m - 1)
    windows = torch.where((den > 0) & (starts >= 0), num / den.clamp(min=1), -torch.inf)  # none starts before page 0
    # Block k holds pages kn .. kn+n-1: the windows starting at kn-m+1 .. kn+n-1 (indices kn .. kn+n+m-2).
    blocks = windows[..., 0 : nb * n : n]
    for u in range(1, n + m - 1):
        blocks = torch.maximum(blocks, windows[..., u : u + nb * n : n])
    return blocks


@dataclass
class ForecastRequest:
    """Forecast's state for one request, shared by every layer (``state.context.request``)."""

    weights: Tensor | None = None
    """Every layer's head, its two factors multiplied once (``[L, d_model, H_kv·D]``), made at layer 0's prefill."""
    means: dict[int, Tensor] = field(default_factory=dict)
    """Per layer, the mean key of every page ``[B, H_kv, P, D]``, refreshed in place by `append`."""
    next: Selection | None = None
    """The selection layer l made for layer l + 1 at this step, taken by layer l + 1."""


@register("forecast")
@dataclass
class Forecast(KVSelector):
    """Keep the best ``budget`` of the blocks (tokens, or a keep ratio of the visible blocks), as
    layer ``l - 1``'s Forecast head predicts them (see the module docstring).

    ``heads``: trained heads (a path to a file `save` or ``recipes/forecast`` wrote, or a
    `ForecastHeads`); ``None`` starts from the model's query projections at ``rank`` when a Decoder
    takes the policy (``None``: `default_rank`). ``stride`` is the cache page size the policy needs;
    ``kernel`` and ``block`` are multiples of it. ``rescore``: 0, or a candidate factor >= 1 (see
    the module docstring).
    """

    budget: int | float = 0.1
    heads: Any = None
    block: int = 64
    kernel: int = 32
    stride: int = 16
    sinks: int = 64
    window: int = 64
    rank: int | None = None
    rescore: float = 0.0
    step_context = ("hidden", "rotary")
    summaries = ()
    selects_ahead = True  # layer l's head picks layer l+1's blocks
    own_prefill = True  # the page means and the heads' products are made in prefill
    predictor: ForecastHeads | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._budget = Budget(self.budget)
        for name in ("stride", "kernel", "block"):
            check_count(getattr(self, name), name, minimum=1)
        if self.rank is not None:
            check_count(self.rank, "rank", minimum=1)
        check_count(self.sinks, "sinks")
        check_count(self.window, "window")
        check_rescore(self.rescore)
        for name in ("kernel", "block"):
            if getattr(self, name) % self.stride:
                raise ValueError(f"Forecast: {name}={getattr(self, name)} must be a multiple of stride={self.stride}")
        if isinstance(self.heads, ForecastHeads):
            self.predictor = self.heads
        elif isinstance(self.heads, (str, Path)):
            try:
                _, tensors = read_policy_file(self.heads, "Forecast")
            except (OSError, ValueError) as e:
                raise type(e)(f"Forecast(heads={str(self.heads)!r}): {e}") from None
            self.predictor = ForecastHeads.from_tensors({k.split(".", 1)[1]: v for k, v in tensors.items()})
        elif self.heads is not None:
            raise TypeError(f"heads must be a path, a ForecastHeads or None, got {type(self.heads).__name__}")

    @property
    def page_size(self) -> int:  # type: ignore[override]
        return self.stride

    @property
    def slot_alignment(self) -> int:  # type: ignore[override]
        return self.block

    @property
    def two_stage(self) -> bool:  # type: ignore[override]
        return bool(self.rescore)

    # --------------------------------------------------------------------------- life cycle
    def attach(self, model: nn.Module) -> None:
        config = model.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        most = min(config.hidden_size, kv_heads * head_dim)
        if self.predictor is None and self.rank is not None and self.rank > most:
            raise ValueError(f"Forecast(rank={self.rank}): the rank can be at most min(hidden_size, H_kv·head_dim) = {most} "
                             "for this model (a larger one adds parameters, not expressiveness)")  # fmt: skip
        if self.predictor is None:
            self.predictor = ForecastHeads.from_model(model, self.rank)
        p = self.predictor
        want = (len(_compat.decoder_layers(model)), config.hidden_size, kv_heads, head_dim)
        have = (p.num_layers, p.down.shape[1], p.kv_heads, p.head_dim)
        if want != have:
            raise ValueError(f"Forecast heads are for (layers, hidden, H_kv, D) = {have}, the model has {want}")

    def new_request(self) -> ForecastRequest:
        return ForecastRequest()

    def prefill(self, state: KVState, q: Tensor, k: Tensor, v: Tensor) -> None:
        if self.predictor is None:
            raise RuntimeError("Forecast has no heads: give heads= (a trained file) or let a Decoder take the policy")
        if state.page_size != self.stride:
            raise ValueError(f"Forecast(stride={self.stride}) needs a cache with page_size={self.stride}, got {state.page_size}")
        request: ForecastRequest = state.request_for(self)
        if state.layer == 0:  # the heads' products, for `scores` (made here, eagerly, once per request)
            p = self.predictor
            weights = torch.matmul(p.down.float(), p.up.float()).to(p.down.dtype)
            if weights.device.type == "cuda":
                torch._dynamo.mark_static_address(weights)
            request.weights = weights
        means = request.means
        # The whole layer again (a chunked prefill calls this once per chunk), made here (eager):
        # decode steps update it in place, for CUDA graphs.
        value = page_means(state.keys, state.token_valid(), self.stride).to(state.keys.dtype)
        if state.layer in means and means[state.layer].shape == value.shape:
            means[state.layer].copy_(value)
        else:
            if value.device.type == "cuda":
                torch._dynamo.mark_static_address(value)
            means[state.layer] = value

    def append(self, state: KVState, k: Tensor, v: Tensor) -> None:
        """Refresh the mean key of the page the step's token went to."""
        cache, p = state.cache, self.stride
        page = torch.div(cache.length - 1, p, rounding_mode="floor").reshape(1)
        slots = page * p + torch.arange(p, device=page.device)
        keys = state.keys.index_select(2, slots).float()  # [B, H_kv, p, D]
        seen = cache.visible_at(slots.expand(cache.batch, p))[:, None, :, None].float()
        mean = (keys * seen).sum(2, keepdim=True) / seen.sum(2, keepdim=True).clamp(min=1)
        state.request_for(self).means[state.layer].index_copy_(2, page, mean.to(state.keys.dtype))

    def select(self, state: KVState, q: Tensor) -> Selection:
        ctx = state.context
        if ctx.hidden is None:
            raise RuntimeError("Forecast reads the hidden state entering each layer: decode it through a Decoder")
        request: ForecastRequest = state.request_for(self)
        layer = state.layer
        if layer == 0:
            mine = self.choose(state, 0, ctx.hidden, ctx.rotary)
        else:
            mine, request.next = request.next, None
            if mine is None:
                raise RuntimeError(f"Forecast: layer {layer} selects before layer {layer - 1} chose for it "
                                   "(its layers must select once per step, in order)")
        if layer + 1 < state.cache.num_layers:  # the next layer's blocks, one layer ahead
            request.next = self.choose(state, layer + 1, ctx.hidden, ctx.rotary)
        return self.rank_nominated(state, q, mine) if self.rescore else mine

    def predicts_layer(self, layer: int) -> bool:
        return layer > 0  # layer 0's selection is its own head's

    def next_layer_selection(self, state: KVState, sel: Selection) -> Selection | None:
        return state.request_for(self).next

    # ------------------------------------------------------------------------------ scoring
    def scores(self, state: KVState, layer: int, hidden: Tensor, rotary: tuple[Tensor, Tensor] | None) -> Tensor:
        """``float32[B, H_kv, NB]``: layer ``layer``'s block scores by head ``layer``'s query, up to a
        positive factor per row (the head's input norm: it changes no ranking, so decoding skips it).

        The head's two factors are multiplied once per request (`prefill`): one product per step
        instead of two, at ``d_model · H_kv · D`` elements per layer."""
        request: ForecastRequest = state.request_for(self)
        means, weight = request.means[layer], request.weights[layer]
        p = self.predictor
        f = rotate((hidden.to(weight.dtype) @ weight).float().unflatten(-1, (p.kv_heads, p.head_dim)), rotary)
        page_scores = torch.matmul(means, f.to(means.dtype)[..., None])[..., 0].float() * state.scale
        return block_scores(page_scores, state.cache.page_counts(), self.kernel // self.stride, self.block // self.stride)

    def choose(self, state: KVState, layer: int, hidden: Tensor, rotary: tuple[Tensor, Tensor] | None) -> Selection:
        """Layer ``layer``'s selection (entries of ``block`` tokens): the forced and the best-scoring blocks."""
        cache = state.cache
        scores = self.scores(state, layer, hidden, rotary)
        visible, forced = self._forced_blocks(cache)
        scores = scores.masked_fill(~visible[:, None, :], -torch.inf)
        k_max, count = self._block_budget(visible)
        if self.rescore:  # candidates for the layer's own query to rank (`select`)
            k_max, count = candidate_budget(k_max, count, self.rescore, scores.shape[-1])
        # Blocks are whole multiples of pages in slot space: the kernel reads entry ``i``'s slots
        # ``indices[i]·block ..`` and skips those outside the row's visible span.
        return choose_topk(scores, forced, k_max, count, block=self.block, workspace=state.workspace)

    def rank_nominated(self, state: KVState, q: Tensor, nominated: Selection) -> Selection:
        """The budget's blocks among the ``nominated`` ones (`choose` with ``rescore``), ranked by
        their best exact logit under this layer's query ``q`` (the group's max), the forced blocks
        first; block ids ascending, as `choose` gives them."""
        cache = state.cache
        b, h_kv, wide = nominated.indices.shape
        logits, _, _ = selection_logits(state, q, nominated, "max")  # [B, H_kv, wide·block], -inf where invalid
        best = logits.view(b, h_kv, wide, self.block).amax(-1)
        visible, forced = self._forced_blocks(cache)
        listed = nominated.indices.masked_fill(~nominated.entry_valid(), -1).long()
        forced_listed = torch.gather(forced[:, None, :].expand(b, h_kv, -1), 2, listed.clamp(min=0)) & (listed >= 0)
        k_max, count = self._block_budget(visible)
        chosen = choose_topk(best, forced_listed, min(k_max, wide), count, workspace=state.workspace)
        return Selection(torch.gather(nominated.indices, 2, chosen.indices.long()), chosen.count, block=self.block)

    def _forced_blocks(self, cache) -> tuple[Tensor, Tensor]:
        """``(visible, forced) bool[B, NB]``: the blocks holding a visible token, and those always kept
        (the first ``sinks`` and the last ``window`` tokens' blocks, the step's own among them)."""
        first, last = cache.page_spans(self.block)
        visible = first < last
        return visible, visible & ((first < cache.start[:, None] + self.sinks) | (last > cache.length - max(self.window, 1)))

    def _block_budget(self, visible: Tensor) -> tuple[int, Tensor]:
        """``(k_max, count [B])`` in blocks: the budget over the ``visible`` blocks (`_forced_blocks`),
        room for the forced ones."""
        nb, n_visible = visible.shape[-1], visible.sum(-1)
        if self._budget.is_ratio:
            k_max, count = self._budget.k_max(nb), self._budget.count(n_visible)
        else:
            wanted = math.ceil(self._budget.value / self.block)
            k_max, count = min(nb, wanted), Budget(wanted).count(n_visible)
        n_forced = math.ceil(self.sinks / self.block) + math.ceil(max(self.window, 1) / self.block) + 2
        return max(k_max, min(nb, n_forced)), count

    # ---------------------------------------------------------------------------- persistence
    def save(self, path: str | Path) -> Path:
        """Write the heads and the policy's parameters (not ``heads``: the file is the heads)."""
        from safetensors.torch import save_file

        if self.predictor is None:
            raise ValueError("Forecast has no heads to save yet (give heads= or let a Decoder take it)")
        tensors = {f"predictor.{k}": v.detach().contiguous().cpu() for k, v in self.predictor.state_dict().items()}
        params = {k: v for k, v in policy_params(self).items() if k != "heads"}
        save_file(tensors, str(path), metadata={"policy": "Forecast", "params": json.dumps(params)})
        return Path(path)

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> "Forecast":
        """A Forecast with the heads and parameters saved in ``path`` (``overrides`` replace some)."""
        meta, _ = read_policy_file(path, "Forecast")
        params = {**json.loads(meta.get("params", "{}")), **overrides}
        params.pop("heads", None)
        return cls(heads=path, **params)


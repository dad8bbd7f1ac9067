"""The Triton kernels as torch custom ops, and the switch that says when to use them.

Each kernel is registered with `torch.library.custom_op` in the ``policyzoo`` namespace
(``torch.ops.policyzoo.*``) together with a fake (meta) implementation, so `torch.compile` traces
through a decode step as one opaque node per kernel and CUDA graphs capture the launches. A
`Selection` is not an op argument type, so it travels unpacked (indices, count, log_weight, block).
Launch parameters are no op arguments: each kernel reads the config in force as it launches
(`kernels.config`).

Importing this module never fails: without triton (or if importing it fails) `HAS_TRITON` is False,
`use_triton` always answers False and the ops raise if called. The kernel modules are imported here,
eagerly, for a second reason: ``kernels/decode_attention.py`` shares its name with the function
``kernels.decode_attention``; importing a submodule for the first time rebinds the package attribute
of that name to the module, so the first import must happen before ``kernels/__init__.py`` defines
the function (any later import finds the module in ``sys.modules`` and rebinds nothing).

Interpret mode: `triton.jit` reads ``TRITON_INTERPRET`` as each kernel is defined, triton's own
standard library included, so the variable must be set before triton is first imported (importing
transformers or torch._dynamo imports it). To run the kernels on CPU tensors, start the process with
``TRITON_INTERPRET=1`` and ``POLICYZOO_TRITON=1`` (the latter makes `use_triton` route CPU tensors
to them).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from ..selection import Selection

try:
    from . import attention_edges as _edges
    from . import cache_append as _append
    from . import decode_attention as _attn
    from . import entmax_threshold as _entmax
    from . import gathered_logits as _gathered
    from . import page_fetch as _fetch
    from . import page_score as _page
    from . import select_top as _select
    from . import sparse_gemv as _gemv

    HAS_TRITON = True
except Exception:  # no triton, or a triton that cannot load here: the references serve every call
    _append = _attn = _edges = _entmax = _fetch = _gathered = _page = _gemv = _select = None
    HAS_TRITON = False


def use_triton(t: Tensor) -> bool:
    """Whether calls on tensor ``t`` should go to the Triton kernels.

    True for CUDA tensors when triton imported, and for any tensor when ``POLICYZOO_TRITON=1`` (CPU
    tensors then need ``TRITON_INTERPRET=1``, set before triton is first imported).
    """
    if not HAS_TRITON:
        return False
    return t.is_cuda or os.environ.get("POLICYZOO_TRITON") == "1"


def _need_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("policyzoo Triton kernels need triton (pip install 'policyzoo[triton]')")


# --------------------------------------------------------------------------------------------------
# Decode attention


@torch.library.custom_op("policyzoo::decode_attention", mutates_args=())
def _decode_attention_op(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    indices: Tensor,
    count: Tensor,
    log_weight: Tensor | None,
    block: int,
    start: Tensor,
    length: Tensor,
    scale: float,
    mode: str = "softmax",
    slots: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    _need_triton()
    return _attn.decode_attention(q, keys, values, indices, count, log_weight, block, start, length, scale, mode=mode, slots=slots)


@_decode_attention_op.register_fake
def _(q, keys, values, indices, count, log_weight, block, start, length, scale, mode="softmax", slots=None):
    b, h, d = q.shape
    return q.new_empty(b, h, d), q.new_empty(b, h, dtype=torch.float32)


def decode_attention(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    sel: Selection,
    start: Tensor,
    length: Tensor,
    scale: float,
    mode: str = "softmax",
    slots: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """`reference.decode_attention` (``mode="softmax"``, returns ``(out, lse)``) or
    `reference.decode_attention_entmax15` (``mode="entmax15"``, returns ``(out, tau)``) on Triton."""
    return torch.ops.policyzoo.decode_attention(
        q, keys, values, sel.indices, sel.count, sel.log_weight, sel.block, start, length, float(scale), mode, slots
    )


# --------------------------------------------------------------------------------------------------
# Page fetch


@torch.library.custom_op("policyzoo::page_fetch", mutates_args=("dst_keys", "dst_values"))
def _page_fetch_op(
    src_keys: Tensor, src_values: Tensor, dst_keys: Tensor, dst_values: Tensor,
    src_pages: Tensor, dst_pages: Tensor, count: Tensor, page_size: int,
) -> None:
    _need_triton()
    _fetch.page_fetch(src_keys, src_values, dst_keys, dst_values, src_pages, dst_pages, count, page_size)


@_page_fetch_op.register_fake
def _(src_keys, src_values, dst_keys, dst_values, src_pages, dst_pages, count, page_size):
    return None


def page_fetch(src_keys, src_values, dst_keys, dst_values, src_pages, dst_pages, count, page_size) -> None:
    """`reference.page_fetch` on Triton (only entries below ``count`` are copied)."""
    torch.ops.policyzoo.page_fetch(src_keys, src_values, dst_keys, dst_values, src_pages, dst_pages, count, page_size)


# --------------------------------------------------------------------------------------------------
# Cache append


@torch.library.custom_op(
    "policyzoo::cache_append", mutates_args=("keys", "values", "page_min", "page_max", "page_mean", "page_std")
)
def _cache_append_op(
    k: Tensor,
    v: Tensor,
    keys: Tensor,
    values: Tensor,
    page_min: Tensor,
    page_max: Tensor,
    page_mean: Tensor,
    page_std: Tensor,
    start: Tensor,
    length: Tensor,
    page_size: int,
) -> None:
    _need_triton()
    kept = tuple(s if s.numel() else None for s in (page_min, page_max, page_mean, page_std))
    _append.cache_append(k, v, keys, values, kept, start, length, page_size)


@_cache_append_op.register_fake
def _(k, v, keys, values, page_min, page_max, page_mean, page_std, start, length, page_size):
    return None


def cache_append(
    k: Tensor,
    v: Tensor,
    keys: Tensor,
    values: Tensor,
    summaries: tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None],
    start: Tensor,
    length: Tensor,
    page_size: int,
) -> None:
    """`reference.cache_append` on Triton, in place. A summary the cache does not keep travels as an
    empty tensor (an op's mutable arguments cannot be optional in every torch this runs on)."""
    absent = [keys.new_empty(0) if s is None else s for s in summaries]
    torch.ops.policyzoo.cache_append(k, v, keys, values, *absent, start, length, int(page_size))


# --------------------------------------------------------------------------------------------------
# Page scores


@torch.library.custom_op("policyzoo::quest_page_bound", mutates_args=())
def _quest_page_bound_op(q: Tensor, page_min: Tensor, page_max: Tensor, scale: float, agg: str = "none") -> Tensor:
    _need_triton()
    return _page.quest_page_bound(q, page_min, page_max, scale, agg)


@_quest_page_bound_op.register_fake
def _(q, page_min, page_max, scale, agg="none"):
    b, h, _ = q.shape
    _, h_kv, p, _ = page_min.shape
    return q.new_empty(b, h if agg == "none" else h_kv, p, dtype=torch.float32)


def quest_page_bound(q: Tensor, page_min: Tensor, page_max: Tensor, scale: float) -> Tensor:
    """`reference.quest_page_bound` on Triton: ``float32[B, H, P]``."""
    return torch.ops.policyzoo.quest_page_bound(q, page_min, page_max, float(scale), "none")


def quest_page_bound_grouped(q: Tensor, page_min: Tensor, page_max: Tensor, scale: float, agg: str = "max") -> Tensor:
    """`reference.quest_page_bound_grouped` on Triton: ``float32[B, H_kv, P]``."""
    return torch.ops.policyzoo.quest_page_bound(q, page_min, page_max, float(scale), agg)


@torch.library.custom_op("policyzoo::sketch_page_bound", mutates_args=())
def _sketch_page_bound_op(
    q: Tensor, codes: Tensor, page_min: Tensor, page_max: Tensor, start: Tensor, length: Tensor, scale: float,
    agg: str = "none", pages: Tensor | None = None,
) -> Tensor:
    _need_triton()
    return _page.sketch_page_bound(q, codes, page_min, page_max, start, length, scale, agg, pages)


@_sketch_page_bound_op.register_fake
def _(q, codes, page_min, page_max, start, length, scale, agg="none", pages=None):
    b, h, _ = q.shape
    _, h_kv, p, _ = page_min.shape
    return q.new_empty(b, h if agg == "none" else h_kv, p if pages is None else pages.shape[-1], dtype=torch.float32)


def sketch_page_bound(q, codes, page_min, page_max, start, length, scale, agg="none", pages=None) -> Tensor:
    """`reference.sketch_page_bound` on Triton: ``float32[B, H, P]`` (or ``[B, H_kv, P]`` with
    ``agg="max"``; ``K`` entries for the ``K`` listed ``pages``)."""
    return torch.ops.policyzoo.sketch_page_bound(q, codes, page_min, page_max, start, length, float(scale), agg, pages)


# --------------------------------------------------------------------------------------------------
# Exact logits of gathered keys (a two-stage policy's second stage)


@torch.library.custom_op("policyzoo::gathered_logits", mutates_args=())
def _gathered_logits_op(q: Tensor, keys: Tensor, slots: Tensor, scale: float, agg: str = "none") -> Tensor:
    _need_triton()
    return _gathered.gathered_logits(q, keys, slots, scale, agg)


@_gathered_logits_op.register_fake
def _(q, keys, slots, scale, agg="none"):
    b, h, _ = q.shape
    h_kv = keys.shape[1]
    return q.new_empty(b, h_kv, *((h // h_kv,) if agg == "none" else ()), slots.shape[-1], dtype=torch.float32)


def gathered_logits(q: Tensor, keys: Tensor, slots: Tensor, scale: float, agg: str = "none") -> Tensor:
    """`reference.gathered_logits` on Triton: ``float32[B, H_kv, G, N]``, or ``[B, H_kv, N]`` with
    ``agg="max"``."""
    if agg not in ("none", "max"):  # before the op: a bad value fails here, not in a compiled graph
        raise ValueError(f"agg must be 'none' or 'max', got {agg!r}")
    return torch.ops.policyzoo.gathered_logits(q, keys, slots, float(scale), agg)


# --------------------------------------------------------------------------------------------------
# The attention graph's edge search (a prefill-time kernel: eager, so no custom op)


def attention_edges(q: Tensor, keys: Tensor, first: int, scale: float, top: int) -> tuple[Tensor, Tensor]:
    """`reference.attention_edges` on Triton: ``(dst int32[H, T, top], p float32[H, T, top])``."""
    _need_triton()
    return _edges.attention_edges(q, keys, first, scale, top)


# --------------------------------------------------------------------------------------------------
# Top-count selection


@torch.library.custom_op("policyzoo::select_top", mutates_args=())
def _select_top_op(scores: Tensor, count: Tensor, k_max: int, absolute: bool = False) -> Tensor:
    _need_triton()
    return _select.select_top(scores, count, k_max, absolute)


@_select_top_op.register_fake
def _(scores, count, k_max, absolute=False):
    return scores.new_empty(scores.shape[0], k_max, dtype=torch.int32)


def select_top(scores: Tensor, count: Tensor, k_max: int, absolute: bool = False) -> Tensor:
    """`reference.select_top` on Triton: ``int32[R, k_max]`` ascending positions, zeros after count."""
    return torch.ops.policyzoo.select_top(scores, count, int(k_max), bool(absolute))


# --------------------------------------------------------------------------------------------------
# Pooled Gaussian entmax threshold (EntmaxKV)


@torch.library.custom_op("policyzoo::gaussian_entmax_threshold", mutates_args=())
def _gaussian_entmax_threshold_op(m: Tensor, s: Tensor, n: Tensor, cap: Tensor | None, iters: int = 12) -> Tensor:
    _need_triton()
    return _entmax.gaussian_entmax_threshold(m, s, n, cap, iters)


@_gaussian_entmax_threshold_op.register_fake
def _(m, s, n, cap, iters=12):
    shapes = [t.shape for t in (m, s, n, cap) if t is not None]
    return m.new_empty(*torch.broadcast_shapes(*shapes)[:-1], 1, dtype=torch.float64)


def gaussian_entmax_threshold(m: Tensor, s: Tensor, n: Tensor, cap: Tensor | None = None, iters: int = 12) -> Tensor:
    """`reference.gaussian_entmax_threshold` on Triton: ``float64[..., 1]``. One opaque op, so that
    `torch.compile` does not fuse the Newton passes into one reduction over all pages (which Triton
    3.6 fails to compile at 8192 pages)."""
    return torch.ops.policyzoo.gaussian_entmax_threshold(m, s, n, cap, int(iters))


# --------------------------------------------------------------------------------------------------
# Sparse GEMV


def _gemv_fake(x: Tensor, w_t: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w_t.shape[1])


@torch.library.custom_op("policyzoo::sparse_gemv_index", mutates_args=())
def _sparse_gemv_index_op(x: Tensor, idx: Tensor, w_t: Tensor, bias: Tensor | None) -> Tensor:
    _need_triton()
    return _gemv.sparse_gemv_index(x, idx, w_t, bias)


@_sparse_gemv_index_op.register_fake
def _(x, idx, w_t, bias):
    return _gemv_fake(x, w_t)


@torch.library.custom_op("policyzoo::sparse_gemv_threshold", mutates_args=())
def _sparse_gemv_threshold_op(x: Tensor, t: Tensor, w_t: Tensor, bias: Tensor | None, segment: int) -> Tensor:
    _need_triton()
    return _gemv.sparse_gemv_threshold(x, t, w_t, bias, segment)


@_sparse_gemv_threshold_op.register_fake
def _(x, t, w_t, bias, segment):
    return _gemv_fake(x, w_t)


@torch.library.custom_op("policyzoo::sparse_gemv_mask", mutates_args=())
def _sparse_gemv_mask_op(x: Tensor, keep: Tensor, w_t: Tensor, bias: Tensor | None) -> Tensor:
    _need_triton()
    return _gemv.sparse_gemv_mask(x, keep, w_t, bias)


@_sparse_gemv_mask_op.register_fake
def _(x, keep, w_t, bias):
    return _gemv_fake(x, w_t)


def sparse_gemv_index(x: Tensor, idx: Tensor, w_t: Tensor, bias: Tensor | None = None) -> Tensor:
    """`reference.sparse_gemv_index` on Triton (``x [B, d_in]``, ``w_t [d_in, d_out]``)."""
    return torch.ops.policyzoo.sparse_gemv_index(x, idx, w_t, bias)


def sparse_gemv_threshold(
    x: Tensor, t: Tensor | float, w_t: Tensor, bias: Tensor | None = None, segment: int = 0
) -> Tensor:
    """`reference.sparse_gemv_threshold` on Triton; a ``t`` tensor on x's device avoids a copy."""
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
    _gemv.threshold_strides(t, x.shape[0], w_t.shape[1])  # bad shapes fail here, before the op
    _gemv.check_segment(t, w_t.shape[1], segment)
    return torch.ops.policyzoo.sparse_gemv_threshold(x, t, w_t, bias, int(segment))


def sparse_gemv_mask(x: Tensor, keep: Tensor, w_t: Tensor, bias: Tensor | None = None) -> Tensor:
    """`reference.sparse_linear` with ``weight = w_t.t()`` on Triton (``keep [B, d_in]`` bool)."""
    return torch.ops.policyzoo.sparse_gemv_mask(x, keep, w_t, bias)


def sparse_linear(x: Tensor, weight: Tensor, bias: Tensor | None, keep: Tensor) -> Tensor:
    """`reference.sparse_linear` on Triton: ``x [..., d_in]``, ``weight [d_out, d_in]`` (nn.Linear
    layout, read through its transposed view), ``keep`` a bool mask like x."""
    d_in = x.shape[-1]
    y = torch.ops.policyzoo.sparse_gemv_mask(x.reshape(-1, d_in), keep.reshape(-1, d_in), weight.t(), bias)
    return y.view(*x.shape[:-1], weight.shape[0])


__all__ = [
    "HAS_TRITON",
    "use_triton",
    "cache_append",
    "decode_attention",
    "gaussian_entmax_threshold",
    "gathered_logits",
    "quest_page_bound",
    "quest_page_bound_grouped",
    "sparse_gemv_index",
    "sparse_gemv_threshold",
    "sparse_gemv_mask",
    "sparse_linear",
]

"""Attention, page-scoring and projection operators.

`ops` is the seam between the library and its kernels: every call site in the library goes through
these functions. They run the Triton kernels (torch custom ops, `dispatch`) when
`dispatch.use_triton` says so — CUDA tensors with triton installed, or ``POLICYZOO_TRITON=1`` — and
the plain-torch references in `reference.py` otherwise (the default on CPU), without any call site
changing. The kernels' launch parameters are values in `config`; ``kernels.config.override(...)``
changes them for a scope.
"""

# dispatch first: it imports the kernel modules, one of which (decode_attention.py) is named like the
# function below; the function must be bound after the module (see dispatch's docstring).
from . import dispatch
from . import config
from . import reference
from . import scratch
from .reference import dense_probs


def decode_attention(q, keys, values, sel, start, length, scale, slots=None):
    """Softmax decode attention over a Selection → ``(out, lse)``; see `reference.decode_attention`
    (``slots``: the entries' slots in a page cache whose ``keys`` and ``values`` are passed)."""
    if dispatch.use_triton(q):
        return dispatch.decode_attention(q, keys, values, sel, start, length, scale, slots=slots)
    return reference.decode_attention(q, keys, values, sel, start, length, scale, slots)


def decode_attention_entmax15(q, keys, values, sel, start, length, scale, slots=None):
    """1.5-entmax decode attention over a Selection → ``(out, tau)``; see
    `reference.decode_attention_entmax15` (the Triton path is the same op in ``mode="entmax15"``)."""
    if dispatch.use_triton(q):
        return dispatch.decode_attention(q, keys, values, sel, start, length, scale, mode="entmax15", slots=slots)
    return reference.decode_attention_entmax15(q, keys, values, sel, start, length, scale, slots)


def cache_append(k, v, keys, values, summaries, start, length, page_size):
    """Write a decode token at slot ``length - 1`` and refresh its page's kept summaries, in place;
    see `reference.cache_append`."""
    if dispatch.use_triton(keys):
        return dispatch.cache_append(k, v, keys, values, summaries, start, length, page_size)
    return reference.cache_append(k, v, keys, values, summaries, start, length, page_size)


def page_fetch(src_keys, src_values, dst_keys, dst_values, src_pages, dst_pages, count, page_size):
    """Copy listed pages of a cache into a page cache's slots, in place; see `reference.page_fetch`."""
    if dispatch.use_triton(dst_keys):
        return dispatch.page_fetch(src_keys, src_values, dst_keys, dst_values, src_pages, dst_pages, count, page_size)
    return reference.page_fetch(src_keys, src_values, dst_keys, dst_values, src_pages, dst_pages, count, page_size)


def quest_page_bound(q, page_min, page_max, scale):
    """Quest page bound ``float32[B, H, P]``; see `reference.quest_page_bound`."""
    if dispatch.use_triton(q):
        return dispatch.quest_page_bound(q, page_min, page_max, scale)
    return reference.quest_page_bound(q, page_min, page_max, scale)


def quest_page_bound_grouped(q, page_min, page_max, scale, agg="max"):
    """Quest page bound folded over each GQA group in the kernel → ``float32[B, H_kv, P]`` (the
    per-head bounds are never written); see `reference.quest_page_bound_grouped`."""
    if dispatch.use_triton(q):
        return dispatch.quest_page_bound_grouped(q, page_min, page_max, scale, agg)
    return reference.quest_page_bound_grouped(q, page_min, page_max, scale, agg)


def sketch_page_bound(q, codes, page_min, page_max, start, length, scale, agg="none", pages=None):
    """Upper bound of each page's best logit from the 4-bit key sketch → ``float32[B, H, P]`` (or the
    group's max ``[B, H_kv, P]`` with ``agg="max"``), or of the listed ``pages int[B, H_kv, K]`` only;
    see `reference.sketch_page_bound`."""
    page = codes.shape[2] // page_min.shape[2]
    if dispatch.use_triton(q) and page & (page - 1) == 0:  # the kernel tiles a page as a power of two
        return dispatch.sketch_page_bound(q, codes, page_min, page_max, start, length, scale, agg, pages)
    return reference.sketch_page_bound(q, codes, page_min, page_max, start, length, scale, agg, pages)


# Entries of a `select_top` row one program holds; longer rows are taken in bf16 only (by histograms).
SELECT_TOP_ROW = dispatch._select.MAX_BLOCK_N if dispatch.HAS_TRITON else 16384


def select_top(scores, count, k_max, absolute=False):
    """Positions of each row's ``count`` largest scores, ascending → ``int32[R, k_max]``; see
    `reference.select_top`. Rows the kernel does not take (over `SELECT_TOP_ROW` entries, unless
    bf16) go to the reference, a sort."""
    if dispatch.use_triton(scores) and dispatch._select.takes(scores.shape[-1], scores.dtype):
        return dispatch.select_top(scores, count, k_max, absolute)
    return reference.select_top(scores, count, k_max, absolute)


def gaussian_entmax_threshold(m, s, n, cap=None, iters=12):
    """Entmax threshold of a pool of censored Gaussians along the last dim → ``float64[..., 1]``
    (`EntmaxKV`'s τ̂); see `reference.gaussian_entmax_threshold`."""
    if dispatch.use_triton(m):
        return dispatch.gaussian_entmax_threshold(m, s, n, cap, iters)
    return reference.gaussian_entmax_threshold(m, s, n, cap, iters)


def gathered_logits(q, keys, slots, scale, agg="none"):
    """Exact ``scale·q·k`` of each query head against the keys at ``slots`` → ``float32[B, H_kv, G,
    N]``, or the group's max ``[B, H_kv, N]`` with ``agg="max"`` (a two-stage policy's candidates);
    see `reference.gathered_logits`."""
    if dispatch.use_triton(q):
        return dispatch.gathered_logits(q, keys, slots, scale, agg)
    return reference.gathered_logits(q, keys, slots, scale, agg)


def attention_edges(q, keys, first, scale, top):
    """Each query's ``top`` most attended keys under causal attention → ``(dst int32[H, T, top], p
    float32[H, T, top])``; see `reference.attention_edges`."""
    if dispatch.use_triton(q):
        return dispatch.attention_edges(q, keys, first, scale, top)
    return reference.attention_edges(q, keys, first, scale, top)


def sparse_linear(x, weight, bias, keep):
    """``F.linear`` over the kept input features only; see `reference.sparse_linear`."""
    if dispatch.use_triton(x):
        return dispatch.sparse_linear(x, weight, bias, keep)
    return reference.sparse_linear(x, weight, bias, keep)


def sparse_gemv_index(x, idx, w_t, bias=None):
    """``[B, d_out]`` from the kept features ``idx [B, k]`` and input-major ``w_t [d_in, d_out]``."""
    if dispatch.use_triton(x):
        return dispatch.sparse_gemv_index(x, idx, w_t, bias)
    return reference.sparse_gemv_index(x, idx, w_t, bias)


def sparse_gemv_threshold(x, t, w_t, bias=None, segment=0):
    """``[B, d_out]`` over the inputs with ``|x| >= t``, input-major ``w_t [d_in, d_out]``; ``t`` one
    threshold, one per row ``[B, 1]``, or one per output column ``[1, d_out]`` constant over runs of
    ``segment`` columns."""
    if dispatch.use_triton(x):
        return dispatch.sparse_gemv_threshold(x, t, w_t, bias, segment)
    return reference.sparse_gemv_threshold(x, t, w_t, bias, segment)


__all__ = [
    "config",
    "reference",
    "attention_edges",
    "dispatch",
    "cache_append",
    "decode_attention",
    "decode_attention_entmax15",
    "dense_probs",
    "gaussian_entmax_threshold",
    "gathered_logits",
    "page_fetch",
    "quest_page_bound",
    "quest_page_bound_grouped",
    "select_top",
    "SELECT_TOP_ROW",
    "sparse_gemv_index",
    "sparse_gemv_threshold",
    "sparse_linear",
]

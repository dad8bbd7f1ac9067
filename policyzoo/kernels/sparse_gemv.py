"""Sparse GEMV for the projection branch (Triton): ``y = x_S · W_t[S, :] + bias``.

Only the rows of the input-major (transposed) weight ``w_t [d_in, d_out]`` that belong to kept
input features ``S`` are read, each row a contiguous run of ``d_out`` values; accumulation is fp32
and the result is cast to x's dtype. Three ways to say which features are kept, per batch row:

- `sparse_gemv_index`: an index list ``idx int[B, k]`` (TopK; distinct indices in ``[0, d_in)``),
  specification `reference.sparse_gemv_index`;
- `sparse_gemv_threshold`: ``|x| >= t`` decided inside the kernel (TEAL-style Threshold; ``t`` a
  scalar compared in x's dtype), specification `reference.sparse_gemv_threshold`;
- `sparse_gemv_mask`: a bool mask ``keep [B, d_in]``, specification `reference.sparse_linear`.

Grid ``(cdiv(d_out, BLOCK_N), B)``: a program computes ``BLOCK_N`` outputs of one row, walking the
kept features in tiles of ``BLOCK_K``. The index kernel gathers ``BLOCK_K`` weight rows per tile;
the threshold and mask kernels walk all of ``d_in`` but predicate the weight loads on the keep
decision, so rows of dropped features are never fetched (a masked-off load issues no memory
transaction). ``w_t`` may be any strided view (``weight.t()`` of an ``nn.Linear`` works, though
reading it is only coalesced when ``w_t`` is contiguous).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

INTERPRET = bool(triton.knobs.runtime.interpret)  # set when TRITON_INTERPRET=1 (CPU tensors)

BLOCK_N = 64
BLOCK_K = 32


def _alloc(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every output and scratch buffer comes from here (uninitialised; the tests poison it with NaN)."""
    return torch.empty(*shape, dtype=dtype, device=device)


@triton.jit
def _gemv_index_kernel(
    x_ptr, idx_ptr, w_ptr, bias_ptr, y_ptr,
    k, d_out,
    s_xb, s_ib, s_wk, s_wn, s_yb,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < d_out
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k
        rows = tl.load(idx_ptr + b * s_ib + offs_k, mask=k_mask, other=0).to(tl.int64)
        xv = tl.load(x_ptr + b * s_xb + rows, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(
            w_ptr + rows[:, None] * s_wk + offs_n[None, :] * s_wn,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        acc += tl.sum(xv[:, None] * w.to(tl.float32), 0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + b * s_yb + offs_n, acc, mask=n_mask)


@triton.jit
def _gemv_scan_kernel(
    x_ptr, keep_ptr, t_ptr, w_ptr, bias_ptr, y_ptr,
    d_in, d_out,
    s_xb, s_kb, s_wk, s_wn, s_yb,
    FROM_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < d_out
    if not FROM_MASK:
        # t arrives rounded to x's dtype (by torch, on the host side), like the reference's
        # comparison in x's dtype; both sides widen exactly to fp32 here.
        t = tl.load(t_ptr).to(tl.float32)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, d_in, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < d_in
        x_raw = tl.load(x_ptr + b * s_xb + offs_k, mask=k_mask, other=0.0)
        if FROM_MASK:
            kept = k_mask & (tl.load(keep_ptr + b * s_kb + offs_k, mask=k_mask, other=0) != 0)
        else:
            kept = k_mask & (tl.abs(x_raw.to(tl.float32)) >= t)
        w = tl.load(
            w_ptr + offs_k[:, None].to(tl.int64) * s_wk + offs_n[None, :] * s_wn,
            mask=kept[:, None] & n_mask[None, :],
            other=0.0,
        )
        xv = tl.where(kept, x_raw.to(tl.float32), 0.0)
        acc += tl.sum(xv[:, None] * w.to(tl.float32), 0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + b * s_yb + offs_n, acc, mask=n_mask)


def _check(x: Tensor, w_t: Tensor) -> tuple[Tensor, int, int]:
    if x.device.type == "cpu" and not INTERPRET:
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before importing policyzoo")
    if x.dim() != 2 or w_t.dim() != 2 or x.shape[1] != w_t.shape[0]:
        raise ValueError(f"expected x [B, d_in] and w_t [d_in, d_out], got {tuple(x.shape)} and {tuple(w_t.shape)}")
    return (x if x.stride(-1) == 1 else x.contiguous()), x.shape[0], w_t.shape[1]


def sparse_gemv_index(x: Tensor, idx: Tensor, w_t: Tensor, bias: Tensor | None = None) -> Tensor:
    """``[B, d_out]`` from the kept features ``idx int[B, k]`` of ``x [B, d_in]``."""
    x, b, d_out = _check(x, w_t)
    idx = idx if idx.stride(-1) == 1 else idx.contiguous()
    y = _alloc(b, d_out, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    _gemv_index_kernel[(triton.cdiv(d_out, BLOCK_N), b)](
        x, idx, w_t, bias if bias is not None else x, y,
        idx.shape[1], d_out,
        x.stride(0), idx.stride(0), w_t.stride(0), w_t.stride(1), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    return y


def _scan(x: Tensor, keep: Tensor | None, t: Tensor | None, w_t: Tensor, bias: Tensor | None) -> Tensor:
    x, b, d_out = _check(x, w_t)
    y = _alloc(b, d_out, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    if keep is not None:
        keep = keep.contiguous().view(torch.uint8) if keep.dtype == torch.bool else keep.contiguous()
    _gemv_scan_kernel[(triton.cdiv(d_out, BLOCK_N), b)](
        x, keep if keep is not None else x, t if t is not None else x, w_t,
        bias if bias is not None else x, y,
        x.shape[1], d_out,
        x.stride(0), keep.stride(0) if keep is not None else 0, w_t.stride(0), w_t.stride(1), y.stride(0),
        FROM_MASK=keep is not None, HAS_BIAS=bias is not None, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    return y


def sparse_gemv_threshold(x: Tensor, t: Tensor | float, w_t: Tensor, bias: Tensor | None = None) -> Tensor:
    """``[B, d_out]`` over the features with ``|x| >= t``; ``t`` a float or a 0-dim tensor (a tensor
    on x's device avoids a host-to-device copy per call)."""
    t = torch.as_tensor(t, device=x.device).to(x.dtype).reshape(())
    return _scan(x, None, t, w_t, bias)


def sparse_gemv_mask(x: Tensor, keep: Tensor, w_t: Tensor, bias: Tensor | None = None) -> Tensor:
    """``[B, d_out]`` over the features where ``keep [B, d_in]`` (bool) is set."""
    return _scan(x, keep, None, w_t, bias)


__all__ = ["sparse_gemv_index", "sparse_gemv_threshold", "sparse_gemv_mask", "INTERPRET"]

"""Dense GEMV for decode shapes (Triton): ``y = x · W^T + bias`` reading the whole weight once.

Two kernels, one per way a weight is stored: output-major ``weight [d_out, d_in]`` (nn.Linear's
layout: a program loads tiles ``[BLOCK_N, BLOCK_K]`` whose rows run along the inputs, coalesced along
K; `_out_major_kernel`) and input-major ``w_t [d_in, d_out]`` (tiles ``[BLOCK_K, BLOCK_N]`` of rows
running along the outputs; `_in_major_kernel`, the sparse GEMV's scanning kernel with every feature
kept and no keep decision). Accumulation is fp32 and the result is cast to x's dtype.

Grid ``(cdiv(d_out, BLOCK_N), split, row programs)``: a program computes ``BLOCK_N`` outputs of one
row over one slice of the inputs (split-K), walking it in tiles of ``BLOCK_K`` and summing the
``[BLOCK_N, BLOCK_K]`` products element-wise, reduced over K once after the loop; or, with
``BLOCK_B`` > 1, a block of rows through tl.dot (each weight tile read once for the block). With more
than one slice each program writes its fp32 partial, and either the last program of an output block
to finish sums them (arrival counters, `_store_tile` of the sparse GEMV, shared) or a launch of its
own does (`_sum_slices_kernel`, shared too). Loads are masked only along the axes that do not divide
into whole tiles. Any strides work, but a weight is only read coalesced in its own layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import route
from ..sparse_gemv import slice_len
from ..sparse_gemv.kernel import _store_tile, _sum_slices_kernel


def _alloc(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every output and scratch buffer comes from here (uninitialised; the tests poison it with NaN)."""
    return torch.empty(*shape, dtype=dtype, device=device)


@triton.jit
def _axis_mask(offs, end, MASKED: tl.constexpr):
    """``offs < end``, or all true where the axis divides into whole tiles (a constant mask, which
    the compiler drops)."""
    if MASKED:
        mask = offs < end
    else:
        mask = tl.full(offs.shape, 1, tl.int1)
    return mask


@triton.jit
def _out_major_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, done_ptr,
    n_rows, d_in, d_out, k_per,
    s_xb, s_wn, s_wk, s_yb,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, FUSE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, MASK_N: tl.constexpr, MASK_K: tl.constexpr, IEEE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    pid_b = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = _axis_mask(offs_n, d_out, MASK_N)
    rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    r_mask = rows < n_rows
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * s_wn
    k_end = tl.minimum((s + 1) * k_per, d_in)
    if BLOCK_B == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # reduced over K once, after the loop
    else:
        acc = tl.zeros([BLOCK_B, BLOCK_N], tl.float32)
    for k0 in range(s * k_per, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = _axis_mask(offs_k, k_end, MASK_K)
        w = tl.load(w_rows + offs_k[None, :] * s_wk, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if BLOCK_B == 1:
            xv = tl.load(x_ptr + pid_b * s_xb + offs_k, mask=k_mask, other=0.0)
            acc += xv.to(tl.float32)[None, :] * w.to(tl.float32)
        else:
            xv = tl.load(x_ptr + rows[:, None] * s_xb + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :],
                         other=0.0)
            if IEEE:
                acc = tl.dot(xv.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            else:  # bf16/fp16: the products exact in fp32
                acc = tl.dot(xv.to(w.dtype), tl.trans(w), acc)
    if BLOCK_B == 1:
        out = tl.sum(acc, 1)[None, :]
    else:
        out = acc
    _store_tile(out, rows, r_mask, y_ptr, part_ptr, bias_ptr, done_ptr + pid_b * tl.num_programs(0) + pid_n, s,
                tl.num_programs(1), d_out, s_yb, offs_n, n_mask, HAS_BIAS, SPLIT, FUSE, False)


@triton.jit
def _in_major_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, done_ptr,
    n_rows, d_in, d_out, k_per,
    s_xb, s_wn, s_wk, s_yb,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, FUSE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, MASK_N: tl.constexpr, MASK_K: tl.constexpr, IEEE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    pid_b = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = _axis_mask(offs_n, d_out, MASK_N)
    rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    r_mask = rows < n_rows
    w_cols = w_ptr + offs_n[None, :] * s_wn
    k_end = tl.minimum((s + 1) * k_per, d_in)
    if BLOCK_B == 1:
        acc = tl.zeros([BLOCK_K, BLOCK_N], tl.float32)  # reduced over K once, after the loop
    else:
        acc = tl.zeros([BLOCK_B, BLOCK_N], tl.float32)
    for k0 in range(s * k_per, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = _axis_mask(offs_k, k_end, MASK_K)
        w = tl.load(w_cols + offs_k[:, None].to(tl.int64) * s_wk, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if BLOCK_B == 1:
            xv = tl.load(x_ptr + pid_b * s_xb + offs_k, mask=k_mask, other=0.0)
            acc += xv.to(tl.float32)[:, None] * w.to(tl.float32)
        else:
            xv = tl.load(x_ptr + rows[:, None] * s_xb + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :],
                         other=0.0)
            if IEEE:
                acc = tl.dot(xv.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:  # bf16/fp16: the products exact in fp32
                acc = tl.dot(xv.to(w.dtype), w, acc)
    if BLOCK_B == 1:
        out = tl.sum(acc, 0)[None, :]
    else:
        out = acc
    _store_tile(out, rows, r_mask, y_ptr, part_ptr, bias_ptr, done_ptr + pid_b * tl.num_programs(0) + pid_n, s,
                tl.num_programs(1), d_out, s_yb, offs_n, n_mask, HAS_BIAS, SPLIT, FUSE, False)


def launch(x: Tensor, w: Tensor, bias: Tensor | None, cfg, block_b: int, counters: Tensor | None,
           input_major: bool) -> Tensor:
    """``[B, d_out]`` from ``x [B, d_in]`` (unit last stride) and ``w``: ``[d_out, d_in]``, or
    ``[d_in, d_out]`` with ``input_major``; ``cfg`` a `DenseGemvConfig` its shape rule completed,
    ``block_b`` rows per program (1: the loop, else tl.dot row blocks), ``counters`` zeroed arrival
    counters (one per output block and row program) where ``cfg.fuse_epilogue``, else None."""
    b, d_in = x.shape
    d_out = w.shape[1] if input_major else w.shape[0]
    s_wk, s_wn = (w.stride(0), w.stride(1)) if input_major else (w.stride(1), w.stride(0))
    split, n_blocks = cfg.split, triton.cdiv(d_out, cfg.block_n)
    y = _alloc(b, d_out, dtype=x.dtype, device=x.device)
    part = _alloc(b, split, d_out, dtype=torch.float32, device=x.device) if split > 1 else None
    fuse = split > 1 and counters is not None
    # fp32 operands take the exact fp32 dot (not tf32), and so does the interpreter (`route.INTERPRET`).
    ieee = route.INTERPRET or x.dtype == torch.float32 or w.dtype == torch.float32
    kernel = _in_major_kernel if input_major else _out_major_kernel
    kernel[(n_blocks, split, triton.cdiv(b, block_b))](
        x, w, bias if bias is not None else x, y, part if part is not None else y, counters if fuse else y,
        b, d_in, d_out, slice_len(d_in, split, cfg.block_k),
        x.stride(0), s_wn, s_wk, y.stride(0),
        HAS_BIAS=bias is not None, SPLIT=split > 1, FUSE=fuse, BLOCK_B=block_b, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, MASK_N=d_out % cfg.block_n != 0, MASK_K=d_in % cfg.block_k != 0, IEEE=ieee,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if part is None or fuse:
        return y
    _sum_slices_kernel[(triton.cdiv(d_out, cfg.sum_block), b)](
        part, bias if bias is not None else part, y, split, d_out, y.stride(0),
        HAS_BIAS=bias is not None, BLOCK=cfg.sum_block,
    )
    return y

"""Sparse GEMV for the projection branch (Triton): ``y = x_S · W_t[S, :] + bias``.

Only the rows of the input-major (transposed) weight ``w_t [d_in, d_out]`` that belong to kept
input features ``S`` are read, each row a contiguous run of ``d_out`` values; accumulation is fp32
and the result is cast to x's dtype. Three ways to say which features are kept, per batch row:

- `sparse_gemv_index`: an index list ``idx int[B, k]`` (TopK; distinct indices in ``[0, d_in)``),
  specification `reference.sparse_gemv_index`;
- `sparse_gemv_threshold`: ``|x| >= t`` decided inside the kernel (TEAL-style Threshold; ``t`` a
  scalar, compared in fp32), specification `reference.sparse_gemv_threshold`;
- `sparse_gemv_mask`: a bool mask ``keep [B, d_in]``, specification `reference.sparse_linear`.

Grid ``(cdiv(d_out, BLOCK_N), split, B)``: a program computes ``BLOCK_N`` outputs of one row over
one slice of the kept features (split-K), walking it in tiles of ``BLOCK_K``. With more than one
slice each program writes its fp32 partial, and the last program of an output block to finish (an
arrival counter tells it) sums the block's partials, adds the bias, casts and stores: no epilogue
launch (`FUSE_EPILOGUE`, from `MIN_FUSED_SPLIT` slices). That sum is ``split x BLOCK_N`` floats,
so, unlike the attention merge tried that way in run 5, nothing long runs serially. With
`FUSE_EPILOGUE` off, or no counters reserved (`scratch.reserve`), the epilogue is a launch of its own (`_sum_slices_kernel`; the
torch sum and cast before it were two launches, 4.4 µs per GEMV on an H200).
The index kernel gathers ``BLOCK_K`` weight rows per tile; the threshold and mask kernels walk all
of ``d_in`` but predicate the weight loads on the keep decision, so rows of dropped features are
never fetched (a masked-off load issues no memory transaction). ``w_t`` may be any strided view (``weight.t()`` of an
``nn.Linear`` works, though reading it is only coalesced when ``w_t`` is contiguous).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import scratch

INTERPRET = bool(triton.knobs.runtime.interpret)  # set when TRITON_INTERPRET=1 (CPU tensors)

# Launch parameters, from a sweep on an H200 (bf16, B=1, half the inputs kept, 4096x14336,
# 14336x4096, 4096x4096): ~2.3-2.6 TB/s on the kept rows, 1.2-1.3x faster than the dense cuBLAS GEMV.
BLOCK_N = 64
BLOCK_K = 128
NUM_WARPS = 4
NUM_STAGES = 3
# Split-K until about this many programs: one wave on an H200 (132 SMs x 4 programs of 122
# registers per thread). 1024 (two waves) measured 24.2 against 20.9 us on the down projection at
# keep 0.5, the other Llama-8B shapes within 0.5 us (`gemvtune`, benchmarks/results/2026-11-30-h200-run5).
TARGET_PROGRAMS = 512
MIN_TILES_PER_SPLIT = 4
SUM_BLOCK = 1024  # outputs per program of the split-K epilogue launch
# The last program of each output block sums the split-K partials (no epilogue launch), from
# `MIN_FUSED_SPLIT` slices up. On an H200 at keep 0.5 (run 6, call 1) that saved 0.3-0.65 µs where
# the inputs split 4-8 ways (q|k|v, o, down) and cost 1.9 µs on gate|up, which splits 2 ways over
# 896 programs (every program pays its atomic; only one launch is saved).
FUSE_EPILOGUE = True
MIN_FUSED_SPLIT = 3


def _alloc(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every output and scratch buffer comes from here (uninitialised; the tests poison it with NaN)."""
    return torch.empty(*shape, dtype=dtype, device=device)


@triton.jit
def _store_result(acc, y_ptr, part_ptr, bias_ptr, done_ptr, b, s, n_split, d_out, s_yb, offs_n, n_mask,
                  HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, FUSE: tl.constexpr):
    if SPLIT:  # fp32 partial of this slice of the inputs; bias and cast after the sum over slices
        tl.store(part_ptr + (b * n_split + s) * d_out + offs_n, acc, mask=n_mask)
        if FUSE:
            # The barrier orders every thread's partial stores before the counter's release, the
            # counter's acquire orders them before the last program's reads (.cg: past this SM's
            # L1). That program resets the counter, so the buffer is zero again for the next launch.
            tl.debug_barrier()
            done = done_ptr + b * tl.num_programs(0) + tl.program_id(0)
            if tl.atomic_add(done, 1, sem="acq_rel", scope="gpu") == n_split - 1:
                total = tl.zeros_like(acc)
                for t in range(0, n_split):
                    total += tl.load(part_ptr + (b * n_split + t) * d_out + offs_n, mask=n_mask, other=0.0,
                                     cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                tl.store(y_ptr + b * s_yb + offs_n, total, mask=n_mask)
                tl.atomic_xchg(done, 0, sem="relaxed", scope="gpu")
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + b * s_yb + offs_n, acc, mask=n_mask)


@triton.jit
def _gemv_index_kernel(
    x_ptr, idx_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, done_ptr,
    k, d_out, k_per,
    s_xb, s_ib, s_wk, s_wn, s_yb,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, FUSE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    b = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < d_out
    k_end = tl.minimum((s + 1) * k_per, k)
    # Accumulate the [BLOCK_K, BLOCK_N] products element-wise and reduce over K once at the end: a
    # reduction per tile would cost cross-thread shuffles on every iteration.
    acc = tl.zeros([BLOCK_K, BLOCK_N], tl.float32)
    for k0 in range(s * k_per, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        rows = tl.load(idx_ptr + b * s_ib + offs_k, mask=k_mask, other=0).to(tl.int64)
        xv = tl.load(x_ptr + b * s_xb + rows, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(
            w_ptr + rows[:, None] * s_wk + offs_n[None, :] * s_wn,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        acc += xv[:, None] * w.to(tl.float32)
    _store_result(tl.sum(acc, 0), y_ptr, part_ptr, bias_ptr, done_ptr, b, s, tl.num_programs(1), d_out, s_yb,
                  offs_n, n_mask, HAS_BIAS, SPLIT, FUSE)


@triton.jit
def _gemv_scan_kernel(
    x_ptr, keep_ptr, t_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, done_ptr,
    d_in, d_out, k_per,
    s_xb, s_kb, s_wk, s_wn, s_yb,
    FROM_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, FUSE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    b = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < d_out
    if not FROM_MASK:
        t = tl.load(t_ptr)  # fp32: |x| is compared in fp32, as in Threshold.keep_mask
    k_end = tl.minimum((s + 1) * k_per, d_in)
    acc = tl.zeros([BLOCK_K, BLOCK_N], tl.float32)  # reduced over K once, after the loop
    for k0 in range(s * k_per, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x_raw = tl.load(x_ptr + b * s_xb + offs_k, mask=k_mask, other=0.0)
        if FROM_MASK:
            kept = k_mask & (tl.load(keep_ptr + b * s_kb + offs_k, mask=k_mask, other=0) != 0)
        else:
            kept = k_mask & (tl.abs(x_raw.to(tl.float32)) >= t)
        # Predicated on `kept`: the weight rows of dropped features are never fetched.
        w = tl.load(
            w_ptr + offs_k[:, None].to(tl.int64) * s_wk + offs_n[None, :] * s_wn,
            mask=kept[:, None] & n_mask[None, :],
            other=0.0,
        )
        xv = tl.where(kept, x_raw.to(tl.float32), 0.0)
        acc += xv[:, None] * w.to(tl.float32)
    _store_result(tl.sum(acc, 0), y_ptr, part_ptr, bias_ptr, done_ptr, b, s, tl.num_programs(1), d_out, s_yb,
                  offs_n, n_mask, HAS_BIAS, SPLIT, FUSE)


@triton.jit
def _sum_slices_kernel(part_ptr, bias_ptr, y_ptr, n_split, d_out, s_yb,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """``y[b] = cast(Σ_s part[b, s] + bias)``: the split-K epilogue in one launch (in torch it is a
    sum, an add and a cast, each a launch of its own inside the opaque custom op)."""
    pid = tl.program_id(0)
    b = tl.program_id(1)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d_out
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(0, n_split):
        acc += tl.load(part_ptr + (b * n_split + s) * d_out + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + b * s_yb + offs, acc, mask=mask)


def _check(x: Tensor, w_t: Tensor) -> tuple[Tensor, int, int]:
    if x.device.type == "cpu" and not INTERPRET:
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is first imported")
    if x.dim() != 2 or w_t.dim() != 2 or x.shape[1] != w_t.shape[0]:
        raise ValueError(f"expected x [B, d_in] and w_t [d_in, d_out], got {tuple(x.shape)} and {tuple(w_t.shape)}")
    return (x if x.stride(-1) == 1 else x.contiguous()), x.shape[0], w_t.shape[1]


def default_split(k: int, d_out: int, rows: int, block_n: int = BLOCK_N) -> int:
    """Slices of the kept features (split-K): one program per output block and row is too few
    programs for a GPU's memory system when d_out is small; each slice keeps >= 4 tiles of work."""
    programs = triton.cdiv(d_out, block_n) * max(rows, 1)
    return max(1, min(triton.cdiv(TARGET_PROGRAMS, programs), k // (MIN_TILES_PER_SPLIT * BLOCK_K)))


def _launch(kernel, x, w_t, bias, k, split, block_n, args_before, strides_mid, **meta):
    b, d_out = x.shape[0], w_t.shape[1]
    split = split if split > 0 else default_split(k, d_out, b, block_n)
    k_per = triton.cdiv(triton.cdiv(max(k, 1), split), BLOCK_K) * BLOCK_K  # whole tiles per slice
    split = triton.cdiv(max(k, 1), k_per)
    n_blocks = triton.cdiv(d_out, block_n)
    y = _alloc(b, d_out, dtype=x.dtype, device=x.device)
    part = done = None
    if split > 1:
        part = _alloc(b, split, d_out, dtype=torch.float32, device=x.device)
        fuse = FUSE_EPILOGUE and split >= MIN_FUSED_SPLIT
        done = scratch.zeroed("gemv_counters", n_blocks * b, x.device) if fuse else None
    kernel[(n_blocks, split, b)](
        *args_before, w_t, bias if bias is not None else x, y, part if part is not None else y,
        done if done is not None else y,
        k, d_out, k_per,
        x.stride(0), strides_mid, w_t.stride(0), w_t.stride(1), y.stride(0),
        HAS_BIAS=bias is not None, SPLIT=split > 1, FUSE=done is not None, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, **meta,
    )
    if part is None or done is not None:
        return y
    _sum_slices_kernel[(triton.cdiv(d_out, SUM_BLOCK), b)](
        part, bias if bias is not None else part, y, split, d_out, y.stride(0),
        HAS_BIAS=bias is not None, BLOCK=SUM_BLOCK,
    )
    return y


def sparse_gemv_index(
    x: Tensor, idx: Tensor, w_t: Tensor, bias: Tensor | None = None, split: int = 0, block_n: int = BLOCK_N
) -> Tensor:
    """``[B, d_out]`` from the kept features ``idx int[B, k]`` of ``x [B, d_in]``.

    ``split``: slices of the kept features (0: `default_split`); ``block_n``: outputs per program."""
    x, b, d_out = _check(x, w_t)
    if b * d_out == 0:
        return _alloc(b, d_out, dtype=x.dtype, device=x.device)
    idx = idx if idx.stride(-1) == 1 else idx.contiguous()
    return _launch(_gemv_index_kernel, x, w_t, bias, idx.shape[1], split, block_n, (x, idx), idx.stride(0))


def _scan(x, keep, t, w_t, bias, split, block_n):
    x, b, d_out = _check(x, w_t)
    if b * d_out == 0:
        return _alloc(b, d_out, dtype=x.dtype, device=x.device)
    if keep is not None:
        keep = keep.contiguous().view(torch.uint8) if keep.dtype == torch.bool else keep.contiguous()
    return _launch(
        _gemv_scan_kernel, x, w_t, bias, x.shape[1], split, block_n,
        (x, keep if keep is not None else x, t if t is not None else x),
        keep.stride(0) if keep is not None else 0,
        FROM_MASK=keep is not None,
    )


def sparse_gemv_threshold(
    x: Tensor, t: Tensor | float, w_t: Tensor, bias: Tensor | None = None, split: int = 0, block_n: int = BLOCK_N
) -> Tensor:
    """``[B, d_out]`` over the features with ``|x| >= t``; ``t`` a float or a 0-dim tensor (a tensor
    on x's device avoids a host-to-device copy per call)."""
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device).reshape(())
    return _scan(x, None, t, w_t, bias, split, block_n)


def sparse_gemv_mask(
    x: Tensor, keep: Tensor, w_t: Tensor, bias: Tensor | None = None, split: int = 0, block_n: int = BLOCK_N
) -> Tensor:
    """``[B, d_out]`` over the features where ``keep [B, d_in]`` (bool) is set."""
    return _scan(x, keep, None, w_t, bias, split, block_n)


__all__ = ["sparse_gemv_index", "sparse_gemv_threshold", "sparse_gemv_mask", "default_split", "INTERPRET"]

"""Sparse GEMV for the projection branch (Triton): ``y = x_S · W_t[S, :] + bias``.

Only the rows of the input-major (transposed) weight ``w_t [d_in, d_out]`` that belong to kept
input features ``S`` are read, each row a contiguous run of ``d_out`` values; accumulation is fp32
and the result is cast to x's dtype. Three ways to say which features are kept, per batch row:

- `sparse_gemv_index`: an index list ``idx int[B, k]`` (TopK; distinct indices in ``[0, d_in)``),
  specification `reference.sparse_gemv_index`;
- `sparse_gemv_threshold`: ``|x| >= t`` decided inside the kernel (TEAL-style Threshold; ``t`` a
  scalar, compared in fp32), specification `reference.sparse_gemv_threshold`;
- `sparse_gemv_mask`: a bool mask ``keep [B, d_in]``, specification `reference.sparse_linear`.

Grid ``(cdiv(d_out, block_n), split, B)``: a program computes ``block_n`` outputs of one row over
one slice of the kept features (split-K), walking it in tiles of ``block_k`` (launch parameters:
`config.GemvConfig`, chosen per call by `gemv_config`). With more than one slice each program
writes its fp32 partial, and the last program of an output block to finish (an arrival counter
tells it) sums the block's partials, adds the bias, casts and stores: no epilogue launch
(`GemvConfig.fuse_epilogue`, from `GemvConfig.min_fused_split` slices). That sum is
``split x block_n`` floats, so nothing long runs serially. Below that many slices, or with no
counters reserved (`scratch.reserve`), the epilogue is a launch of its own (`_sum_slices_kernel`;
the torch sum and cast before it were two launches, 4.4 µs per GEMV on an H200).
The index kernel gathers ``block_k`` weight rows per tile; the threshold and mask kernels walk all
of ``d_in`` but predicate the weight loads on the keep decision, so rows of dropped features are
never fetched (a masked-off load issues no memory transaction). ``w_t`` may be any strided view (``weight.t()`` of an
``nn.Linear`` works, though reading it is only coalesced when ``w_t`` is contiguous).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import scratch
from .config import GemvConfig, current

INTERPRET = bool(triton.knobs.runtime.interpret)  # set when TRITON_INTERPRET=1 (CPU tensors)


def _alloc(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every output and scratch buffer comes from here (uninitialised; the tests poison it with NaN)."""
    return torch.empty(*shape, dtype=dtype, device=device)


@triton.jit
def _store_tile(acc, rows, r_mask, y_ptr, part_ptr, bias_ptr, done, s, n_split, d_out, s_yb, offs_n, n_mask,
                HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, FUSE: tl.constexpr, ATOMIC: tl.constexpr):
    """Store ``acc [rows, BLOCK_N]`` (fp32): the outputs, or with ``SPLIT`` this slice's partials,
    summed by the last program of the output block to arrive (its counter ``done``) when ``FUSE``.
    With ``ATOMIC`` the slices add into one fp32 sum per output (``part_ptr [rows, d_out]``, zero on
    entry) instead, and the last program casts it and zeroes it again."""
    mask = r_mask[:, None] & n_mask[None, :]
    if SPLIT:
        if ATOMIC:
            tl.atomic_add(part_ptr + rows[:, None] * d_out + offs_n[None, :], acc, mask=mask, sem="relaxed", scope="gpu")
        else:  # fp32 partial of this slice of the inputs; bias and cast after the sum over slices
            tl.store(part_ptr + (rows[:, None] * n_split + s) * d_out + offs_n[None, :], acc, mask=mask)
        if FUSE:
            # The barrier orders every thread's partial stores before the counter's release, the
            # counter's acquire orders them before the last program's reads (.cg: past this SM's
            # L1). That program resets the counter, so the buffer is zero again for the next launch.
            tl.debug_barrier()
            if tl.atomic_add(done, 1, sem="acq_rel", scope="gpu") == n_split - 1:
                if ATOMIC:
                    total = tl.load(part_ptr + rows[:, None] * d_out + offs_n[None, :], mask=mask, other=0.0,
                                    cache_modifier=".cg")
                    tl.store(part_ptr + rows[:, None] * d_out + offs_n[None, :], tl.zeros_like(acc), mask=mask)
                else:
                    total = tl.zeros_like(acc)
                    for t in range(0, n_split):
                        total += tl.load(part_ptr + (rows[:, None] * n_split + t) * d_out + offs_n[None, :],
                                         mask=mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
                tl.store(y_ptr + rows[:, None] * s_yb + offs_n[None, :], total, mask=mask)
                tl.atomic_xchg(done, 0, sem="relaxed", scope="gpu")
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows[:, None] * s_yb + offs_n[None, :], acc, mask=mask)


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
    rows = b + tl.arange(0, 1)
    _store_tile(tl.sum(acc, 0)[None, :], rows, rows == b, y_ptr, part_ptr, bias_ptr,
                done_ptr + b * tl.num_programs(0) + pid_n, s, tl.num_programs(1), d_out, s_yb, offs_n, n_mask,
                HAS_BIAS, SPLIT, FUSE, False)


@triton.jit
def _kept_tile(x_ptr, keep_ptr, rows, r_mask, t, k0, k_end, s_xb, s_kb,
               FROM_MASK: tl.constexpr, BLOCK_K: tl.constexpr):
    """One tile of the scan: ``(offs_k, x [rows, BLOCK_K], kept [rows, BLOCK_K])``, the activations
    at features ``k0 ..`` and whether each row keeps each of them (outside the slice: not kept)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    xm = r_mask[:, None] & (offs_k < k_end)[None, :]
    x_raw = tl.load(x_ptr + rows[:, None] * s_xb + offs_k[None, :], mask=xm, other=0.0)
    if FROM_MASK:
        kept = xm & (tl.load(keep_ptr + rows[:, None] * s_kb + offs_k[None, :], mask=xm, other=0) != 0)
    else:
        kept = xm & (tl.abs(x_raw.to(tl.float32)) >= t[:, None])
    return offs_k, x_raw, kept


@triton.jit
def _gemv_scan_kernel(
    x_ptr, keep_ptr, t_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, done_ptr,
    n_rows, d_in, d_out, k_per,
    s_xb, s_kb, s_tb, s_tn, s_wk, s_wn, s_yb,
    FROM_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, FUSE: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    PREFETCH: tl.constexpr, TILE_SUM: tl.constexpr, ATOMIC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    pid_b = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < d_out
    rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    r_mask = rows < n_rows
    t = tl.zeros([BLOCK_B], tl.float32)
    if not FROM_MASK:
        # fp32, as in Threshold.keep_mask: one threshold per row for this block of outputs (the
        # launcher makes every block lie inside one run of equal column thresholds).
        t = tl.load(t_ptr + rows * s_tb + (pid_n * BLOCK_N) * s_tn, mask=r_mask, other=float("inf"))
    k_end = tl.minimum((s + 1) * k_per, d_in)
    if BLOCK_B == 1 and TILE_SUM:
        acc = tl.zeros([BLOCK_N], tl.float32)
    elif BLOCK_B == 1:
        acc = tl.zeros([BLOCK_K, BLOCK_N], tl.float32)  # reduced over K once, after the loop
    else:
        acc = tl.zeros([BLOCK_B, BLOCK_N], tl.float32)
    # With PREFETCH the next tile's activations are loaded (and its keep decided) while this tile's
    # weights are in flight: the weight loads, masked by the decision, then need not wait for them.
    if PREFETCH:
        offs_k, x_raw, kept = _kept_tile(x_ptr, keep_ptr, rows, r_mask, t, s * k_per, k_end, s_xb, s_kb, FROM_MASK, BLOCK_K)
    for k0 in range(s * k_per, k_end, BLOCK_K):
        if not PREFETCH:
            offs_k, x_raw, kept = _kept_tile(x_ptr, keep_ptr, rows, r_mask, t, k0, k_end, s_xb, s_kb, FROM_MASK, BLOCK_K)
        # A weight row is fetched once for the block's rows, when any of them keeps its feature
        # (the union); the rows of features no row keeps are never fetched (a masked-off load
        # issues no memory transaction).
        union = tl.max(kept.to(tl.int32), 0) != 0
        w = tl.load(
            w_ptr + offs_k[:, None].to(tl.int64) * s_wk + offs_n[None, :] * s_wn,
            mask=union[:, None] & n_mask[None, :],
            other=0.0,
        )
        xv = tl.where(kept, x_raw.to(tl.float32), 0.0)
        if PREFETCH:
            offs_k, x_raw, kept = _kept_tile(x_ptr, keep_ptr, rows, r_mask, t, k0 + BLOCK_K, k_end, s_xb, s_kb, FROM_MASK,
                                             BLOCK_K)
        if BLOCK_B == 1 and TILE_SUM:
            acc += tl.sum(tl.sum(xv, 0)[:, None] * w.to(tl.float32), 0)
        elif BLOCK_B == 1:
            acc += tl.sum(xv, 0)[:, None] * w.to(tl.float32)
        elif IEEE:
            acc = tl.dot(xv, w.to(tl.float32), acc, input_precision="ieee")
        else:  # bf16/fp16: x is exact in w's dtype, the products exact in fp32
            acc = tl.dot(xv.to(w.dtype), w, acc)
    if BLOCK_B == 1 and TILE_SUM:
        out = acc[None, :]
    elif BLOCK_B == 1:
        out = tl.sum(acc, 0)[None, :]
    else:
        out = acc
    _store_tile(out, rows, r_mask, y_ptr, part_ptr, bias_ptr, done_ptr + pid_b * tl.num_programs(0) + pid_n, s,
                tl.num_programs(1), d_out, s_yb, offs_n, n_mask, HAS_BIAS, SPLIT, FUSE, ATOMIC)


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


def _slice_len(k: int, split: int, block_k: int) -> int:
    """Kept features per slice when ``k`` split ``split`` ways: whole tiles of ``block_k``."""
    return triton.cdiv(triton.cdiv(max(k, 1), split), block_k) * block_k


def row_block(rows: int, cfg: GemvConfig) -> int:
    """Batch rows per program of the scanning kernels: 1 below `GemvConfig.dot_from_rows` rows,
    else `GemvConfig.block_b` (through tl.dot)."""
    return 1 if rows < cfg.dot_from_rows else cfg.block_b


def gemv_config(k: int, d_out: int, rows: int, align: int = 0, dot: bool = False, gather: bool = False) -> GemvConfig:
    """The launch parameters of a call over ``k`` kept features (all ``d_in`` for the scanning
    kernels), ``d_out`` outputs and ``rows`` programs' worth of batch rows (batch rows for the index
    kernel, row blocks for the scanning ones): the config in force (`config.current`) with `split`
    settled and `fuse_epilogue` true only where the epilogue is fused for it.

    `block_n` and `block_k` 0 take the tiles from the shapes (see `GemvConfig`; the index kernel,
    ``gather``, always takes 64x128: 64x64 on gate|up took exact `TopK` from 1.02x to 0.92x of dense). ``split`` 0 splits
    the features until about `target_programs` programs (one program per output
    block and row is too few for a GPU's memory system when d_out is small), each slice keeping
    `min_tiles_per_split` tiles at least; a split is then rounded to whole tiles per slice, which
    can leave fewer slices. The epilogue is fused from `min_fused_split` slices. ``align`` > 0 caps
    `block_n` at the largest power of two dividing it, so that no block straddles a multiple of it;
    ``dot`` (row blocks through tl.dot) raises `block_n` and `block_k` to 16 at least.
    """
    return _choose(current(GemvConfig), k, d_out, rows, align, dot, gather)


@functools.lru_cache(maxsize=1024)  # a launch's Python time: the same few shapes at every decode step
def _choose(cfg: GemvConfig, k: int, d_out: int, rows: int, align: int = 0, dot: bool = False,
            gather: bool = False) -> GemvConfig:
    wide = d_out >= cfg.wide_d_out and not gather
    if not cfg.block_n:
        cfg = dataclasses.replace(cfg, block_n=(256 if wide else 128) if dot else 64)
    if not cfg.block_k:
        cfg = dataclasses.replace(cfg, block_k=(16 if wide else 32) if dot else (64 if wide else 128))
    if align:
        cfg = dataclasses.replace(cfg, block_n=min(cfg.block_n, align & -align))
    if dot:
        cfg = dataclasses.replace(cfg, block_n=max(cfg.block_n, 16), block_k=max(cfg.block_k, 16))
    split = cfg.split
    if split == 0:
        programs = triton.cdiv(d_out, cfg.block_n) * max(rows, 1)
        split = max(1, min(triton.cdiv(cfg.target_programs, programs), k // (cfg.min_tiles_per_split * cfg.block_k)))
    split = triton.cdiv(max(k, 1), _slice_len(k, split, cfg.block_k))
    atomic = cfg.atomic_sum and split > 1 and not gather
    fuse = cfg.fuse_epilogue and split > 1 and (split >= cfg.min_fused_split or atomic)
    return dataclasses.replace(cfg, split=split, fuse_epilogue=fuse, atomic_sum=atomic and fuse)


def _launch(kernel, x, w_t, bias, k, args_before, strides_mid, block_b=0, align=0, **meta):
    """Launch ``kernel`` over a grid (output blocks, slices, row programs): one row per program for
    the index kernel (``block_b`` 0), row blocks of ``block_b`` for the scanning kernel."""
    b, d_out = x.shape[0], w_t.shape[1]
    row_programs = b if block_b == 0 else triton.cdiv(b, block_b)
    cfg = gemv_config(k, d_out, row_programs, align, dot=block_b > 1, gather=block_b == 0)
    split, n_blocks = cfg.split, triton.cdiv(d_out, cfg.block_n)
    y = _alloc(b, d_out, dtype=x.dtype, device=x.device)
    part = done = None
    if split > 1:
        done = scratch.zeroed("gemv_counters", n_blocks * row_programs, x.device) if cfg.fuse_epilogue else None
        sums = scratch.zeroed("gemv_sums", b * d_out, x.device) if cfg.atomic_sum and done is not None else None
        if sums is not None:  # one fp32 sum per output, zero between launches (int32 zeros are 0.0f)
            part = sums[: b * d_out].view(torch.float32)
        else:
            cfg = dataclasses.replace(cfg, atomic_sum=False, fuse_epilogue=done is not None and split >= cfg.min_fused_split)
            done = done if cfg.fuse_epilogue else None
            part = _alloc(b, split, d_out, dtype=torch.float32, device=x.device)
    if block_b:
        # fp32 operands take the exact fp32 dot (not tf32). So does the interpreter, whose tl.dot
        # computes bf16 operands on their raw bits.
        ieee = INTERPRET or x.dtype == torch.float32 or w_t.dtype == torch.float32
        meta = dict(meta, BLOCK_B=block_b, IEEE=ieee, PREFETCH=cfg.prefetch, TILE_SUM=cfg.tile_sum, ATOMIC=cfg.atomic_sum)
    kernel[(n_blocks, split, row_programs)](
        *args_before, w_t, bias if bias is not None else x, y, part if part is not None else y,
        done if done is not None else y,
        *((b,) if block_b else ()), k, d_out, _slice_len(k, split, cfg.block_k),
        x.stride(0), *strides_mid, w_t.stride(0), w_t.stride(1), y.stride(0),
        HAS_BIAS=bias is not None, SPLIT=split > 1, FUSE=done is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **meta,
    )
    if part is None or done is not None:
        return y
    _sum_slices_kernel[(triton.cdiv(d_out, cfg.sum_block), b)](
        part, bias if bias is not None else part, y, split, d_out, y.stride(0),
        HAS_BIAS=bias is not None, BLOCK=cfg.sum_block,
    )
    return y


def sparse_gemv_index(x: Tensor, idx: Tensor, w_t: Tensor, bias: Tensor | None = None) -> Tensor:
    """``[B, d_out]`` from the kept features ``idx int[B, k]`` of ``x [B, d_in]`` (each row reads
    its own weight rows)."""
    x, b, d_out = _check(x, w_t)
    if b * d_out == 0:
        return _alloc(b, d_out, dtype=x.dtype, device=x.device)
    idx = idx if idx.stride(-1) == 1 else idx.contiguous()
    return _launch(_gemv_index_kernel, x, w_t, bias, idx.shape[1], (x, idx), (idx.stride(0),))


def threshold_strides(t: Tensor, b: int, d_out: int) -> tuple[int, int]:
    """``(row, column)`` strides of a threshold ``t``: 0-dim (one for all), ``[B, 1]`` (one per row)
    or ``[1, d_out]`` (one per output column); a size-1 dimension is broadcast (stride 0)."""
    if t.dim() == 0:
        return 0, 0
    if t.dim() != 2 or t.shape[0] not in (1, b) or t.shape[1] not in (1, d_out) or (t.shape[0] > 1 and t.shape[1] > 1):
        raise ValueError(f"a threshold must be a scalar, [B, 1] or [1, d_out] (B={b}, d_out={d_out}), got {tuple(t.shape)}")
    return (t.stride(0) if t.shape[0] > 1 else 0), (t.stride(1) if t.shape[1] > 1 else 0)


def _scan(x, keep, t, w_t, bias, segment=0):
    x, b, d_out = _check(x, w_t)
    if b * d_out == 0:
        return _alloc(b, d_out, dtype=x.dtype, device=x.device)
    block_b = row_block(b, current(GemvConfig))
    if keep is not None:
        keep = keep.contiguous().view(torch.uint8) if keep.dtype == torch.bool else keep.contiguous()
        return _launch(_gemv_scan_kernel, x, w_t, bias, x.shape[1], (x, keep, x), (keep.stride(0), 0, 0),
                       block_b=block_b, FROM_MASK=True)
    s_tb, s_tn = threshold_strides(t, b, d_out)
    return _launch(_gemv_scan_kernel, x, w_t, bias, x.shape[1], (x, x, t), (0, s_tb, s_tn),
                   block_b=block_b, align=segment if s_tn else 0, FROM_MASK=False)


def check_segment(t: Tensor, d_out: int, segment: int) -> None:
    """Per-column thresholds are read once per block of outputs: they must be constant over runs
    of ``segment`` columns, and ``segment`` a multiple of 16 (the narrowest block it allows)."""
    if t.dim() == 2 and t.shape[1] > 1 and (segment <= 0 or segment % 16 or d_out % segment):
        raise ValueError(
            f"per-column thresholds need segment, a multiple of 16 dividing d_out={d_out}, over which they are "
            f"constant; got segment={segment}"
        )


def sparse_gemv_threshold(x: Tensor, t: Tensor | float, w_t: Tensor, bias: Tensor | None = None,
                          segment: int = 0) -> Tensor:
    """``[B, d_out]`` over the features with ``|x| >= t`` (compared in fp32). ``t``: a float or a
    0-dim tensor (one threshold), ``[B, 1]`` (one per row) or ``[1, d_out]`` (one per output column,
    constant over runs of ``segment`` columns: q|k|v in one pass, each with its own threshold). A
    tensor on x's device avoids a host-to-device copy per call. Rows of a batch share each weight
    row they keep (one read for the union)."""
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
    check_segment(t, w_t.shape[1], segment)
    return _scan(x, None, t, w_t, bias, segment)


def sparse_gemv_mask(x: Tensor, keep: Tensor, w_t: Tensor, bias: Tensor | None = None) -> Tensor:
    """``[B, d_out]`` over the features where ``keep [B, d_in]`` (bool) is set (one read per weight
    row for the union of the rows)."""
    return _scan(x, keep, None, w_t, bias)


__all__ = ["sparse_gemv_index", "sparse_gemv_threshold", "sparse_gemv_mask", "gemv_config", "check_segment", "INTERPRET"]

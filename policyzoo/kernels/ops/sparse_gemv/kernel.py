"""Sparse GEMV for the projection branch (Triton): ``y = x_S · W_t[S, :] + bias``.

Only the rows of the input-major (transposed) weight ``w_t [d_in, d_out]`` that belong to kept
input features ``S`` are read, each row a contiguous run of ``d_out`` values; accumulation is fp32
and the result is cast to x's dtype. Three ways to say which features are kept, per batch row
(specifications in ``reference.py``, beside this file): an index list ``idx int[B, k]`` (the index
kernel, `launch_index`), ``|x| >= t`` decided inside the kernel, or a bool mask ``keep [B, d_in]``
(the scanning kernel, `launch_scan`).

Grid ``(cdiv(d_out, block_n), split, row programs)``: a program computes ``block_n`` outputs of one
row (or a block of rows) over one slice of the kept features (split-K), walking it in tiles of
``block_k``, with the `GemvPlan` the op made. With more than one slice each program writes its fp32
partial, and the last program of an output block to finish (an arrival counter tells it) sums the
block's partials, adds the bias, casts and stores: no epilogue launch (`GemvConfig.fuse_epilogue`).
That sum is ``split x block_n`` floats, so nothing long runs serially. Unfused, the epilogue is a
launch of its own (`_sum_slices_kernel`; the torch sum and cast were two launches). The index kernel
gathers ``block_k`` weight rows per tile; the scanning kernel walks all of ``d_in`` but predicates the
weight loads on the keep decision, so rows of dropped features are never fetched (a masked-off load
issues no memory transaction). ``w_t`` may be any strided view (``weight.t()`` of an ``nn.Linear``
works, though reading it is only coalesced when ``w_t`` is contiguous).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import route


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
def _prefetch_l1(ptrs):
    """A hint: fetch the lines at ``ptrs`` into this SM's L1 (nothing waits for them)."""
    tl.inline_asm_elementwise(asm="prefetch.global.L1 [$1];\n\tmov.u32 $0, 0;", constraints="=r,l", args=[ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


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
    WARM_X: tl.constexpr = 0, X_LINE: tl.constexpr = 64, W_CACHE: tl.constexpr = "",
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
    if WARM_X:
        # Each tile's weight loads wait on its activations (their mask). Asking for all of the
        # slice's activation lines at once, before the loop, turns those waits into L1 hits.
        lines = tl.minimum(s * k_per + tl.arange(0, WARM_X) * X_LINE, k_end - 1)
        for r in tl.static_range(BLOCK_B):
            _prefetch_l1(x_ptr + tl.minimum(pid_b * BLOCK_B + r, n_rows - 1) * s_xb + lines)
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
            cache_modifier=W_CACHE,
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


def _launch(kernel, x: Tensor, w_t: Tensor, bias: Tensor | None, plan, args_before, strides_mid, **meta) -> Tensor:
    """Launch ``kernel`` over a grid (output blocks, slices, row programs) as ``plan`` (a `GemvPlan`)
    says, then the split-K epilogue where the kernel does not sum its slices itself."""
    cfg = plan.cfg
    b, d_out = x.shape[0], w_t.shape[1]
    split, n_blocks = cfg.split, triton.cdiv(d_out, cfg.block_n)
    y = _alloc(b, d_out, dtype=x.dtype, device=x.device)
    part = plan.sums
    if split > 1 and part is None:  # each slice's fp32 partial
        part = _alloc(b, split, d_out, dtype=torch.float32, device=x.device)
    if plan.block_b:
        # fp32 operands take the exact fp32 dot (not tf32), and so does the interpreter (`route.INTERPRET`).
        ieee = route.INTERPRET or x.dtype == torch.float32 or w_t.dtype == torch.float32
        meta = dict(meta, BLOCK_B=plan.block_b, IEEE=ieee, PREFETCH=cfg.prefetch, TILE_SUM=cfg.tile_sum,
                    ATOMIC=cfg.atomic_sum)
        if cfg.warm_x and not route.INTERPRET:  # a hardware hint: the interpreter has no L1 to warm
            line = 128 // x.element_size()  # activations a cache line
            meta.update(WARM_X=triton.next_power_of_2(triton.cdiv(plan.k_per, line)), X_LINE=line, W_CACHE=".cg")
    kernel[(n_blocks, split, plan.row_programs)](
        *args_before, w_t, bias if bias is not None else x, y, part if part is not None else y,
        plan.counters if plan.counters is not None else y,
        *((b,) if plan.block_b else ()), plan.k, d_out, plan.k_per,
        x.stride(0), *strides_mid, w_t.stride(0), w_t.stride(1), y.stride(0),
        HAS_BIAS=bias is not None, SPLIT=split > 1, FUSE=plan.counters is not None, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.max_registers} if cfg.max_registers else {}), **meta,
    )
    if part is None or plan.counters is not None:
        return y
    _sum_slices_kernel[(triton.cdiv(d_out, cfg.sum_block), b)](
        part, bias if bias is not None else part, y, split, d_out, y.stride(0),
        HAS_BIAS=bias is not None, BLOCK=cfg.sum_block,
    )
    return y


def launch_index(x: Tensor, idx: Tensor, w_t: Tensor, bias: Tensor | None, plan) -> Tensor:
    """``[B, d_out]`` from the kept features ``idx int[B, k]`` of ``x [B, d_in]`` (each row reads its
    own weight rows)."""
    idx = idx if idx.stride(-1) == 1 else idx.contiguous()
    return _launch(_gemv_index_kernel, x, w_t, bias, plan, (x, idx), (idx.stride(0),))


def launch_scan(x: Tensor, keep: Tensor | None, t: Tensor | None, t_strides: tuple[int, int], w_t: Tensor,
                bias: Tensor | None, plan) -> Tensor:
    """``[B, d_out]`` over the features where ``keep [B, d_in]`` (bool) is set, or else with ``|x| >= t``
    (compared in fp32; ``t_strides``: its row and column strides). Rows of a block share each weight
    row they keep (one read for the union)."""
    if keep is not None:
        keep = keep.contiguous().view(torch.uint8) if keep.dtype == torch.bool else keep.contiguous()
        return _launch(_gemv_scan_kernel, x, w_t, bias, plan, (x, keep, x), (keep.stride(0), 0, 0), FROM_MASK=True)
    return _launch(_gemv_scan_kernel, x, w_t, bias, plan, (x, x, t), (0, *t_strides), FROM_MASK=False)

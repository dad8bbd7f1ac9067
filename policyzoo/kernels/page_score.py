"""Quest page bound (Triton): an upper bound of ``scale·q·k`` over the keys of each cache page.

``bound[b, h, p] = scale · Σ_d max(q_d·min_d, q_d·max_d)`` from the per-page, per-channel key minima
and maxima ``[B, H_kv, P, D]`` (specification: `reference.quest_page_bound`), either per query head
``[B, H, P]`` or aggregated over the G query heads of each GQA group ``[B, H_kv, P]`` (max or sum;
`reference.quest_page_bound_grouped`), which is what a KV-head-level page choice needs.

Grid ``(cdiv(P, BLOCK_P), H_kv, B)``: a program scores ``BLOCK_P`` pages of one KV head for all G
query heads of its group, so the summaries (the bytes that matter) are read once per group. The
head dim is walked in ``BLOCK_D`` slices to bound the ``[G, BLOCK_P, BLOCK_D]`` product in registers.
The channel-wise max is not a dot product, so there is no tl.dot here (the kernel is memory bound
anyway: 2·D summary values per page and head against G·D·2 multiply-adds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

INTERPRET = bool(triton.knobs.runtime.interpret)  # set when TRITON_INTERPRET=1 (CPU tensors)

# Launch parameters, from the sweep's `variants` probe on an H200 (8,192 pages, 8 KV heads, GQA 4,
# D=128, bf16 summaries): the whole head dim per step with 2 warps takes 25 µs, against 39 µs for
# 32-wide slices with 4 warps (27 tile/warp combinations timed).
BLOCK_P = 16  # pages per program
BLOCK_D = 128  # head-dim slice per step
NUM_WARPS = 2
AGG_CODES = {"none": 0, "max": 1, "sum": 2}


def _alloc(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every output and scratch buffer comes from here (uninitialised; the tests poison it with NaN)."""
    return torch.empty(*shape, dtype=dtype, device=device)


@triton.jit
def _quest_bound_kernel(
    q_ptr, mn_ptr, mx_ptr, out_ptr,
    s_qb, s_qh,
    s_mb, s_mh, s_mp,
    s_xb, s_xh, s_xp,
    s_ob, s_oh,
    n_pages, scale,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, AGG: tl.constexpr,
):
    pid_p = tl.program_id(0)
    kv = tl.program_id(1)
    b = tl.program_id(2)
    offs_g = tl.arange(0, G_PAD)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    g_mask = offs_g < G
    p_mask = offs_p < n_pages

    q_rows = q_ptr + b * s_qb + (kv * G + offs_g) * s_qh
    mn_rows = mn_ptr + b * s_mb + kv * s_mh + offs_p * s_mp
    mx_rows = mx_ptr + b * s_xb + kv * s_xh + offs_p * s_xp
    acc = tl.zeros([G_PAD, BLOCK_P], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        # Padding heads and channels load q = 0 and add max(0, 0) = 0.
        q = tl.load(q_rows[:, None] + offs_d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        pd_mask = p_mask[:, None] & d_mask[None, :]
        mn = tl.load(mn_rows[:, None] + offs_d[None, :], mask=pd_mask, other=0.0)
        mx = tl.load(mx_rows[:, None] + offs_d[None, :], mask=pd_mask, other=0.0)
        q = q.to(tl.float32)[:, None, :]
        lo = q * mn.to(tl.float32)[None, :, :]
        hi = q * mx.to(tl.float32)[None, :, :]
        acc += tl.sum(tl.maximum(lo, hi), 2)
    acc = acc * scale

    if AGG == 0:  # per query head: out [B, H, P]
        out_rows = out_ptr + b * s_ob + (kv * G + offs_g) * s_oh
        tl.store(out_rows[:, None] + offs_p[None, :], acc, mask=g_mask[:, None] & p_mask[None, :])
    else:  # per KV head: out [B, H_kv, P]
        if AGG == 1:
            red = tl.max(tl.where(g_mask[:, None], acc, -float("inf")), 0)
        else:
            red = tl.sum(acc, 0)  # padding heads are exactly 0
        tl.store(out_ptr + b * s_ob + kv * s_oh + offs_p, red, mask=p_mask)


def quest_page_bound(q: Tensor, page_min: Tensor, page_max: Tensor, scale: float, agg: str = "none") -> Tensor:
    """Launch the kernel. ``agg="none"`` → ``float32[B, H, P]``; ``"max"``/``"sum"`` → ``[B, H_kv, P]``."""
    if agg not in AGG_CODES:
        raise ValueError(f"agg must be one of {sorted(AGG_CODES)}, got {agg!r}")
    if q.device.type == "cpu" and not INTERPRET:
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is first imported")
    b, h, d = q.shape
    _, h_kv, n_pages, _ = page_min.shape
    g = h // h_kv
    # The kernels index the head dim with unit stride.
    q, page_min, page_max = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, page_min, page_max))
    out = _alloc(b, h if agg == "none" else h_kv, n_pages, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(n_pages, BLOCK_P), h_kv, b)  # read at launch: a probe may retune them
    _quest_bound_kernel[grid](
        q, page_min, page_max, out,
        q.stride(0), q.stride(1),
        page_min.stride(0), page_min.stride(1), page_min.stride(2),
        page_max.stride(0), page_max.stride(1), page_max.stride(2),
        out.stride(0), out.stride(1),
        n_pages, float(scale),
        G=g, G_PAD=triton.next_power_of_2(g), D=d,
        BLOCK_P=BLOCK_P, BLOCK_D=min(BLOCK_D, triton.next_power_of_2(d)), AGG=AGG_CODES[agg], num_warps=NUM_WARPS,
    )
    return out


__all__ = ["quest_page_bound", "INTERPRET"]

"""Quest page bound (Triton): an upper bound of ``scale·q·k`` over the keys of each cache page.

``bound[b, h, p] = scale · Σ_d max(q_d·min_d, q_d·max_d)`` from the per-page, per-channel key minima
and maxima ``[B, H_kv, P, D]`` (specification: `reference.quest_page_bound`, beside this file),
either per query head ``[B, H, P]`` or aggregated over the G query heads of each GQA group
``[B, H_kv, P]`` (max or sum; `reference.quest_page_bound_grouped`), which is what a KV-head-level
page choice needs.

Since ``max_d >= min_d``, the larger product is ``q_d·max_d`` where ``q_d >= 0`` and ``q_d·min_d``
where ``q_d < 0`` (the same float products, so nothing is rounded differently):

    Σ_d max(q_d·min_d, q_d·max_d) = q⁺·max + q⁻·min,   q⁺ = max(q, 0), q⁻ = min(q, 0)

two dot products per page instead of a channel-wise max, computed one of two ways
(`PageScoreConfig.method`): ``"dot"`` does both with ``tl.dot`` (tensor cores; the G heads padded to
16 rows; bf16 q⁺ and q⁻ are exact since q is bf16, fp32 summaries use full-precision dots);
``"loop"`` walks the G query heads of the group over a ``[block_p, D]`` tile held in registers, and
serves the head dims under 16 that tl.dot cannot take. (A ``[G, block_p, D]`` product reduced by its
max holds too many floats per program: it was much slower than the dot.)

Grid ``(cdiv(P, block_p), H_kv, B)``: a program scores ``block_p`` pages of one KV head for all G
query heads of its group, so the summaries (the bytes that matter) are read once per group. Launch
parameters: the `PageScoreConfig` the op chose for the call (`page_score_config`).
"""

from __future__ import annotations

from types import MappingProxyType

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import route

AGG_CODES = MappingProxyType({"none": 0, "max": 1, "sum": 2})


def _alloc(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every output and scratch buffer comes from here (uninitialised; the tests poison it with NaN)."""
    return torch.empty(*shape, dtype=dtype, device=device)


@triton.jit
def head_bounds(q_group, s_qh, mn, mx, offs_d, scale,
                G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr):
    """``[G_PAD, BLOCK_P]`` bounds of the group's query heads over a tile of summaries ``mn, mx
    [BLOCK_P, D_PAD]`` (padding pages and channels 0), both dots on tl.dot; padding heads are 0."""
    offs_g = tl.arange(0, G_PAD)
    q = tl.load(q_group + offs_g[:, None] * s_qh + offs_d[None, :],
                mask=(offs_g < G)[:, None] & (offs_d < D)[None, :], other=0.0)
    # Signs are split in fp32 (exact), then cast back to the summaries' dtype (exact for a
    # 16-bit q of the same dtype; fp32 otherwise).
    q = q.to(tl.float32)
    q_pos = tl.maximum(q, 0.0)
    q_neg = tl.minimum(q, 0.0)
    if IEEE:  # fp32 somewhere: full-precision dots
        mx, mn = mx.to(tl.float32), mn.to(tl.float32)
        acc = tl.dot(q_pos, tl.trans(mx), input_precision="ieee")
        acc = tl.dot(q_neg, tl.trans(mn), acc, input_precision="ieee")
    else:  # q and the summaries share a 16-bit dtype: its products are exact in the fp32 accumulator
        acc = tl.dot(q_pos.to(mx.dtype), tl.trans(mx))
        acc = tl.dot(q_neg.to(mn.dtype), tl.trans(mn), acc)
    return acc * scale


@triton.jit
def grouped_bound(q_group, s_qh, mn, mx, offs_d, scale,
                  G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_P: tl.constexpr,
                  AGG: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr):
    """``[BLOCK_P]``: the group's bounds over a tile of summaries folded by their max (``AGG`` 1) or
    sum (2). The fused page selection (`ops.select_pages`) calls this too, so its page bounds are
    the grouped op's, bit for bit."""
    if DOT:
        acc = head_bounds(q_group, s_qh, mn, mx, offs_d, scale, G, G_PAD, D, IEEE)
        if AGG == 1:
            red = tl.max(tl.where((tl.arange(0, G_PAD) < G)[:, None], acc, -float("inf")), 0)
        else:
            red = tl.sum(acc, 0)  # padding heads are exactly 0
    else:
        mn = mn.to(tl.float32)
        mx = mx.to(tl.float32)
        red = tl.zeros([BLOCK_P], tl.float32)
        if AGG == 1:
            red = red - float("inf")
        for g in tl.static_range(G):
            q = tl.load(q_group + g * s_qh + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
            bound = tl.sum(tl.where(q[None, :] >= 0.0, q[None, :] * mx, q[None, :] * mn), 1) * scale
            if AGG == 1:
                red = tl.maximum(red, bound)
            else:
                red += bound
    return red


@triton.jit
def _quest_bound_kernel(
    q_ptr, mn_ptr, mx_ptr, out_ptr,
    s_qb, s_qh,
    s_mb, s_mh, s_mp,
    s_xb, s_xh, s_xp,
    s_ob, s_oh,
    n_pages, scale,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_P: tl.constexpr, AGG: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr,
):
    pid_p = tl.program_id(0)
    kv = tl.program_id(1)
    b = tl.program_id(2)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, D_PAD)
    p_mask = offs_p < n_pages
    pd_mask = p_mask[:, None] & (offs_d < D)[None, :]
    # Padding pages and channels load 0 and add 0.
    mn = tl.load(mn_ptr + b * s_mb + kv * s_mh + offs_p[:, None] * s_mp + offs_d[None, :], mask=pd_mask, other=0.0)
    mx = tl.load(mx_ptr + b * s_xb + kv * s_xh + offs_p[:, None] * s_xp + offs_d[None, :], mask=pd_mask, other=0.0)
    q_group = q_ptr + b * s_qb + kv * G * s_qh

    if AGG != 0:  # per KV head: out [B, H_kv, P]
        red = grouped_bound(q_group, s_qh, mn, mx, offs_d, scale, G, G_PAD, D, BLOCK_P, AGG, DOT, IEEE)
        tl.store(out_ptr + b * s_ob + kv * s_oh + offs_p, red, mask=p_mask)
    elif DOT:  # per query head: out [B, H, P]
        acc = head_bounds(q_group, s_qh, mn, mx, offs_d, scale, G, G_PAD, D, IEEE)
        offs_g = tl.arange(0, G_PAD)
        out_rows = out_ptr + b * s_ob + (kv * G + offs_g) * s_oh
        tl.store(out_rows[:, None] + offs_p[None, :], acc, mask=(offs_g < G)[:, None] & p_mask[None, :])
    else:
        mn = mn.to(tl.float32)
        mx = mx.to(tl.float32)
        for g in tl.static_range(G):
            q = tl.load(q_group + g * s_qh + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
            bound = tl.sum(tl.where(q[None, :] >= 0.0, q[None, :] * mx, q[None, :] * mn), 1) * scale
            tl.store(out_ptr + b * s_ob + (kv * G + g) * s_oh + offs_p, bound, mask=p_mask)


def quest_page_bound(q: Tensor, page_min: Tensor, page_max: Tensor, scale: float, agg: str, cfg) -> Tensor:
    """Launch the kernel with ``cfg`` (a `PageScoreConfig` for this head dim). ``agg="none"`` →
    ``float32[B, H, P]``; ``"max"``/``"sum"`` → ``[B, H_kv, P]``."""
    if agg not in AGG_CODES:
        raise ValueError(f"agg must be one of {sorted(AGG_CODES)}, got {agg!r}")
    route.check_device(q)
    b, h, d = q.shape
    _, h_kv, n_pages, _ = page_min.shape
    g = h // h_kv
    # The kernels index the head dim with unit stride.
    q, page_min, page_max = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, page_min, page_max))
    out = _alloc(b, h if agg == "none" else h_kv, n_pages, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(n_pages, cfg.block_p), h_kv, b)
    _quest_bound_kernel[grid](
        q, page_min, page_max, out,
        q.stride(0), q.stride(1),
        page_min.stride(0), page_min.stride(1), page_min.stride(2),
        page_max.stride(0), page_max.stride(1), page_max.stride(2),
        out.stride(0), out.stride(1),
        n_pages, float(scale),
        G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d, D_PAD=triton.next_power_of_2(d),
        BLOCK_P=cfg.block_p, AGG=AGG_CODES[agg], DOT=cfg.method == "dot",
        # fp32 dots where a dtype is fp32 or differs, and under the interpreter (`route.INTERPRET`).
        IEEE=route.INTERPRET or q.dtype != page_min.dtype or page_min.dtype == torch.float32, num_warps=cfg.num_warps,
    )
    return out

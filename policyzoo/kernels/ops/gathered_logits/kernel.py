"""Exact logits of gathered keys (Triton): ``scale·q·k`` of each query head against the keys at
given cache slots, the second stage of a two-stage page policy.

``out[b, kv, g, n] = scale · q[b, kv·G + g] · keys[b, kv, slots[b, kv, n]]`` in fp32, or with
``agg="max"`` its maximum over the group, ``[B, H_kv, N]`` (specification:
`reference.gathered_logits`, beside this file), which is what a KV-head-level choice by the group's
best logit needs. Each key row (``D`` contiguous values) is read once for the G query heads of its
GQA group, and nothing else is written: in torch the same result took a gather that copied the keys,
an fp32 copy of that copy and a batched matmul, four passes over the candidates' keys.

Grid ``(cdiv(N, block_t), H_kv, B)``: a program scores ``block_t`` slots of one KV head for its G
query heads, with ``tl.dot`` (the G heads padded to 16 rows; bf16 products are exact in the fp32
accumulator), or a loop over the heads for head dims under 16, which tl.dot cannot take. Launch
parameters: the `GatheredLogitsConfig` the op chose for the call (`gathered_logits_config`). The
slots must lie in ``[0, capacity)``: they are not checked here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import route


@triton.jit
def _gathered_logits_kernel(
    q_ptr, k_ptr, slot_ptr, out_ptr,
    s_qb, s_qh, s_kb, s_kh, s_kt, s_sb, s_sh, s_ob, s_oh, s_og,
    n, scale,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr, MAX: tl.constexpr,
):
    pid_t = tl.program_id(0)
    kv = tl.program_id(1)
    b = tl.program_id(2)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, D_PAD)
    t_mask = offs_t < n
    d_mask = offs_d < D
    slots = tl.load(slot_ptr + b * s_sb + kv * s_sh + offs_t, mask=t_mask, other=0).to(tl.int64)
    # Padding slots and channels load 0 and score 0 (never stored).
    k = tl.load(k_ptr + b * s_kb + kv * s_kh + slots[:, None] * s_kt + offs_d[None, :],
                mask=t_mask[:, None] & d_mask[None, :], other=0.0)
    q_group = q_ptr + b * s_qb + kv * G * s_qh
    out_group = out_ptr + b * s_ob + kv * s_oh
    if DOT:
        offs_g = tl.arange(0, G_PAD)
        g_mask = offs_g < G
        q = tl.load(q_group + offs_g[:, None] * s_qh + offs_d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        if IEEE:  # fp32 somewhere: full-precision dots
            acc = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:  # q and the keys share a 16-bit dtype: its products are exact in the fp32 accumulator
            acc = tl.dot(q.to(k.dtype), tl.trans(k))
        acc = acc * scale
        if MAX:  # the group's best logit; padding heads must not enter it
            tl.store(out_group + offs_t, tl.max(tl.where(g_mask[:, None], acc, -float("inf")), 0), mask=t_mask)
        else:
            tl.store(out_group + offs_g[:, None] * s_og + offs_t[None, :], acc, mask=g_mask[:, None] & t_mask[None, :])
    else:
        k = k.to(tl.float32)
        best = tl.full([BLOCK_T], -float("inf"), tl.float32)
        for g in tl.static_range(G):
            q = tl.load(q_group + g * s_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
            logit = tl.sum(k * q[None, :], 1) * scale
            if MAX:
                best = tl.maximum(best, logit)
            else:
                tl.store(out_group + g * s_og + offs_t, logit, mask=t_mask)
        if MAX:
            tl.store(out_group + offs_t, best, mask=t_mask)


def gathered_logits(q: Tensor, keys: Tensor, slots: Tensor, scale: float, agg: str, cfg) -> Tensor:
    """With ``cfg`` (a `GatheredLogitsConfig` for this head dim): ``float32[B, H_kv, G, N]``
    (``agg="none"``) or ``[B, H_kv, N]`` (``"max"``) from ``q [B, H, D]``, ``keys [B, H_kv, capacity,
    D]`` and ``slots int[B, H_kv, N]`` (each in ``[0, capacity)``)."""
    if agg not in ("none", "max"):
        raise ValueError(f"agg must be 'none' or 'max', got {agg!r}")
    route.check_device(q)
    b, h, d = q.shape
    h_kv, n = keys.shape[1], slots.shape[-1]
    if q.dim() != 3 or keys.dim() != 4 or slots.shape[:2] != (b, h_kv) or keys.shape[-1] != d or h % h_kv:
        raise ValueError(f"expected q [B, H, D], keys [B, H_kv, T, D], slots [B, H_kv, N] with H a multiple of H_kv; "
                         f"got {tuple(q.shape)}, {tuple(keys.shape)}, {tuple(slots.shape)}")
    g = h // h_kv
    q, keys, slots = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, keys, slots))
    out = torch.empty(b, h_kv, *((g,) if agg == "none" else ()), n, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    _gathered_logits_kernel[(triton.cdiv(n, cfg.block_t), h_kv, b)](
        q, keys, slots, out,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), slots.stride(0), slots.stride(1),
        out.stride(0), out.stride(1), out.stride(2) if agg == "none" else 0,
        n, float(scale),
        G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d, D_PAD=triton.next_power_of_2(d),
        BLOCK_T=cfg.block_t, DOT=cfg.method == "dot", MAX=agg == "max",
        # fp32 dots where a dtype is fp32 or they differ, and under the interpreter (`route.INTERPRET`).
        IEEE=route.INTERPRET or q.dtype != keys.dtype or keys.dtype == torch.float32, num_warps=cfg.num_warps,
    )
    return out

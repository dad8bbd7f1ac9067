"""Each query's most attended keys under causal attention (Triton): the edge search of an attention
graph, without writing a logit.

Specification: `reference.attention_edges`, beside this file. Grid ``(cdiv(T, block_q), H)``: a program takes
``block_q`` queries of one head, walks the key tiles they see with ``tl.dot`` (as flash attention
does), and keeps per query a running log-sum-exp and an unordered list of its ``top`` best logits and
their key positions. A tile touches the lists only where one of its logits beats a query's current
``top``-th best: in rounds, each moving every such query's best remaining tile logit into the place
of its list's minimum (as many rounds as the most such logits one query has in the tile, usually
one or none). The lists are sorted once, after the kernel. Memory traffic is the queries
and the keys, once per query tile: the quadratic work stays on chip, where the torch reference
writes and rereads every logit.

Launch parameters: an `AttentionEdgesConfig`. Ties between equal logits go to the earlier key.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import route


@triton.jit
def _attention_edges_kernel(
    q_ptr, k_ptr, dst_ptr, p_ptr,
    s_qh, s_qt, s_kh, s_kt, s_oh, s_ot,
    t, n, first, scale,
    G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, TOP: tl.constexpr, TOP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    pid_q = tl.program_id(0)
    head = tl.program_id(1)
    kv = head // G
    rows = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, D_PAD)
    cols = tl.arange(0, BLOCK_K)
    slots = tl.arange(0, TOP_PAD)
    row_ok = rows < t
    pos = first + rows  # each query's position: it sees the keys 0 .. pos
    q = tl.load(q_ptr + head * s_qh + rows[:, None] * s_qt + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    if IEEE:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_Q], -float("inf"), tl.float32)  # running max logit
    l = tl.zeros([BLOCK_Q], tl.float32)  # running sum of exp(logit - m)
    # Each query's best logits so far, unordered; the padding slots hold +inf so that they are never
    # the list's minimum, the entry a better logit replaces.
    best = tl.where(slots[None, :] < TOP, -float("inf"), float("inf")) + tl.zeros([BLOCK_Q, TOP_PAD], tl.float32)
    best_key = tl.zeros([BLOCK_Q, TOP_PAD], tl.int32)
    floor = tl.min(best, 1)  # the TOP-th best so far: what a tile's logit must beat
    hi = tl.minimum(first + pid_q * BLOCK_Q + BLOCK_Q, n)  # the block's last query sees keys below this
    for k0 in range(0, hi, BLOCK_K):
        keys = k0 + cols
        k = tl.load(k_ptr + kv * s_kh + keys[:, None] * s_kt + offs_d[None, :],
                    mask=(keys[:, None] < n) & (offs_d[None, :] < D), other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where((keys[None, :] <= pos[:, None]) & row_ok[:, None], s, -float("inf"))
        tile_max = tl.max(s, 1)
        m_new = tl.maximum(m, tile_max)
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)  # a row that has seen nothing yet
        l = l * tl.exp(m - shift) + tl.sum(tl.exp(s - shift[:, None]), 1)
        m = m_new
        # Rounds while some query's tile holds a logit above its list's minimum: each moves the tile's
        # best into the minimum's place (TOP rounds at most: the tile's best come out in order).
        while tl.max((tile_max > floor).to(tl.int32)) > 0:
            take = tile_max > floor
            arg = tl.argmax(s, 1)
            low = tl.argmin(best, 1)
            put = take[:, None] & (slots[None, :] == low[:, None])
            best = tl.where(put, tile_max[:, None], best)
            best_key = tl.where(put, (k0 + arg)[:, None], best_key)
            s = tl.where(take[:, None] & (cols[None, :] == arg[:, None]), -float("inf"), s)
            tile_max = tl.max(s, 1)
            floor = tl.min(best, 1)
    seen = l > 0  # padding rows saw nothing (never stored)
    lse = tl.where(seen, m + tl.log(tl.where(seen, l, 1.0)), 0.0)
    p = tl.where((best == -float("inf")) | (slots[None, :] >= TOP), 0.0, tl.exp(best - lse[:, None]))
    out = head * s_oh + rows[:, None] * s_ot + slots[None, :]
    ok = row_ok[:, None] & (slots[None, :] < TOP)
    tl.store(dst_ptr + out, best_key, mask=ok)
    tl.store(p_ptr + out, p, mask=ok)


def _alloc(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.empty(*shape, dtype=dtype, device=device)  # the tests poison it


def attention_edges(q: Tensor, keys: Tensor, first: int, scale: float, top: int, cfg) -> tuple[Tensor, Tensor]:
    """``(dst int32[H, T, top], p float32[H, T, top])`` from ``q [H, T, D]`` and ``keys [H_kv, n, D]``
    (`reference.attention_edges`), with ``cfg`` (an `AttentionEdgesConfig`)."""
    h, t, d = q.shape
    h_kv, n = keys.shape[0], keys.shape[1]
    if h % h_kv or first < 0 or first + t > n:
        raise ValueError(f"attention_edges: {h} query heads over {h_kv} KV heads, queries {first}..{first + t} over {n} keys")
    route.check_device(q)
    q, keys = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, keys))
    dst = _alloc(h, t, top, dtype=torch.int32, device=q.device)
    p = _alloc(h, t, top, dtype=torch.float32, device=q.device)
    if t == 0:
        return dst, p
    # fp32 dots where a dtype is fp32, and under the interpreter (`route.INTERPRET`); else q in the
    # keys' 16-bit dtype.
    ieee = route.INTERPRET or q.dtype == torch.float32 or keys.dtype == torch.float32
    if not ieee:
        q = q.to(keys.dtype)
    grid = (triton.cdiv(t, cfg.block_q), h)
    _attention_edges_kernel[grid](
        q, keys, dst, p,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), dst.stride(0), dst.stride(1),
        t, n, first, float(scale),
        G=h // h_kv, D=d, D_PAD=max(16, triton.next_power_of_2(d)), TOP=top, TOP_PAD=max(2, triton.next_power_of_2(top)),
        BLOCK_Q=cfg.block_q, BLOCK_K=cfg.block_k, IEEE=ieee,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    p, order = torch.sort(p, dim=-1, descending=True, stable=True)  # the kernel's lists are unordered
    return torch.gather(dst, -1, order), p

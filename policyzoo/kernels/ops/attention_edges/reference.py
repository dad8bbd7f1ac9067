"""The attention graph's edge search's specification, in plain torch."""

from __future__ import annotations

import torch
from torch import Tensor

# Logits one block of `attention_edges` holds (a block of query rows against their visible keys).
EDGES_BLOCK_ELEMENTS = 2**22


def attention_edges(q: Tensor, keys: Tensor, first: int, scale: float, top: int) -> tuple[Tensor, Tensor]:
    """Each query's ``top`` most attended keys under causal softmax attention → ``(dst, p)``.

    ``q [H, T, D]`` are the queries of local positions ``first, first + 1, ...`` and ``keys [H_kv, n,
    D]`` the keys of positions ``0 .. n-1`` (GQA groups of ``H / H_kv`` consecutive query heads); the
    query at position ``i`` attends to the keys ``0 .. i``. ``dst int32[H, T, top]`` are its best keys
    (largest logit first) and ``p float32[H, T, top]`` their softmax probabilities; where a query sees
    fewer than ``top`` keys, the rest have ``p = 0`` (and any ``dst``). Logits are ``scale·q·k`` in fp32.

    It is the attention graph's edge search (`kv.CommunityKV`): the quadratic part of a prefill. Here
    blocks of query rows hold their logits (`EDGES_BLOCK_ELEMENTS`); the Triton kernel holds a tile.
    """
    h, t, d = q.shape
    h_kv, n = keys.shape[0], keys.shape[1]
    if h % h_kv or first < 0 or first + t > n:
        raise ValueError(f"attention_edges: {h} query heads over {h_kv} KV heads, queries {first}..{first + t} over {n} keys")
    g = h // h_kv
    keys_t = keys.float().transpose(-1, -2)[:, None]  # [H_kv, 1, D, n]
    rows = max(1, EDGES_BLOCK_ELEMENTS // (h * n))
    dsts, probs = [], []
    for lo in range(0, t, rows):
        qb = q[:, lo : lo + rows].float()
        r = qb.shape[1]
        seen = first + lo + r  # the keys the block's last query sees: causal, so no more are read
        logits = torch.matmul(qb.reshape(h_kv, g, r, d), keys_t[..., :seen]) * scale  # [H_kv, G, r, seen]
        later = torch.ones(r, r, dtype=torch.bool, device=q.device).triu_(1)  # only the last r keys can be after a query
        logits[..., seen - r :].masked_fill_(later, -torch.inf)
        best, dst = logits.topk(min(top, seen), dim=-1)
        p = torch.exp(best - logits.logsumexp(-1, keepdim=True))
        pad = top - p.shape[-1]  # a first block that sees fewer than `top` keys: no edge there
        dsts.append(torch.nn.functional.pad(dst.int(), (0, pad)).reshape(h, r, top))
        probs.append(torch.nn.functional.pad(p, (0, pad)).reshape(h, r, top))
    return torch.cat(dsts, 1), torch.cat(probs, 1)


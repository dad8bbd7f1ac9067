"""Audit metrics against dense decoding.

Renormalised softmax over a selection ``S`` obeys ``‖o − ô‖ ≤ 2δ·max‖v‖`` with the dropped mass
``δ = 1 − Σ_{i∈S} p_i``: the quality of a KV policy is controlled by how much dense attention mass
it drops, which is why δ is the first number every policy reports.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..selection import Selection


def dropped_mass(p_dense: Tensor, sel: Selection, token_valid: Tensor) -> Tensor:
    """``float32[B, H]``: dense softmax mass each query head loses to the selection.

    ``p_dense [B, H, N]`` are dense probabilities over visible slots; the selection is per KV head
    and shared by the ``H // H_kv`` query heads of its group.
    """
    b, h, n = p_dense.shape
    keep = sel.token_mask(n) & token_valid[:, None, :]
    h_kv = keep.shape[1]
    kept = (p_dense.view(b, h_kv, h // h_kv, n) * keep[:, :, None, :]).sum(-1)
    return (1.0 - kept).clamp(min=0.0).reshape(b, h)


def topk_mass_recall(p_dense: Tensor, sel: Selection, token_valid: Tensor) -> Tensor:
    """``float32[B, H]``: the dense mass the selection captured over the dense top-k mass.

    ``k`` is the number of real tokens the selection kept for the query head's KV head, so the
    recall is 1 exactly when the policy kept the ``k`` heaviest tokens of every query head of the
    group (the best any selection of that size can do) and is never above 1.
    """
    b, h, n = p_dense.shape
    keep = sel.token_mask(n) & token_valid[:, None, :]  # [B, H_kv, N]
    h_kv = keep.shape[1]
    p = p_dense.float().view(b, h_kv, h // h_kv, n)
    captured = (p * keep[:, :, None, :]).sum(-1)  # [B, H_kv, G]
    k = keep.sum(-1)  # [B, H_kv]
    cum = p.sort(dim=-1, descending=True).values.cumsum(-1)
    idx = (k - 1).clamp(min=0)[:, :, None, None].expand(b, h_kv, h // h_kv, 1)
    best = torch.gather(cum, -1, idx).squeeze(-1)
    best = torch.where(k[:, :, None] > 0, best, torch.zeros_like(best))
    recall = torch.where(best > 0, captured / best.clamp(min=1e-30), torch.ones_like(best))
    return recall.clamp(max=1.0).reshape(b, h)


def relative_output_error(o_dense: Tensor, o_sparse: Tensor, eps: float = 1e-12) -> Tensor:
    """``‖o − ô‖ / ‖o‖`` over the last dim."""
    o, oh = o_dense.float(), o_sparse.float()
    return (o - oh).norm(dim=-1) / o.norm(dim=-1).clamp(min=eps)


def logits_kl(logits_dense: Tensor, logits_sparse: Tensor) -> Tensor:
    """``KL(p_dense ‖ p_sparse)`` over the vocabulary (last dim), in nats."""
    lp = torch.log_softmax(logits_dense.float(), dim=-1)
    lq = torch.log_softmax(logits_sparse.float(), dim=-1)
    return (lp.exp() * (lp - lq)).sum(-1)


def top1_agreement(logits_dense: Tensor, logits_sparse: Tensor) -> Tensor:
    """``bool``: whether the greedy token is the same."""
    return logits_dense.argmax(-1) == logits_sparse.argmax(-1)


def group_mean(x: Tensor, num_kv_heads: int) -> Tensor:
    """Average per-query-head values ``[B, H]`` over each GQA group → ``[B, H_kv]``."""
    b, h = x.shape
    return x.view(b, num_kv_heads, h // num_kv_heads).mean(-1)

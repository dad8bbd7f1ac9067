"""The exact logits of gathered keys' specification, in plain torch."""

from __future__ import annotations

import torch
from torch import Tensor


def gathered_logits(q: Tensor, keys: Tensor, slots: Tensor, scale: float, agg: str = "none") -> Tensor:
    """``float32[B, H_kv, G, N]``: ``scale·q·k`` of query heads ``q [B, H, D]`` (GQA groups of G
    consecutive heads) against the keys at ``slots int[B, H_kv, N]`` (each in ``[0, capacity)``) of
    ``keys [B, H_kv, capacity, D]``, in fp32; with ``agg="max"`` the group's maximum, ``[B, H_kv, N]``."""
    if agg not in ("none", "max"):
        raise ValueError(f"agg must be 'none' or 'max', got {agg!r}")
    b, h, d = q.shape
    h_kv = keys.shape[1]
    picked = torch.gather(keys, 2, slots.long()[..., None].expand(-1, -1, -1, d))
    logits = torch.einsum("bkgd,bknd->bkgn", q.view(b, h_kv, h // h_kv, d).float(), picked.float()) * scale
    return logits if agg == "none" else logits.amax(2)


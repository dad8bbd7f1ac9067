"""The page Gaussians' specification, in plain torch."""

from __future__ import annotations

import torch
from torch import Tensor


def page_gaussians(q: Tensor, page_mean: Tensor, page_std: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Per query head and page, a Gaussian model of the page's logits ``scale·q·k``, the key channels
    taken as independent: ``μ = scale·q·mean`` and ``σ = √(Σ_d (scale·q_d)²·std_d²)``.

    ``q [B, H, D]``, ``page_mean``/``page_std [B, H_kv, P, D]`` (each query head reads its GQA
    group's KV head) → ``(μ, σ) float32[B, H, P]`` each.
    """
    b, h, d = q.shape
    h_kv = page_mean.shape[1]
    qs = q.float().view(b, h_kv, h // h_kv, d) * scale
    mu = torch.einsum("bkgd,bkpd->bkgp", qs, page_mean.float())
    std = page_std.float()
    var = torch.einsum("bkgd,bkpd->bkgp", qs * qs, std * std)
    return mu.reshape(b, h, -1), var.clamp(min=0).sqrt().reshape(b, h, -1)

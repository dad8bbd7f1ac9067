"""The page Gaussians (Triton); specification `reference.page_gaussians`, beside this file.

A program reads the mean and standard deviation summaries of ``block_p`` pages of one KV head
(``[block_p, D]`` each) once, and writes ``μ`` and ``σ`` of those pages for every query head of the
group, the heads in turn over the tiles held in registers, in fp32. The summaries are fp32 (two
thirds of what `EntmaxKV` reads per step at long contexts), so the op is a stream over them: as two
einsums, the product ``std·std`` was written and read again and each einsum read its summary alone.

Grid ``(cdiv(P, block_p), H_kv, B)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import route


def _alloc(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every output comes from here (uninitialised; the tests poison it with NaN)."""
    return torch.empty(*shape, dtype=dtype, device=device)


@triton.jit
def _page_gaussians_kernel(
    q_ptr, mean_ptr, std_ptr, mu_ptr, sigma_ptr,
    s_qb, s_qh,
    s_mb, s_mh, s_mp,
    s_sb, s_sh, s_sp,
    s_ob, s_oh,
    n_pages, scale,
    G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_P: tl.constexpr,
):
    kv = tl.program_id(1)
    b = tl.program_id(2)
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, D_PAD)
    p_mask = offs_p < n_pages
    d_mask = offs_d < D
    pd_mask = p_mask[:, None] & d_mask[None, :]
    mean = tl.load(mean_ptr + b * s_mb + kv * s_mh + offs_p[:, None] * s_mp + offs_d[None, :], mask=pd_mask,
                   other=0.0).to(tl.float32)
    std = tl.load(std_ptr + b * s_sb + kv * s_sh + offs_p[:, None] * s_sp + offs_d[None, :], mask=pd_mask,
                  other=0.0).to(tl.float32)
    var_d = std * std
    for g in tl.static_range(G):
        head = kv * G + g
        qs = tl.load(q_ptr + b * s_qb + head * s_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32) * scale
        mu = tl.sum(qs[None, :] * mean, 1)
        var = tl.sum((qs * qs)[None, :] * var_d, 1)
        out = b * s_ob + head * s_oh + offs_p
        tl.store(mu_ptr + out, mu, mask=p_mask)
        tl.store(sigma_ptr + out, tl.sqrt(tl.maximum(var, 0.0)), mask=p_mask)


def page_gaussians(q: Tensor, page_mean: Tensor, page_std: Tensor, scale: float, cfg) -> tuple[Tensor, Tensor]:
    """Launch the kernel with ``cfg`` (a `PageGaussiansConfig`): ``(μ, σ) float32[B, H, P]``."""
    route.check_device(q)
    b, h, d = q.shape
    _, h_kv, n_pages, _ = page_mean.shape
    q, page_mean, page_std = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, page_mean, page_std))
    mu = _alloc(b, h, n_pages, dtype=torch.float32, device=q.device)
    sigma = _alloc(b, h, n_pages, dtype=torch.float32, device=q.device)
    if mu.numel() == 0:
        return mu, sigma
    _page_gaussians_kernel[(triton.cdiv(n_pages, cfg.block_p), h_kv, b)](
        q, page_mean, page_std, mu, sigma,
        q.stride(0), q.stride(1),
        page_mean.stride(0), page_mean.stride(1), page_mean.stride(2),
        page_std.stride(0), page_std.stride(1), page_std.stride(2),
        mu.stride(0), mu.stride(1),
        n_pages, float(scale),
        G=h // h_kv, D=d, D_PAD=triton.next_power_of_2(d), BLOCK_P=cfg.block_p, num_warps=cfg.num_warps,
    )
    return mu, sigma

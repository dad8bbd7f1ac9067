"""Triton helpers the key-sketch kernels (`kernel.py`, `half2.py`) share: the pages' grid as the
reference computes it, and the store of each page's best bounds."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def page_grid(mn_ptrs, mx_ptrs, mask):
    """``(low, step, radius)`` fp32 tiles of the pages' grids, as `reference.sketch_grid` computes them."""
    mn = tl.load(mn_ptrs, mask=mask, other=0.0).to(tl.float32)
    mx = tl.load(mx_ptrs, mask=mask, other=0.0).to(tl.float32)
    step = (mx - mn) / 15.0
    radius = step * (0.5 + 1.0 / 4096) + (1.0 / 1048576) * tl.maximum(tl.abs(mn), tl.abs(mx))
    return mn, step, radius


@triton.jit
def store_best(out_ptr, best, b, kv, s_ob, s_oh, offs_e, e_mask, G: tl.constexpr, G_PAD: tl.constexpr,
                AGG: tl.constexpr):
    """Store ``best [BLOCK_P, G_PAD]``: each query head's row, or (AGG) the group's max."""
    offs_g = tl.arange(0, G_PAD)
    g_ok = offs_g[None, :] < G
    if AGG == 0:
        tl.store(out_ptr + b * s_ob + (kv * G + offs_g[None, :]) * s_oh + offs_e[:, None], best, mask=e_mask[:, None] & g_ok)
    else:
        red = tl.max(tl.where(g_ok, best, -float("inf")), 1)
        tl.store(out_ptr + b * s_ob + kv * s_oh + offs_e, red, mask=e_mask)

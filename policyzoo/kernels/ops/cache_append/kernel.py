"""Decode-step cache append (Triton): write one token's key and value and refresh the summaries of
the page that holds it, in one launch; spec: `reference.cache_append`, beside this file.

In a compiled decode step the torch version is three or four kernels per layer (the key's copy, the
value's copy, the touched page's statistics), each moving a few kilobytes: their cost is launches,
not bytes. Here one program per (batch row, KV head) stores the key and value at slot
``length - 1`` and re-summarises the page over its visible slots, with the new key taken from
registers (so no program reads memory another one is writing). Only the summaries the cache keeps
are computed (``MINMAX``, ``MOMENTS``): a `Dense` decode keeps none. ``length`` and ``start`` are
read on the device, so the launch is the same at every step.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from ... import route


@triton.jit
def _cache_append_kernel(
    k_ptr, v_ptr, keys_ptr, values_ptr, mn_ptr, mx_ptr, mean_ptr, std_ptr, start_ptr, length_ptr,
    s_kb, s_kh, s_vb, s_vh,
    s_cb, s_ch, s_cn, s_wb, s_wh, s_wn,
    s_sb, s_sh, s_sp,
    D: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr, PAGE_PAD: tl.constexpr,
    MINMAX: tl.constexpr, MOMENTS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(length_ptr) - 1
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < D
    k = tl.load(k_ptr + b * s_kb + h * s_kh + offs_d, mask=d_mask, other=0.0).to(keys_ptr.dtype.element_ty)
    v = tl.load(v_ptr + b * s_vb + h * s_vh + offs_d, mask=d_mask, other=0.0).to(values_ptr.dtype.element_ty)
    row = keys_ptr + b * s_cb + h * s_ch
    tl.store(row + slot * s_cn + offs_d, k, mask=d_mask)
    tl.store(values_ptr + b * s_wb + h * s_wh + slot * s_wn + offs_d, v, mask=d_mask)
    if MINMAX or MOMENTS:
        page = slot // PAGE
        offs_t = tl.arange(0, PAGE_PAD)
        pos = page * PAGE + offs_t
        seen = (offs_t < PAGE) & (pos >= tl.load(start_ptr + b)) & (pos < slot + 1)
        tile_mask = seen[:, None] & d_mask[None, :]
        # The other slots from memory, the new one from registers.
        tile = tl.load(row + pos[:, None] * s_cn + offs_d[None, :], mask=tile_mask & (pos != slot)[:, None], other=0.0)
        tile = tl.where((pos == slot)[:, None], k[None, :], tile).to(tl.float32)
        n = tl.sum(seen.to(tl.int32), 0)
        out = b * s_sb + h * s_sh + page * s_sp + offs_d
        if MINMAX:  # zeros for a page with nothing visible, as in `reference.page_summaries`
            kmin = tl.where(n > 0, tl.min(tl.where(tile_mask, tile, float("inf")), 0), 0.0)
            kmax = tl.where(n > 0, tl.max(tl.where(tile_mask, tile, -float("inf")), 0), 0.0)
            tl.store(mn_ptr + out, kmin.to(mn_ptr.dtype.element_ty), mask=d_mask)
            tl.store(mx_ptr + out, kmax.to(mx_ptr.dtype.element_ty), mask=d_mask)
        if MOMENTS:
            count = tl.maximum(n, 1).to(tl.float32)
            mean = tl.sum(tl.where(tile_mask, tile, 0.0), 0) / count
            dev = tl.where(tile_mask, tile - mean[None, :], 0.0)
            std = tl.sqrt(tl.sum(dev * dev, 0) / count)
            tl.store(mean_ptr + out, mean.to(mean_ptr.dtype.element_ty), mask=d_mask)
            tl.store(std_ptr + out, std.to(std_ptr.dtype.element_ty), mask=d_mask)


def cache_append(
    k: Tensor,
    v: Tensor,
    keys: Tensor,
    values: Tensor,
    summaries: tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None],
    start: Tensor,
    length: Tensor,
    page_size: int,
) -> None:
    """`reference.cache_append` in one launch. Min and max are kept together or not at all, and so
    are mean and std (the cache keeps them in pairs)."""
    route.check_device(keys)
    b, h, n, d = keys.shape
    if k.shape != (b, h, 1, d) or v.shape != (b, h, 1, d) or values.shape != keys.shape:
        raise ValueError(f"expected k, v [B, H_kv, 1, D] for a cache {tuple(keys.shape)}, got {tuple(k.shape)}, "
                         f"{tuple(v.shape)} and values {tuple(values.shape)}")
    kmin, kmax, mean, std = summaries
    if (kmin is None) != (kmax is None) or (mean is None) != (std is None):
        raise ValueError("cache_append keeps min and max together, and mean and std together")
    kept = [s for s in summaries if s is not None]
    shape = (b, h, n // page_size, d)
    if n % page_size or any(s.shape != shape or s.stride() != kept[0].stride() or s.stride(-1) != 1 for s in kept):
        raise ValueError(f"summaries must be {shape} with one layout for a cache of {n} slots in pages of {page_size}")
    if min(keys.stride(-1), values.stride(-1), k.stride(-1), v.stride(-1)) != 1:
        raise ValueError("cache_append needs unit stride along the head dim")
    stride = kept[0].stride() if kept else (0, 0, 0, 1)
    _cache_append_kernel[(b, h)](
        k, v, keys, values,
        kmin if kmin is not None else keys, kmax if kmax is not None else keys,
        mean if mean is not None else keys, std if std is not None else keys,
        start, length,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        stride[0], stride[1], stride[2],
        D=d, D_PAD=triton.next_power_of_2(d), PAGE=page_size, PAGE_PAD=triton.next_power_of_2(page_size),
        MINMAX=kmin is not None, MOMENTS=mean is not None, num_warps=1 if page_size * d <= 2048 else 4,
    )

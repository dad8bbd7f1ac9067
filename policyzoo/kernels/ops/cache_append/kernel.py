"""Decode-step cache append (Triton): write one token's key and value and refresh the summaries of
the page that holds it, in one launch; spec: `reference.cache_append`, beside this file.

In a compiled decode step the torch version is three or four kernels per layer (the key's copy, the
value's copy, the touched page's statistics), each moving a few kilobytes: their cost is launches,
not bytes. Here one program per (batch row, KV head) stores the key and value at slot
``length - 1`` and re-summarises the page over its visible slots, with the new key taken from
registers (so no program reads memory another one is writing). Only the summaries the cache keeps
are computed (``MINMAX``, ``MOMENTS``): a `Dense` decode keeps none. With the key sketch
(``SKETCH``) the program also codes every slot of the page again on its new min/max grid
(`_sketch_codes`, `reference.sketch_encode`'s arithmetic: IEEE divisions, ties to even), which in
torch was a dozen more operations per layer and step. ``length`` and ``start`` are read on the
device, so the launch is the same at every step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import route


# Quotients are clamped to this magnitude before rounding, far outside 0..15: below 2^23, where
# every fp32 step of the rounding is exact.
FAR = tl.constexpr(1048576.0)


@triton.jit
def _sketch_codes(tile, lo, hi):
    """int32 codes ``0..15`` of ``tile [T, C]`` on the grid of ``lo, hi [C]``, as
    `reference.sketch_encode` computes them: step ``(hi - lo) / 15``, ``(k - lo) / step`` where the
    step is positive (else 0), rounded to the nearest integer (ties to even), clamped."""
    step = tl.div_rn(hi - lo, tl.full(hi.shape, 15.0, tl.float32))
    some = step > 0
    x = tl.div_rn(tile - lo[None, :], tl.where(some, step, 1.0)[None, :])
    x = tl.where(some[None, :], x, 0.0)
    x = tl.minimum(tl.maximum(x, -FAR), FAR)
    # Round to the nearest integer, ties to the even one (torch.round), in exact steps.
    t = tl.floor(x)
    frac = x - t
    odd = (t - 2.0 * tl.floor(t * 0.5)) != 0.0
    r = t + ((frac > 0.5) | ((frac == 0.5) & odd)).to(tl.float32)
    return tl.minimum(tl.maximum(r, 0.0), 15.0).to(tl.int32)


@triton.jit
def _page_channels(row, k_src, slot, pos, every, seen, s_cn, offs_c, c_mask, key_ty):
    """The page's keys at channels ``offs_c`` of every slot (the new one from ``k_src``), fp32
    ``[PAGE_PAD, C]``, and their min and max over the visible slots (0 where none is)."""
    tile = tl.load(row + pos[:, None] * s_cn + offs_c[None, :], mask=every[:, None] & c_mask[None, :] & (pos != slot)[:, None],
                   other=0.0)
    new = tl.load(k_src + offs_c, mask=c_mask, other=0.0).to(key_ty)
    tile = tl.where((pos == slot)[:, None], new[None, :], tile).to(tl.float32)
    vis = seen[:, None] & c_mask[None, :]
    some = tl.sum(seen.to(tl.int32), 0) > 0
    lo = tl.where(some, tl.min(tl.where(vis, tile, float("inf")), 0), 0.0)
    hi = tl.where(some, tl.max(tl.where(vis, tile, -float("inf")), 0), 0.0)
    return tile, lo, hi


@triton.jit
def _encode_page(row, k_src, code_row, slot, pos, every, seen, s_cn, s_on, key_ty, sum_ty,
                 D: tl.constexpr, DH: tl.constexpr, DH_PAD: tl.constexpr):
    """Code every slot of the page: byte ``j`` of a slot holds channel ``j`` (low nibble) and
    ``j + DH`` (high nibble), each on its channel's min/max as the cache stores them."""
    offs_j = tl.arange(0, DH_PAD)
    lo_ch = offs_j < DH
    hi_ch = offs_j + DH < D
    tile, lo, hi = _page_channels(row, k_src, slot, pos, every, seen, s_cn, offs_j, lo_ch, key_ty)
    code = _sketch_codes(tile, lo.to(sum_ty).to(tl.float32), hi.to(sum_ty).to(tl.float32))
    tile, lo, hi = _page_channels(row, k_src, slot, pos, every, seen, s_cn, offs_j + DH, hi_ch, key_ty)
    code_hi = _sketch_codes(tile, lo.to(sum_ty).to(tl.float32), hi.to(sum_ty).to(tl.float32))
    code = code | tl.where(hi_ch[None, :], code_hi, 0) * 16
    tl.store(code_row + pos[:, None] * s_on + offs_j[None, :], code.to(tl.uint8), mask=every[:, None] & lo_ch[None, :])


@triton.jit
def _cache_append_kernel(
    k_ptr, v_ptr, keys_ptr, values_ptr, mn_ptr, mx_ptr, mean_ptr, std_ptr, code_ptr, start_ptr, length_ptr,
    s_kb, s_kh, s_vb, s_vh,
    s_cb, s_ch, s_cn, s_wb, s_wh, s_wn,
    s_sb, s_sh, s_sp, s_ob, s_oh, s_on,
    D: tl.constexpr, D_PAD: tl.constexpr, DH: tl.constexpr, DH_PAD: tl.constexpr, PAGE: tl.constexpr,
    PAGE_PAD: tl.constexpr, MINMAX: tl.constexpr, MOMENTS: tl.constexpr, SKETCH: tl.constexpr,
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
        if SKETCH:  # every slot of the page, visible or not, as the cache codes a prompt's pages
            _encode_page(row, k_ptr + b * s_kb + h * s_kh, code_ptr + b * s_ob + h * s_oh, slot, pos, offs_t < PAGE,
                         seen, s_cn, s_on, keys_ptr.dtype.element_ty, mn_ptr.dtype.element_ty, D, DH, DH_PAD)


def cache_append(
    k: Tensor,
    v: Tensor,
    keys: Tensor,
    values: Tensor,
    summaries: tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None],
    start: Tensor,
    length: Tensor,
    page_size: int,
    codes: Tensor | None = None,
) -> None:
    """`reference.cache_append` in one launch. Min and max are kept together or not at all, and so
    are mean and std (the cache keeps them in pairs); the key sketch's ``codes`` need min and max."""
    route.check_device(keys)
    b, h, n, d = keys.shape
    if k.shape != (b, h, 1, d) or v.shape != (b, h, 1, d) or values.shape != keys.shape:
        raise ValueError(f"expected k, v [B, H_kv, 1, D] for a cache {tuple(keys.shape)}, got {tuple(k.shape)}, "
                         f"{tuple(v.shape)} and values {tuple(values.shape)}")
    kmin, kmax, mean, std = summaries
    if (kmin is None) != (kmax is None) or (mean is None) != (std is None):
        raise ValueError("cache_append keeps min and max together, and mean and std together")
    dh = (d + 1) // 2
    if codes is not None:
        if kmin is None:
            raise ValueError("cache_append codes the key sketch on the page's min and max: keep them too")
        if codes.shape != (b, h, n, dh) or codes.dtype != torch.uint8 or codes.stride(-1) != 1:
            raise ValueError(f"codes must be uint8 [{b}, {h}, {n}, {dh}] with unit last stride, got "
                             f"{codes.dtype} {tuple(codes.shape)}")
    kept = [s for s in summaries if s is not None]
    shape = (b, h, n // page_size, d)
    if n % page_size or any(s.shape != shape or s.stride() != kept[0].stride() or s.stride(-1) != 1 for s in kept):
        raise ValueError(f"summaries must be {shape} with one layout for a cache of {n} slots in pages of {page_size}")
    if min(keys.stride(-1), values.stride(-1), k.stride(-1), v.stride(-1)) != 1:
        raise ValueError("cache_append needs unit stride along the head dim")
    stride = kept[0].stride() if kept else (0, 0, 0, 1)
    code_stride = codes.stride() if codes is not None else (0, 0, 0)
    _cache_append_kernel[(b, h)](
        k, v, keys, values,
        kmin if kmin is not None else keys, kmax if kmax is not None else keys,
        mean if mean is not None else keys, std if std is not None else keys,
        codes if codes is not None else keys, start, length,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        stride[0], stride[1], stride[2], code_stride[0], code_stride[1], code_stride[2],
        D=d, D_PAD=triton.next_power_of_2(d), DH=dh, DH_PAD=triton.next_power_of_2(dh), PAGE=page_size,
        PAGE_PAD=triton.next_power_of_2(page_size), MINMAX=kmin is not None, MOMENTS=mean is not None,
        SKETCH=codes is not None, num_warps=_warps(page_size * d, codes is not None),
    )


def _warps(page_elements: int, sketch: bool) -> int:
    """Warps per program: one row's page is a few kilobytes, so one warp (4 past 2,048 elements);
    with the key sketch, whose division and rounding of every element of the page make the program
    a long serial chain for one warp, 4 (8 past 1,024 elements: about 1,000 instructions a warp at
    pages of 16 and head dim 128 in the sm_90 code, against 4,350 for one warp)."""
    if sketch:
        return 4 if page_elements <= 1024 else 8
    return 1 if page_elements <= 2048 else 4

"""The key-sketch page bound (Triton); specification `reference.sketch_page_bound`, beside this file.

A program reads the 4-bit codes of every key of ``block_p`` pages and their pages' min/max, and keeps
each page's best token bound ``scale·(q·min + |q|·radius + Σ_i (q_i·step_i)·c_ti)`` over its visible
slots, per query head or folded over the group. The codes are half a byte per key channel, so the
kernel streams about a quarter of the bytes the keys hold. `SketchScoreConfig.method` picks how the
products are summed: ``"sum"`` in fp32 on CUDA cores (`_sum_bound`); ``"dot"``, a batched tl.dot of
each page's codes (fp16, exact) with its weights ``q·step`` in fp16, where 15 times the weights'
rounding is added back so the result stays an upper bound (`_code_dot_bound`); or ``"keys"``, the
sketch's keys ``min + step·c`` decoded in fp16 and one tl.dot of the program's tokens with the
group's queries (the query is the same for every page, so the dot is as wide as the program's
tokens), the worst case of both roundings added back per page (`_keys_bound`). "sum" and "dot" are
bound by their arithmetic, not their bytes; so is ``"rows"`` (`_sketch_rows_kernel`), which spends
fewer instructions on a code byte: each thread sums whole code rows of a few tokens of one page, so
the channel sums need no shuffles and the page's weights serve several tokens.

Grid ``(cdiv(entries, block_p), H_kv, B)``: entries are the pages, or with a list of pages the
listed ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import route
from . import half2
from .shared import page_grid, store_best


def _alloc(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every output comes from here (uninitialised; the tests poison it with NaN)."""
    return torch.empty(*shape, dtype=dtype, device=device)


@triton.jit
def _fp16(x):
    """``x`` in fp16, clamped inside its range."""
    return tl.minimum(tl.maximum(x, -60000.0), 60000.0).to(tl.float16)


@triton.jit
def _group_queries(q_ptr, b, kv, s_qb, s_qh, offs_j, lo_ch, hi_ch, DH: tl.constexpr, G: tl.constexpr,
                   G_PAD: tl.constexpr):
    """The group's queries as fp32 ``[DH_PAD, G_PAD]`` columns: channels ``j`` and ``j + DH``."""
    offs_g = tl.arange(0, G_PAD)
    q_cols = q_ptr + b * s_qb + (kv * G + offs_g[None, :]) * s_qh
    g_ok = offs_g[None, :] < G
    q_lo = tl.load(q_cols + offs_j[:, None], mask=lo_ch[:, None] & g_ok, other=0.0).to(tl.float32)
    q_hi = tl.load(q_cols + DH + offs_j[:, None], mask=hi_ch[:, None] & g_ok, other=0.0).to(tl.float32)
    return q_lo, q_hi


@triton.jit
def _entries(list_ptr, b, kv, s_lb, s_lh, n_pages, n_entries, BLOCK_P: tl.constexpr, LISTED: tl.constexpr):
    """This program's output entries and the pages they score: with LISTED, entry ``e`` scores page
    ``list[b, kv, e]`` (masked outside ``[0, n_pages)``), else page ``e``."""
    offs_e = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    e_mask = offs_e < n_entries
    if LISTED:
        offs_p = tl.load(list_ptr + b * s_lb + kv * s_lh + offs_e, mask=e_mask, other=0).to(tl.int32)
        p_mask = e_mask & (offs_p >= 0) & (offs_p < n_pages)
    else:
        offs_p = offs_e
        p_mask = e_mask
    return offs_e, e_mask, offs_p, p_mask


@triton.jit
def _keys_bound(c, q_lo, q_hi, mn_lo, step_lo, rad_lo, mn_hi, step_hi, rad_hi, seen, scale,
                BLOCK_P: tl.constexpr, PAGE: tl.constexpr, DH_PAD: tl.constexpr, G_PAD: tl.constexpr):
    """``[BLOCK_P, G_PAD]`` best bounds: the sketch's keys ``k̂ = low + step·c`` decoded in fp16,
    against the group's queries in fp16, one ``[BLOCK_P·PAGE, DH_PAD] × [DH_PAD, G_PAD]`` dot per half."""
    q16_lo, q16_hi = _fp16(q_lo), _fp16(q_hi)
    k16_lo = _fp16(mn_lo[:, None, :] + step_lo[:, None, :] * (c & 15).to(tl.float32))  # [BLOCK_P, PAGE, DH_PAD]
    k16_hi = _fp16(mn_hi[:, None, :] + step_hi[:, None, :] * (c >> 4).to(tl.float32))
    acc = tl.dot(tl.reshape(k16_lo, (BLOCK_P * PAGE, DH_PAD)), q16_lo)  # [BLOCK_P·PAGE, G_PAD], fp32
    acc = tl.dot(tl.reshape(k16_hi, (BLOCK_P * PAGE, DH_PAD)), q16_hi, acc)
    acc = tl.reshape(acc, (BLOCK_P, PAGE, G_PAD))
    # Per page and head: |q|·radius, plus what the fp16 roundings can have taken off q·k̂. A key
    # channel of the page lies within M = max(|low|, |high|): its rounding (2^-11 relative, 2^-24
    # below fp16's normal range, and the clamp) costs |q|·(2^-11·M + 2^-24 + max(M - 60000, 0)) at
    # most; the query's, |q - q16|·|k16| <= |q - q16|·M·(1 + 2^-10).
    big_lo = tl.maximum(tl.abs(mn_lo), tl.abs(mn_lo + 15.0 * step_lo))  # [BLOCK_P, DH_PAD]
    big_hi = tl.maximum(tl.abs(mn_hi), tl.abs(mn_hi + 15.0 * step_hi))
    err_lo = q_lo - q16_lo.to(tl.float32)
    err_hi = q_hi - q16_hi.to(tl.float32)
    k_err_lo = big_lo * (1.0 / 2048 + 1.0 / 1048576) + 1.0 / 16777216 + tl.maximum(big_lo - 60000.0, 0.0)
    k_err_hi = big_hi * (1.0 / 2048 + 1.0 / 1048576) + 1.0 / 16777216 + tl.maximum(big_hi - 60000.0, 0.0)
    q_big_lo = big_lo * (1.0 + 1.0 / 1024)
    q_big_hi = big_hi * (1.0 + 1.0 / 1024)
    base = tl.sum((rad_lo + k_err_lo)[:, :, None] * tl.abs(q_lo)[None, :, :] + q_big_lo[:, :, None] * tl.abs(err_lo)[None, :, :], 1)
    base += tl.sum((rad_hi + k_err_hi)[:, :, None] * tl.abs(q_hi)[None, :, :] + q_big_hi[:, :, None] * tl.abs(err_hi)[None, :, :], 1)
    bound = tl.where(seen[:, :, None], (acc + base[:, None, :]) * scale, -float("inf"))
    return tl.max(bound, 1)


@triton.jit
def _code_dot_bound(c, q_lo, q_hi, mn_lo, step_lo, rad_lo, mn_hi, step_hi, rad_hi, seen, scale):
    """``[BLOCK_P, G_PAD]`` best bounds: each page's codes (fp16, exact) against its weights
    ``W = q·step`` in fp16, a batched dot, plus ``base = q·min + |q|·radius``."""
    c_lo = (c & 15).to(tl.float16)  # 0..15: exact
    c_hi = (c >> 4).to(tl.float16)
    base = tl.sum(mn_lo[:, :, None] * q_lo[None, :, :] + rad_lo[:, :, None] * tl.abs(q_lo)[None, :, :], 1)
    base += tl.sum(mn_hi[:, :, None] * q_hi[None, :, :] + rad_hi[:, :, None] * tl.abs(q_hi)[None, :, :], 1)
    w_lo = step_lo[:, :, None] * q_lo[None, :, :]  # [BLOCK_P, DH_PAD, G_PAD]
    w_hi = step_hi[:, :, None] * q_hi[None, :, :]
    w16_lo, w16_hi = _fp16(w_lo), _fp16(w_hi)
    # The codes are at most 15: what fp16 (and the clamp) took off the weights, 15 times over, puts
    # the bound back above the exact sum.
    slack = tl.sum(tl.abs(w_lo - w16_lo.to(tl.float32)), 1) + tl.sum(tl.abs(w_hi - w16_hi.to(tl.float32)), 1)
    acc = tl.dot(c_lo, w16_lo)  # [BLOCK_P, PAGE, G_PAD], fp32 accumulation on tensor cores
    acc = tl.dot(c_hi, w16_hi, acc)
    bound = tl.where(seen[:, :, None], (acc + (base + 15.0 * slack)[:, None, :]) * scale, -float("inf"))
    return tl.max(bound, 1)


@triton.jit
def _sum_bound(c, q_group, s_qh, offs_j, lo_ch, hi_ch, mn_lo, step_lo, rad_lo, mn_hi, step_hi, rad_hi, seen, scale,
               out_row, s_oh, offs_e, e_mask, DH: tl.constexpr, G: tl.constexpr, BLOCK_P: tl.constexpr,
               AGG: tl.constexpr):
    """The query heads in turn, products summed in fp32; stores each head's best bounds, or the
    group's max at ``out_row``."""
    c_lo = (c & 15).to(tl.float32)
    c_hi = (c >> 4).to(tl.float32)
    red = tl.full([BLOCK_P], -float("inf"), tl.float32)
    for g in tl.static_range(G):
        q_lo = tl.load(q_group + g * s_qh + offs_j, mask=lo_ch, other=0.0).to(tl.float32)
        q_hi = tl.load(q_group + g * s_qh + DH + offs_j, mask=hi_ch, other=0.0).to(tl.float32)
        base = tl.sum(q_lo[None, :] * mn_lo + tl.abs(q_lo)[None, :] * rad_lo, 1)
        base += tl.sum(q_hi[None, :] * mn_hi + tl.abs(q_hi)[None, :] * rad_hi, 1)  # [BLOCK_P]
        w_lo = q_lo[None, :] * step_lo  # [BLOCK_P, DH_PAD]
        w_hi = q_hi[None, :] * step_hi
        coded = tl.sum(w_lo[:, None, :] * c_lo + w_hi[:, None, :] * c_hi, 2)  # [BLOCK_P, PAGE]
        best = tl.max(tl.where(seen, (base[:, None] + coded) * scale, -float("inf")), 1)  # [BLOCK_P]
        if AGG == 0:
            tl.store(out_row + g * s_oh + offs_e, best, mask=e_mask)
        else:
            red = tl.maximum(red, best)
    if AGG != 0:
        tl.store(out_row + offs_e, red, mask=e_mask)


@triton.jit
def _sketch_bound_kernel(
    q_ptr, code_ptr, mn_ptr, mx_ptr, start_ptr, length_ptr, list_ptr, out_ptr,
    s_qb, s_qh,
    s_cb, s_ch, s_ct,
    s_mb, s_mh, s_mp,
    s_xb, s_xh, s_xp,
    s_lb, s_lh,
    s_ob, s_oh,
    n_pages, n_entries, scale,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, DH: tl.constexpr, DH_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_P: tl.constexpr, AGG: tl.constexpr, DOT: tl.constexpr, KEYS: tl.constexpr,
    LISTED: tl.constexpr,
):
    kv = tl.program_id(1)
    b = tl.program_id(2)
    offs_e, e_mask, offs_p, p_mask = _entries(list_ptr, b, kv, s_lb, s_lh, n_pages, n_entries, BLOCK_P, LISTED)
    offs_t = tl.arange(0, PAGE)
    offs_j = tl.arange(0, DH_PAD)
    lo_ch = offs_j < DH  # channel j: the low nibble
    hi_ch = (offs_j + DH) < D  # channel j + DH: the high nibble (absent for the spare one of an odd D)
    slot = offs_p[:, None] * PAGE + offs_t[None, :]  # [BLOCK_P, PAGE]
    start = tl.load(start_ptr + b)
    length = tl.load(length_ptr)
    seen = p_mask[:, None] & (slot >= start) & (slot < length)
    # Codes [BLOCK_P, PAGE, DH_PAD]: channels j (low nibble) and j + DH (high nibble).
    c = tl.load(code_ptr + b * s_cb + kv * s_ch + slot[:, :, None] * s_ct + offs_j[None, None, :],
                mask=seen[:, :, None] & lo_ch[None, None, :], other=0)

    # The grid per page and channel, as `reference.sketch_grid` computes it.
    pm = p_mask[:, None]
    row_mn = mn_ptr + b * s_mb + kv * s_mh + offs_p[:, None] * s_mp
    row_mx = mx_ptr + b * s_xb + kv * s_xh + offs_p[:, None] * s_xp
    mn_lo, step_lo, rad_lo = page_grid(row_mn + offs_j[None, :], row_mx + offs_j[None, :], pm & lo_ch[None, :])
    mn_hi, step_hi, rad_hi = page_grid(row_mn + DH + offs_j[None, :], row_mx + DH + offs_j[None, :], pm & hi_ch[None, :])

    if KEYS or DOT:
        q_lo, q_hi = _group_queries(q_ptr, b, kv, s_qb, s_qh, offs_j, lo_ch, hi_ch, DH, G, G_PAD)
        if KEYS:
            best = _keys_bound(c, q_lo, q_hi, mn_lo, step_lo, rad_lo, mn_hi, step_hi, rad_hi, seen, scale,
                               BLOCK_P, PAGE, DH_PAD, G_PAD)
        else:
            best = _code_dot_bound(c, q_lo, q_hi, mn_lo, step_lo, rad_lo, mn_hi, step_hi, rad_hi, seen, scale)
        store_best(out_ptr, best, b, kv, s_ob, s_oh, offs_e, e_mask, G, G_PAD, AGG)
    else:
        if AGG == 0:  # the group's first head's row; each head's follows at s_oh
            out_row = out_ptr + b * s_ob + kv * G * s_oh
        else:
            out_row = out_ptr + b * s_ob + kv * s_oh
        _sum_bound(c, q_ptr + b * s_qb + kv * G * s_qh, s_qh, offs_j, lo_ch, hi_ch, mn_lo, step_lo, rad_lo,
                   mn_hi, step_hi, rad_hi, seen, scale, out_row, s_oh, offs_e, e_mask, DH, G, BLOCK_P, AGG)


@triton.jit
def _unit_float(words, K: tl.constexpr):
    """Nibble ``K`` of each 32-bit word (bits ``4K .. 4K+3``) as the fp32 ``1 + c/16``: the nibble moved
    to the top of the mantissa (bits 19-22) under the exponent of 1.0. A shift and a bit operation,
    where an integer-to-float conversion runs at an eighth of the FMA rate."""
    if 4 * K <= 19:
        moved = words << (19 - 4 * K)
    else:
        moved = words >> (4 * K - 19)
    return ((moved & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _sketch_rows_kernel(
    q_ptr, word_ptr, mn_ptr, mx_ptr, start_ptr, length_ptr, list_ptr, out_ptr,
    s_qb, s_qh,
    s_wb, s_wh, s_wt,
    s_mb, s_mh, s_mp,
    s_xb, s_xh, s_xp,
    s_lb, s_lh,
    s_ob, s_oh,
    n_pages, n_entries, scale,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, DH: tl.constexpr,
    WORDS: tl.constexpr, VW: tl.constexpr, PAGE: tl.constexpr, BLOCK_P: tl.constexpr, AGG: tl.constexpr,
    LISTED: tl.constexpr,
):
    """The bound of ``BLOCK_P`` entries, the codes read as 32-bit words, ``VW`` words of a token a step.

    A code byte ``j`` holds channel ``j`` (low nibble) and ``j + DH`` (high nibble), so nibble ``k``
    of word ``u`` is channel ``4u + k // 2 + (k % 2)·DH``. With ``f = 1 + c/16`` (`_unit_float`) and
    ``w = q·step``, ``Σ w·c = Σ 16w·f - 16·Σ w``: the loop sums ``16w·f`` per token, and the second
    term joins the page's own, ``q·min + |q|·radius``, summed once per page on a page-major tile."""
    kv = tl.program_id(1)
    b = tl.program_id(2)
    offs_e, e_mask, offs_p, p_mask = _entries(list_ptr, b, kv, s_lb, s_lh, n_pages, n_entries, BLOCK_P, LISTED)
    start = tl.load(start_ptr + b)
    length = tl.load(length_ptr)
    offs_g = tl.arange(0, G_PAD)

    # The page's own term, per page and query head: q·min + |q|·radius - 16·q·step over every channel.
    offs_d = tl.arange(0, D_PAD)
    grid_mask = p_mask[:, None] & (offs_d[None, :] < D)
    mn, step, rad = page_grid(mn_ptr + b * s_mb + kv * s_mh + offs_p[:, None] * s_mp + offs_d[None, :],
                                 mx_ptr + b * s_xb + kv * s_xh + offs_p[:, None] * s_xp + offs_d[None, :], grid_mask)
    base = tl.zeros([BLOCK_P, G_PAD], tl.float32)
    for g in tl.static_range(G):
        qg = tl.load(q_ptr + b * s_qb + (kv * G + g) * s_qh + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
        own = tl.sum(mn * qg[None, :] + rad * tl.abs(qg)[None, :] - 16.0 * step * qg[None, :], 1)  # [BLOCK_P]
        base = tl.where(offs_g[None, :] == g, own[:, None], base)

    # Tokens x pages x words x heads: a thread holds words of a few tokens of one page.
    t4 = tl.arange(0, PAGE)[:, None, None, None]
    p4 = offs_p[None, :, None, None]
    u4 = tl.arange(0, VW)[None, None, :, None]
    g4 = offs_g[None, None, None, :]
    pm4 = p_mask[None, :, None, None]
    slot4 = p4 * PAGE + t4
    seen4 = pm4 & (slot4 >= start) & (slot4 < length)
    word_row = word_ptr + b * s_wb + kv * s_wh + slot4 * s_wt + u4
    mn_row = mn_ptr + b * s_mb + kv * s_mh + p4 * s_mp
    mx_row = mx_ptr + b * s_xb + kv * s_xh + p4 * s_xp
    q_row = q_ptr + b * s_qb + (kv * G + g4) * s_qh
    g_ok4 = g4 < G
    acc = tl.zeros([PAGE, BLOCK_P, VW, G_PAD], tl.float32)
    for w0 in range(0, WORDS, VW):
        words = tl.load(word_row + w0, mask=seen4, other=0).to(tl.uint32, bitcast=True)
        for k in tl.static_range(8):
            ch = 4 * (w0 + u4) + k // 2 + (k % 2) * DH  # [1, 1, VW, 1]
            ok = ch < D
            lo = tl.load(mn_row + ch, mask=pm4 & ok, other=0.0).to(tl.float32)
            hi = tl.load(mx_row + ch, mask=pm4 & ok, other=0.0).to(tl.float32)
            qk = tl.load(q_row + ch, mask=ok & g_ok4, other=0.0).to(tl.float32)
            acc += _unit_float(words, k) * (qk * ((hi - lo) * (16.0 / 15.0)))
    coded = tl.sum(acc, 2)  # [PAGE, BLOCK_P, G_PAD]
    slot3 = offs_p[None, :, None] * PAGE + tl.arange(0, PAGE)[:, None, None]
    seen3 = p_mask[None, :, None] & (slot3 >= start) & (slot3 < length)
    best = tl.max(tl.where(seen3, (coded + base[None, :, :]) * scale, -float("inf")), 0)  # [BLOCK_P, G_PAD]
    store_best(out_ptr, best, b, kv, s_ob, s_oh, offs_e, e_mask, G, G_PAD, AGG)


def sketch_page_bound(
    q: Tensor, codes: Tensor, page_min: Tensor, page_max: Tensor, start: Tensor, length: Tensor, scale: float,
    agg: str, pages: Tensor | None, cfg,
) -> Tensor:
    """Launch the kernel with ``cfg`` (a `SketchScoreConfig` whose method this page size takes).
    ``agg="none"`` → ``float32[B, H, P]``; ``"max"`` → ``[B, H_kv, P]``.

    With ``pages int[B, H_kv, K]`` only those pages are scored, entry ``e`` of KV head ``h`` being
    page ``pages[b, h, e]`` (``[B, H, K]`` or ``[B, H_kv, K]`` out; an id outside ``[0, P)`` gives
    ``-inf``): a two-level selection reads the codes of its candidates alone."""
    if agg not in ("none", "max"):
        raise ValueError(f"agg must be 'none' or 'max', got {agg!r}")
    route.check_device(q)
    b, h, d = q.shape
    _, h_kv, n_pages, _ = page_min.shape
    page = codes.shape[2] // n_pages
    if page & (page - 1):
        raise ValueError(f"the sketch kernel needs a power-of-two page size, got {page}")
    if pages is not None and (pages.dim() != 3 or tuple(pages.shape[:2]) != (b, h_kv)):
        raise ValueError(f"pages must be [B, H_kv, K] = [{b}, {h_kv}, K], got {tuple(pages.shape)}")
    q, codes, page_min, page_max = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, codes, page_min, page_max))
    n_entries = n_pages if pages is None else pages.shape[-1]
    if pages is not None and pages.stride(-1) != 1:
        pages = pages.contiguous()
    out = _alloc(b, h if agg == "none" else h_kv, n_entries, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    dh = codes.shape[-1]
    g = h // h_kv
    dot, keys = cfg.method == "dot", cfg.method == "keys"
    listed = pages if pages is not None else out  # a placeholder pointer when nothing is listed
    if cfg.method == "half2":
        if not half2.fits(codes, h // h_kv):
            raise ValueError("the half2 method reads whole runs of four aligned 32-bit words a token, for groups of "
                             f"at most {half2.MAX_GROUP} query heads")
        half2.launch(q, codes, page_min, page_max, start, length, listed, out, n_pages, n_entries, scale, agg, pages,
                     cfg)
        return out
    if cfg.method == "rows":
        if not rows_fit(codes):
            raise ValueError("the rows method reads the codes as 32-bit words: rows of whole, aligned words needed")
        _rows(q, codes, page_min, page_max, start, length, listed, out, n_pages, n_entries, scale, agg, pages, cfg)
        return out
    _sketch_bound_kernel[(triton.cdiv(n_entries, cfg.block_p), h_kv, b)](
        q, codes, page_min, page_max, start, length, listed, out,
        q.stride(0), q.stride(1),
        codes.stride(0), codes.stride(1), codes.stride(2),
        page_min.stride(0), page_min.stride(1), page_min.stride(2),
        page_max.stride(0), page_max.stride(1), page_max.stride(2),
        listed.stride(0), listed.stride(1),
        out.stride(0), out.stride(1),
        n_pages, n_entries, float(scale),
        G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d, DH=dh,
        DH_PAD=max(16, triton.next_power_of_2(dh)) if dot or keys else triton.next_power_of_2(dh),
        PAGE=page, BLOCK_P=cfg.block_p, AGG=0 if agg == "none" else 1, DOT=dot, KEYS=keys, LISTED=pages is not None,
        num_warps=cfg.num_warps,
    )
    return out


def _rows(q, codes, page_min, page_max, start, length, listed, out, n_pages, n_entries, scale, agg, pages, cfg) -> None:
    """Launch `_sketch_rows_kernel` on the codes viewed as 32-bit words (`rows_fit` said they can be)."""
    b, h, d = q.shape
    h_kv, dh = page_min.shape[1], codes.shape[-1]
    words = codes.view(torch.int32)
    n_words = dh // 4
    vw = min(cfg.words, n_words & -n_words)  # a power of two dividing the words of a token
    _sketch_rows_kernel[(triton.cdiv(n_entries, cfg.block_p), h_kv, b)](
        q, words, page_min, page_max, start, length, listed, out,
        q.stride(0), q.stride(1),
        words.stride(0), words.stride(1), words.stride(2),
        page_min.stride(0), page_min.stride(1), page_min.stride(2),
        page_max.stride(0), page_max.stride(1), page_max.stride(2),
        listed.stride(0), listed.stride(1),
        out.stride(0), out.stride(1),
        n_pages, n_entries, float(scale),
        G=h // h_kv, G_PAD=triton.next_power_of_2(h // h_kv), D=d, D_PAD=triton.next_power_of_2(d), DH=dh,
        WORDS=n_words, VW=vw, PAGE=codes.shape[2] // n_pages, BLOCK_P=cfg.block_p,
        AGG=0 if agg == "none" else 1, LISTED=pages is not None,
        num_warps=cfg.num_warps,
    )


def rows_fit(codes: Tensor) -> bool:
    """Whether the ``"rows"`` method can read ``codes`` as 32-bit words: whole words per token, and
    every token's row starting on a word."""
    dh = codes.shape[-1]
    return (dh % 4 == 0 and codes.stride(-1) == 1 and codes.data_ptr() % 4 == 0
            and all(st % 4 == 0 for st in codes.stride()[:-1]))

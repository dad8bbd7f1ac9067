"""Quest page bound (Triton): an upper bound of ``scale·q·k`` over the keys of each cache page.

``bound[b, h, p] = scale · Σ_d max(q_d·min_d, q_d·max_d)`` from the per-page, per-channel key minima
and maxima ``[B, H_kv, P, D]`` (specification: `reference.quest_page_bound`), either per query head
``[B, H, P]`` or aggregated over the G query heads of each GQA group ``[B, H_kv, P]`` (max or sum;
`reference.quest_page_bound_grouped`), which is what a KV-head-level page choice needs.

Since ``max_d >= min_d``, the larger product is ``q_d·max_d`` where ``q_d >= 0`` and ``q_d·min_d``
where ``q_d < 0`` (the same float products, so nothing is rounded differently):

    Σ_d max(q_d·min_d, q_d·max_d) = q⁺·max + q⁻·min,   q⁺ = max(q, 0), q⁻ = min(q, 0)

two dot products per page instead of a channel-wise max, computed one of two ways
(`PageScoreConfig.method`): ``"dot"`` does both with ``tl.dot`` (tensor cores; the G heads padded to
16 rows; bf16 q⁺ and q⁻ are exact since q is bf16, fp32 summaries use full-precision dots);
``"loop"`` walks the G query heads of the group over a ``[block_p, D]`` tile held in registers, and
serves the head dims under 16 that tl.dot cannot take. An earlier version broadcast a
``[G, block_p, D]`` product and reduced its max: it held 8K floats per program and took 25 µs at
best on an H200 where the dot takes 9.7 µs (8,192 pages).

Grid ``(cdiv(P, block_p), H_kv, B)``: a program scores ``block_p`` pages of one KV head for all G
query heads of its group, so the summaries (the bytes that matter) are read once per group. Launch
parameters: `config.PageScoreConfig`, chosen per call by `page_score_config`.

The key-sketch page bound (`sketch_page_bound`; specification `reference.sketch_page_bound`) reads the
4-bit codes of every key of ``block_p`` pages and their pages' min/max, and keeps each page's best
token bound ``scale·(q·min + |q|·radius + Σ_i (q_i·step_i)·c_ti)`` over its visible slots, per query
head or folded over the group. The codes are half a byte per key channel, so the kernel streams
about a quarter of the bytes the keys hold. `SketchScoreConfig.method` picks how the products are
summed: ``"sum"`` in fp32 on CUDA cores; ``"dot"``, a batched tl.dot of each page's codes (fp16,
exact) with its weights ``q·step`` in fp16, where 15 times the weights' rounding is added back so
the result stays an upper bound; or ``"keys"``, the sketch's keys ``min + step·c`` decoded in fp16
and one tl.dot of the program's tokens with the group's queries (the query is the same for every
page, so the dot is as wide as the program's tokens), the worst case of both roundings added back
per page. "sum" and "dot" are bound by their arithmetic, not their bytes: on an H200 at 128K "sum"
ran at 0.9 TB/s (`benchmarks/results/2026-12-02-h200-run17/`).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from .config import PageScoreConfig, SketchScoreConfig, current

INTERPRET = bool(triton.knobs.runtime.interpret)  # set when TRITON_INTERPRET=1 (CPU tensors)

AGG_CODES = {"none": 0, "max": 1, "sum": 2}


def _alloc(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every output and scratch buffer comes from here (uninitialised; the tests poison it with NaN)."""
    return torch.empty(*shape, dtype=dtype, device=device)


@triton.jit
def _quest_bound_kernel(
    q_ptr, mn_ptr, mx_ptr, out_ptr,
    s_qb, s_qh,
    s_mb, s_mh, s_mp,
    s_xb, s_xh, s_xp,
    s_ob, s_oh,
    n_pages, scale,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_P: tl.constexpr, AGG: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr,
):
    pid_p = tl.program_id(0)
    kv = tl.program_id(1)
    b = tl.program_id(2)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, D_PAD)
    p_mask = offs_p < n_pages
    pd_mask = p_mask[:, None] & (offs_d < D)[None, :]
    # Padding pages and channels load 0 and add 0.
    mn = tl.load(mn_ptr + b * s_mb + kv * s_mh + offs_p[:, None] * s_mp + offs_d[None, :], mask=pd_mask, other=0.0)
    mx = tl.load(mx_ptr + b * s_xb + kv * s_xh + offs_p[:, None] * s_xp + offs_d[None, :], mask=pd_mask, other=0.0)
    q_group = q_ptr + b * s_qb + kv * G * s_qh

    if DOT:
        offs_g = tl.arange(0, G_PAD)
        g_mask = offs_g < G
        q = tl.load(q_group + offs_g[:, None] * s_qh + offs_d[None, :],
                    mask=g_mask[:, None] & (offs_d < D)[None, :], other=0.0)
        # Signs are split in fp32 (exact), then cast back to the summaries' dtype (exact for a
        # 16-bit q of the same dtype; fp32 otherwise).
        q = q.to(tl.float32)
        q_pos = tl.maximum(q, 0.0)
        q_neg = tl.minimum(q, 0.0)
        if IEEE:  # fp32 somewhere: full-precision dots
            mx, mn = mx.to(tl.float32), mn.to(tl.float32)
            acc = tl.dot(q_pos, tl.trans(mx), input_precision="ieee")
            acc = tl.dot(q_neg, tl.trans(mn), acc, input_precision="ieee")
        else:  # q and the summaries share a 16-bit dtype: its products are exact in the fp32 accumulator
            acc = tl.dot(q_pos.to(mx.dtype), tl.trans(mx))
            acc = tl.dot(q_neg.to(mn.dtype), tl.trans(mn), acc)
        acc = acc * scale  # [G_PAD, BLOCK_P]
        if AGG == 0:  # per query head: out [B, H, P]
            out_rows = out_ptr + b * s_ob + (kv * G + offs_g) * s_oh
            tl.store(out_rows[:, None] + offs_p[None, :], acc, mask=g_mask[:, None] & p_mask[None, :])
        else:  # per KV head: out [B, H_kv, P]
            if AGG == 1:
                red = tl.max(tl.where(g_mask[:, None], acc, -float("inf")), 0)
            else:
                red = tl.sum(acc, 0)  # padding heads are exactly 0
            tl.store(out_ptr + b * s_ob + kv * s_oh + offs_p, red, mask=p_mask)
    else:
        mn = mn.to(tl.float32)
        mx = mx.to(tl.float32)
        red = tl.zeros([BLOCK_P], tl.float32)
        if AGG == 1:
            red = red - float("inf")
        for g in tl.static_range(G):
            q = tl.load(q_group + g * s_qh + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
            bound = tl.sum(tl.where(q[None, :] >= 0.0, q[None, :] * mx, q[None, :] * mn), 1) * scale
            if AGG == 0:
                tl.store(out_ptr + b * s_ob + (kv * G + g) * s_oh + offs_p, bound, mask=p_mask)
            elif AGG == 1:
                red = tl.maximum(red, bound)
            else:
                red += bound
        if AGG != 0:
            tl.store(out_ptr + b * s_ob + kv * s_oh + offs_p, red, mask=p_mask)


def page_score_config(d: int) -> PageScoreConfig:
    """The launch parameters of a call with head dim ``d``: the config in force (`config.current`),
    with the loop where tl.dot cannot serve (it needs 16 rows, columns and inner size: head dims
    under 16) and tiles of 16 pages at least for the dot."""
    return _choose(current(PageScoreConfig), d)


@functools.lru_cache(maxsize=1024)  # a launch's Python time: the same few shapes at every decode step
def _choose(cfg: PageScoreConfig, d: int) -> PageScoreConfig:
    if cfg.method == "dot" and triton.next_power_of_2(d) >= 16:
        return dataclasses.replace(cfg, block_p=max(16, cfg.block_p))
    return dataclasses.replace(cfg, method="loop")


def quest_page_bound(q: Tensor, page_min: Tensor, page_max: Tensor, scale: float, agg: str = "none") -> Tensor:
    """Launch the kernel. ``agg="none"`` → ``float32[B, H, P]``; ``"max"``/``"sum"`` → ``[B, H_kv, P]``."""
    if agg not in AGG_CODES:
        raise ValueError(f"agg must be one of {sorted(AGG_CODES)}, got {agg!r}")
    if q.device.type == "cpu" and not INTERPRET:
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is first imported")
    b, h, d = q.shape
    _, h_kv, n_pages, _ = page_min.shape
    g = h // h_kv
    # The kernels index the head dim with unit stride.
    q, page_min, page_max = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, page_min, page_max))
    out = _alloc(b, h if agg == "none" else h_kv, n_pages, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    cfg = page_score_config(d)
    grid = (triton.cdiv(n_pages, cfg.block_p), h_kv, b)
    _quest_bound_kernel[grid](
        q, page_min, page_max, out,
        q.stride(0), q.stride(1),
        page_min.stride(0), page_min.stride(1), page_min.stride(2),
        page_max.stride(0), page_max.stride(1), page_max.stride(2),
        out.stride(0), out.stride(1),
        n_pages, float(scale),
        G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d, D_PAD=triton.next_power_of_2(d),
        BLOCK_P=cfg.block_p, AGG=AGG_CODES[agg], DOT=cfg.method == "dot",
        # fp32 dots where a dtype is fp32 or differs, and under the interpreter, whose tl.dot multiplies
        # bf16 operands as raw bits (see decode_attention.INTERPRET); bf16 products are exact in fp32.
        IEEE=INTERPRET or q.dtype != page_min.dtype or page_min.dtype == torch.float32, num_warps=cfg.num_warps,
    )
    return out


@triton.jit
def _sketch_grid(mn_ptrs, mx_ptrs, mask):
    """``(low, step, radius)`` fp32 tiles of the pages' grids, as `reference.sketch_grid` computes them."""
    mn = tl.load(mn_ptrs, mask=mask, other=0.0).to(tl.float32)
    mx = tl.load(mx_ptrs, mask=mask, other=0.0).to(tl.float32)
    step = (mx - mn) / 15.0
    radius = step * (0.5 + 1.0 / 4096) + (1.0 / 1048576) * tl.maximum(tl.abs(mn), tl.abs(mx))
    return mn, step, radius


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
    # Output entries of this program; with LISTED, entry e scores page list[b, kv, e], else page e.
    offs_e = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    e_mask = offs_e < n_entries
    if LISTED:
        offs_p = tl.load(list_ptr + b * s_lb + kv * s_lh + offs_e, mask=e_mask, other=0).to(tl.int32)
        p_mask = e_mask & (offs_p >= 0) & (offs_p < n_pages)
    else:
        offs_p = offs_e
        p_mask = e_mask
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
    mn_lo, step_lo, rad_lo = _sketch_grid(row_mn + offs_j[None, :], row_mx + offs_j[None, :], pm & lo_ch[None, :])
    mn_hi, step_hi, rad_hi = _sketch_grid(row_mn + DH + offs_j[None, :], row_mx + DH + offs_j[None, :], pm & hi_ch[None, :])

    if KEYS:
        # The sketch's keys k̂ = low + step·c decoded in fp16, against the group's queries in fp16: one
        # [BLOCK_P·PAGE, DH_PAD] × [DH_PAD, G_PAD] dot per half, the query shared by every token.
        offs_g = tl.arange(0, G_PAD)
        q_cols = q_ptr + b * s_qb + (kv * G + offs_g[None, :]) * s_qh
        g_ok = offs_g[None, :] < G
        q_lo = tl.load(q_cols + offs_j[:, None], mask=lo_ch[:, None] & g_ok, other=0.0).to(tl.float32)
        q_hi = tl.load(q_cols + DH + offs_j[:, None], mask=hi_ch[:, None] & g_ok, other=0.0).to(tl.float32)
        q16_lo = tl.minimum(tl.maximum(q_lo, -60000.0), 60000.0).to(tl.float16)
        q16_hi = tl.minimum(tl.maximum(q_hi, -60000.0), 60000.0).to(tl.float16)
        k_lo = mn_lo[:, None, :] + step_lo[:, None, :] * (c & 15).to(tl.float32)  # [BLOCK_P, PAGE, DH_PAD]
        k_hi = mn_hi[:, None, :] + step_hi[:, None, :] * (c >> 4).to(tl.float32)
        k16_lo = tl.minimum(tl.maximum(k_lo, -60000.0), 60000.0).to(tl.float16)
        k16_hi = tl.minimum(tl.maximum(k_hi, -60000.0), 60000.0).to(tl.float16)
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
        best = tl.max(bound, 1)  # [BLOCK_P, G_PAD]
        if AGG == 0:
            out = out_ptr + b * s_ob + (kv * G + offs_g[None, :]) * s_oh + offs_e[:, None]
            tl.store(out, best, mask=e_mask[:, None] & g_ok)
        else:
            red = tl.max(tl.where(g_ok, best, -float("inf")), 1)
            tl.store(out_ptr + b * s_ob + kv * s_oh + offs_e, red, mask=e_mask)
    elif DOT:
        c_lo = (c & 15).to(tl.float16)  # 0..15: exact
        c_hi = (c >> 4).to(tl.float16)
        # The group's queries as [DH_PAD, G_PAD] columns.
        offs_g = tl.arange(0, G_PAD)
        q_cols = q_ptr + b * s_qb + (kv * G + offs_g[None, :]) * s_qh
        g_ok = offs_g[None, :] < G
        q_lo = tl.load(q_cols + offs_j[:, None], mask=lo_ch[:, None] & g_ok, other=0.0).to(tl.float32)
        q_hi = tl.load(q_cols + DH + offs_j[:, None], mask=hi_ch[:, None] & g_ok, other=0.0).to(tl.float32)
        # Per page: base = q·min + |q|·radius, and the weights W = q·step, [BLOCK_P, DH_PAD, G_PAD].
        base = tl.sum(mn_lo[:, :, None] * q_lo[None, :, :] + rad_lo[:, :, None] * tl.abs(q_lo)[None, :, :], 1)
        base += tl.sum(mn_hi[:, :, None] * q_hi[None, :, :] + rad_hi[:, :, None] * tl.abs(q_hi)[None, :, :], 1)
        w_lo = step_lo[:, :, None] * q_lo[None, :, :]
        w_hi = step_hi[:, :, None] * q_hi[None, :, :]
        w16_lo = tl.minimum(tl.maximum(w_lo, -60000.0), 60000.0).to(tl.float16)
        w16_hi = tl.minimum(tl.maximum(w_hi, -60000.0), 60000.0).to(tl.float16)
        # The codes are at most 15: what fp16 (and the clamp) took off the weights, 15 times over, puts
        # the bound back above the exact sum.
        slack = tl.sum(tl.abs(w_lo - w16_lo.to(tl.float32)), 1) + tl.sum(tl.abs(w_hi - w16_hi.to(tl.float32)), 1)
        acc = tl.dot(c_lo, w16_lo)  # [BLOCK_P, PAGE, G_PAD], fp32 accumulation on tensor cores
        acc = tl.dot(c_hi, w16_hi, acc)
        bound = tl.where(seen[:, :, None], (acc + (base + 15.0 * slack)[:, None, :]) * scale, -float("inf"))
        best = tl.max(bound, 1)  # [BLOCK_P, G_PAD]
        if AGG == 0:
            out = out_ptr + b * s_ob + (kv * G + offs_g[None, :]) * s_oh + offs_e[:, None]
            tl.store(out, best, mask=e_mask[:, None] & g_ok)
        else:
            red = tl.max(tl.where(g_ok, best, -float("inf")), 1)
            tl.store(out_ptr + b * s_ob + kv * s_oh + offs_e, red, mask=e_mask)
    else:
        c_lo = (c & 15).to(tl.float32)
        c_hi = (c >> 4).to(tl.float32)
        q_group = q_ptr + b * s_qb + kv * G * s_qh
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
                tl.store(out_ptr + b * s_ob + (kv * G + g) * s_oh + offs_e, best, mask=e_mask)
            else:
                red = tl.maximum(red, best)
        if AGG != 0:
            tl.store(out_ptr + b * s_ob + kv * s_oh + offs_e, red, mask=e_mask)


def sketch_page_bound(
    q: Tensor, codes: Tensor, page_min: Tensor, page_max: Tensor, start: Tensor, length: Tensor, scale: float,
    agg: str = "none", pages: Tensor | None = None,
) -> Tensor:
    """Launch the key-sketch kernel. ``agg="none"`` → ``float32[B, H, P]``; ``"max"`` → ``[B, H_kv, P]``.

    With ``pages int[B, H_kv, K]`` only those pages are scored, entry ``e`` of KV head ``h`` being
    page ``pages[b, h, e]`` (``[B, H, K]`` or ``[B, H_kv, K]`` out; an id outside ``[0, P)`` gives
    ``-inf``): a two-level selection reads the codes of its candidates alone."""
    if agg not in ("none", "max"):
        raise ValueError(f"agg must be 'none' or 'max', got {agg!r}")
    if q.device.type == "cpu" and not INTERPRET:
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is first imported")
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
    cfg = current(SketchScoreConfig)
    dh = codes.shape[-1]
    grid = (triton.cdiv(n_entries, cfg.block_p), h_kv, b)
    g = h // h_kv
    dot = cfg.method == "dot" and page >= 16  # tl.dot takes 16 token rows at least
    keys = cfg.method == "keys" and page * cfg.block_p >= 16
    listed = pages if pages is not None else out  # a placeholder pointer when nothing is listed
    _sketch_bound_kernel[grid](
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


__all__ = ["quest_page_bound", "sketch_page_bound", "page_score_config", "INTERPRET"]

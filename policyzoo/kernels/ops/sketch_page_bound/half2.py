"""The key-sketch page bound with the products in packed fp16 pairs (Triton, method ``"half2"``);
specification `reference.sketch_page_bound`, beside this file.

Why: the fp32 methods spend most of their instructions turning nibbles into floats and on one FMA
per code and query head, and recompute each page's weights ``q·step`` for the few tokens a thread
holds. Here:

- a thread holds one page's tokens and a fixed run of four 32-bit code words (32 channels), so it
  computes its channels' weights once for the page's tokens;
- a word's eight nibbles become four exact fp16 pairs in one shift, four bit operations and four
  packed subtractions (``w & 0x000F000F | 0x64006400`` is the pair ``1024 + c``, with the mask
  ``0x00F000F0`` the pair ``1024 + 16c``, whose weights are then taken over 16);
- each query head's products are packed fp16 fmas (HFMA2: two products an instruction), chained
  over two words (eight products a lane) and then added in fp32.

A pair ``s`` of word ``u`` holds nibble ``s`` (low half) and nibble ``s + 4`` (high half): channels
``4u + s//2 + (s%2)·DH`` and that plus 2 (pairs 1 and 3 hold 16 times their codes).

The bound stays an upper bound: per page and query head the weights are scaled by a power of two
``σ`` so that the largest is in ``[256, 512)``: a chain of eight products of codes up to 15 then
stays within ``8·15·512 = 61,440``, below fp16's largest finite 65,504 (with ``[512, 1024)``, a
token at the top of its page's grid in every channel overflowed to ``inf``). What fp16 can take off
the exact sum is added back to the page's own term (`reference.half2_slack`). A page's bound lies
between the reference's and the reference's plus twice that slack, which is about 13% of the
sketch's own radius term ``Σ|q|·radius`` at head dim 128.

Emulation: Triton's interpreter does not run inline PTX, so with ``EMULATE`` a pair is its two
halves' values in fp32, joined along a last axis of 2, and each fp16 rounding is an fp32 operation
rounded to fp16 (within the slack's margin of the hardware's single rounding).

Grid ``(cdiv(entries, block_p), H_kv, B)``, one warp a program (`fits`): columns are (page, run of
four words), ``block_p·WORDS/4`` of them, one a thread, which reads its page's tokens one at a time.
Every tensor is one-dimensional over the columns (``[NC, 4]`` for a token's words, ``[BLOCK_P]`` once
a page's columns are summed), and each query head has tensors of its own: with a head or token axis,
the layout would be Triton's choice, and Triton 3.6 spreads heads and tokens across the threads,
which doubles the instructions and spills.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import route
from . import reference
from .shared import page_grid, store_best

# The largest query group whose weights a thread keeps in registers (four words' worth a head).
MAX_GROUP = 4


@triton.jit
def _code_pairs(words, EMULATE: tl.constexpr):
    """Each word's eight nibbles as four fp16 pairs (uint32), exact: pair ``s`` holds nibble ``s`` in
    its low half and nibble ``s + 4`` in its high half, pairs 1 and 3 times 16 (`_pack_word` divides
    their weights by 16). ``(x & 0x000F000F) | 0x64006400`` is the pair ``1024 + c``, and with the
    mask ``0x00F000F0`` it is ``1024 + 16c``: two pairs a shift. Emulated, a pair is its two halves'
    values in fp32, joined (``[NC, 2]``; exact)."""
    if EMULATE:
        return (tl.join((words & 15).to(tl.float32), ((words >> 16) & 15).to(tl.float32)),
                tl.join((words & 0xF0).to(tl.float32), ((words >> 16) & 0xF0).to(tl.float32)),
                tl.join(((words >> 8) & 15).to(tl.float32), ((words >> 24) & 15).to(tl.float32)),
                tl.join(((words >> 8) & 0xF0).to(tl.float32), ((words >> 24) & 0xF0).to(tl.float32)))
    else:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t, m, n, k;
            mov.b32 m, 0x000F000F;
            mov.b32 n, 0x00F000F0;
            mov.b32 k, 0x64006400;
            lop3.b32 $0, $4, m, k, 0xEA;
            sub.f16x2 $0, $0, k;
            lop3.b32 $1, $4, n, k, 0xEA;
            sub.f16x2 $1, $1, k;
            shr.u32 t, $4, 8;
            lop3.b32 $2, t, m, k, 0xEA;
            sub.f16x2 $2, $2, k;
            lop3.b32 $3, t, n, k, 0xEA;
            sub.f16x2 $3, $3, k;
            }""",
            constraints="=r,=r,=r,=r,r", args=[words], dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
            is_pure=True, pack=1)


@triton.jit
def _pack(w_lo, w_hi, EMULATE: tl.constexpr):
    """Two fp32 weights as one fp16 pair (uint32), ``w_lo`` in the low half, each rounded to nearest
    (emulated: the two rounded values in fp32, joined)."""
    if EMULATE:
        return tl.join(w_lo, w_hi).to(tl.float16).to(tl.float32)
    else:  # cvt.f16x2.f32 d, a, b puts a in the high half
        return tl.inline_asm_elementwise(asm="cvt.rn.f16x2.f32 $0, $2, $1;", constraints="=r,f,f",
                                         args=[w_lo, w_hi], dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def _chain(c, w, EMULATE: tl.constexpr):
    """``Σ c_s·w_s`` over the eight fp16 pairs of the tuples ``c`` and ``w`` (two words): each half a
    chain of eight fp16 fmas, the two halves then added in fp32."""
    if EMULATE:  # each fp16 fma as an fp32 one rounded to fp16, both halves at once
        h = (c[0] * w[0]).to(tl.float16).to(tl.float32)
        for s in tl.static_range(1, 8):
            h = (c[s] * w[s] + h).to(tl.float16).to(tl.float32)
        lo, hi = tl.split(h)
        return lo + hi
    else:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 h;
            .reg .f16 l, u;
            .reg .f32 a, b;
            mul.rn.f16x2 h, $1, $9;
            fma.rn.f16x2 h, $2, $10, h;
            fma.rn.f16x2 h, $3, $11, h;
            fma.rn.f16x2 h, $4, $12, h;
            fma.rn.f16x2 h, $5, $13, h;
            fma.rn.f16x2 h, $6, $14, h;
            fma.rn.f16x2 h, $7, $15, h;
            fma.rn.f16x2 h, $8, $16, h;
            mov.b32 {l, u}, h;
            cvt.f32.f16 a, l;
            cvt.f32.f16 b, u;
            add.f32 $0, a, b;
            }""",
            constraints="=f" + ",r" * 16,
            args=[c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]],
            dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _word_channels(word_ch, DH: tl.constexpr):
    """The channels of the eight weights, in pair order, of the word whose first byte is ``word_ch``:
    nibble ``n`` of a word is byte ``n // 2``'s low half (channel = byte) or high half (byte + DH),
    and pair ``p`` holds nibbles ``p`` and ``p + 4`` (`_code_pairs`)."""
    return (word_ch, word_ch + 2, word_ch + DH, word_ch + 2 + DH,
            word_ch + 1, word_ch + 3, word_ch + 1 + DH, word_ch + 3 + DH)


@triton.jit
def _word_grid(mn_row, mx_row, ch, pm, D: tl.constexpr):
    """The grids ``(low, step, radius)`` of a word's eight channels ``ch``: ``[NC]`` each."""
    return (page_grid(mn_row + ch[0], mx_row + ch[0], pm & (ch[0] < D)),
            page_grid(mn_row + ch[1], mx_row + ch[1], pm & (ch[1] < D)),
            page_grid(mn_row + ch[2], mx_row + ch[2], pm & (ch[2] < D)),
            page_grid(mn_row + ch[3], mx_row + ch[3], pm & (ch[3] < D)),
            page_grid(mn_row + ch[4], mx_row + ch[4], pm & (ch[4] < D)),
            page_grid(mn_row + ch[5], mx_row + ch[5], pm & (ch[5] < D)),
            page_grid(mn_row + ch[6], mx_row + ch[6], pm & (ch[6] < D)),
            page_grid(mn_row + ch[7], mx_row + ch[7], pm & (ch[7] < D)))


@triton.jit
def _weight(q_row, c, grid, slack_k, D: tl.constexpr):
    """Channel ``c``'s weight ``q·step`` for one query head, and its part of the page's own term,
    ``q·low + |q|·radius`` plus its share of the slack, ``15·slack_k·|q|·step``."""
    q = tl.load(q_row + c, mask=c < D, other=0.0).to(tl.float32)
    return q * grid[1], q * grid[0] + tl.abs(q) * (grid[2] + (15.0 * slack_k) * grid[1])


@triton.jit
def _word_weights(q_row, ch, grid, slack_k, D: tl.constexpr):
    """A word's eight weights in pair order (pair ``s`` = weights ``2s``, ``2s + 1``; channels ``ch``)
    for one query head, and their part of the page's own term."""
    w0, o0 = _weight(q_row, ch[0], grid[0], slack_k, D)
    w1, o1 = _weight(q_row, ch[1], grid[1], slack_k, D)
    w2, o2 = _weight(q_row, ch[2], grid[2], slack_k, D)
    w3, o3 = _weight(q_row, ch[3], grid[3], slack_k, D)
    w4, o4 = _weight(q_row, ch[4], grid[4], slack_k, D)
    w5, o5 = _weight(q_row, ch[5], grid[5], slack_k, D)
    w6, o6 = _weight(q_row, ch[6], grid[6], slack_k, D)
    w7, o7 = _weight(q_row, ch[7], grid[7], slack_k, D)
    return (w0, w1, w2, w3, w4, w5, w6, w7), ((o0 + o1) + (o2 + o3)) + ((o4 + o5) + (o6 + o7))


@triton.jit
def _abs_max(w):
    return tl.maximum(tl.maximum(tl.maximum(tl.abs(w[0]), tl.abs(w[1])), tl.maximum(tl.abs(w[2]), tl.abs(w[3]))),
                      tl.maximum(tl.maximum(tl.abs(w[4]), tl.abs(w[5])), tl.maximum(tl.abs(w[6]), tl.abs(w[7]))))


@triton.jit
def _pack_word(w, sig, EMULATE: tl.constexpr):
    """A word's eight weights times ``σ`` as four fp16 pairs (pair ``s``: weights ``2s``, ``2s + 1``),
    those of pairs 1 and 3 over 16 more, for codes held times 16 (`_code_pairs`)."""
    sig16 = sig * 0.0625
    return (_pack(w[0] * sig, w[1] * sig, EMULATE), _pack(w[2] * sig16, w[3] * sig16, EMULATE),
            _pack(w[4] * sig, w[5] * sig, EMULATE), _pack(w[6] * sig16, w[7] * sig16, EMULATE))


@triton.jit
def _page_max(x, BLOCK_P: tl.constexpr, CG: tl.constexpr):
    """``[NC]`` → the max over each page's ``CG`` columns, back on every column of the page."""
    r = tl.max(tl.reshape(x, (BLOCK_P, CG)), 1)
    return tl.reshape(tl.broadcast_to(r[:, None], (BLOCK_P, CG)), (BLOCK_P * CG,))


@triton.jit
def _head(q_row, chans, grids, slack_k, BLOCK_P: tl.constexpr, CG: tl.constexpr, D: tl.constexpr,
          EMULATE: tl.constexpr):
    """One query head's packed weights of the column's four words (``((4 pairs) × 4)``), ``1/σ`` and
    the column's part of the page's own term (its share of the slack and the bound of the fp16
    roundings below fp16's normal range included), ``[NC]`` each."""
    wa, oa = _word_weights(q_row, chans[0], grids[0], slack_k, D)
    wb, ob = _word_weights(q_row, chans[1], grids[1], slack_k, D)
    wc, oc = _word_weights(q_row, chans[2], grids[2], slack_k, D)
    wd, od = _word_weights(q_row, chans[3], grids[3], slack_k, D)
    # σ = 2^(8 - e) per page for the page's largest |weight| in [2^e, 2^(e+1)); e is clamped so that
    # both 2^(8 - e) and 2^(e - 8) are normal fp32 numbers (exact inverses).
    top = _page_max(tl.maximum(tl.maximum(_abs_max(wa), _abs_max(wb)), tl.maximum(_abs_max(wc), _abs_max(wd))),
                    BLOCK_P, CG)
    e = tl.minimum(tl.maximum(((top.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -117), 127)
    sig = ((135 - e) << 23).to(tl.float32, bitcast=True)
    inv_sig = ((e + 119) << 23).to(tl.float32, bitcast=True)
    own = ((oa + ob) + (oc + od)) + (32.0 / 65536) * inv_sig
    packed = (_pack_word(wa, sig, EMULATE), _pack_word(wb, sig, EMULATE), _pack_word(wc, sig, EMULATE),
              _pack_word(wd, sig, EMULATE))
    return packed, inv_sig, own


@triton.jit
def _head_best(codes, head, best, seen, BLOCK_P: tl.constexpr, CG: tl.constexpr, EMULATE: tl.constexpr):
    """``best [BLOCK_P]`` raised by one token's bound for one query head: the column's products of
    its four words' ``codes`` (pairs) with the head's weights, the page's columns summed."""
    packed, inv_sig, own = head
    coded = (_chain(codes[0] + codes[1], packed[0] + packed[1], EMULATE)
             + _chain(codes[2] + codes[3], packed[2] + packed[3], EMULATE))
    total = tl.sum(tl.reshape(coded * inv_sig + own, (BLOCK_P, CG)), 1)
    return tl.maximum(best, tl.where(seen, total, -float("inf")))


@triton.jit
def _pages(list_row, entries, n_pages, n_entries, LISTED: tl.constexpr):
    """``(page, live)`` of each entry: with LISTED the page its row's list names (live inside
    ``[0, n_pages)``), else the entry itself (live below ``n_entries``)."""
    if LISTED:
        page = tl.load(list_row + entries, mask=entries < n_entries, other=-1).to(tl.int32)
        return page, (entries < n_entries) & (page >= 0) & (page < n_pages)
    else:
        return entries, entries < n_entries


@triton.jit
def _sketch_half2_kernel(
    q_ptr, word_ptr, mn_ptr, mx_ptr, start_ptr, length_ptr, list_ptr, out_ptr,
    s_qb, s_qh,
    s_wb, s_wh, s_wt,
    s_mb, s_mh, s_mp,
    s_xb, s_xh, s_xp,
    s_lb, s_lh,
    s_ob, s_oh,
    n_pages, n_entries, scale, slack_k,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, DH: tl.constexpr, WORDS: tl.constexpr,
    PAGE: tl.constexpr, TOKEN_STEP: tl.constexpr, BLOCK_P: tl.constexpr, AGG: tl.constexpr, LISTED: tl.constexpr,
    EMULATE: tl.constexpr,
):
    kv = tl.program_id(1)
    b = tl.program_id(2)
    start = tl.load(start_ptr + b)
    length = tl.load(length_ptr)
    # Columns (page, run of four words), one a thread. Every tensor is [NC] (or [NC, 4] words, and
    # [BLOCK_P] pages after a page's columns are summed), and each query head has its own: no tensor
    # has a head axis, so no Triton version can lay heads or tokens across the threads.
    CG: tl.constexpr = WORDS // 4
    NC: tl.constexpr = BLOCK_P * CG
    col = tl.arange(0, NC)
    list_row = list_ptr + b * s_lb + kv * s_lh
    p_col, pm_col = _pages(list_row, tl.program_id(0) * BLOCK_P + col // CG, n_pages, n_entries, LISTED)
    first = (col % CG) * 4  # the column's first word
    word_ch = first * 4  # its first byte: the channel of its first low nibble
    mn_row = mn_ptr + b * s_mb + kv * s_mh + p_col * s_mp
    mx_row = mx_ptr + b * s_xb + kv * s_xh + p_col * s_xp
    chans = (_word_channels(word_ch, DH), _word_channels(word_ch + 4, DH), _word_channels(word_ch + 8, DH),
             _word_channels(word_ch + 12, DH))
    grids = (_word_grid(mn_row, mx_row, chans[0], pm_col, D), _word_grid(mn_row, mx_row, chans[1], pm_col, D),
             _word_grid(mn_row, mx_row, chans[2], pm_col, D), _word_grid(mn_row, mx_row, chans[3], pm_col, D))
    q_row = q_ptr + b * s_qb + kv * G * s_qh
    h0 = _head(q_row, chans, grids, slack_k, BLOCK_P, CG, D, EMULATE)
    if G > 1:
        h1 = _head(q_row + s_qh, chans, grids, slack_k, BLOCK_P, CG, D, EMULATE)
    if G > 2:
        h2 = _head(q_row + 2 * s_qh, chans, grids, slack_k, BLOCK_P, CG, D, EMULATE)
    if G > 3:
        h3 = _head(q_row + 3 * s_qh, chans, grids, slack_k, BLOCK_P, CG, D, EMULATE)

    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_row, pm_row = _pages(list_row, offs_p, n_pages, n_entries, LISTED)
    word_col = word_ptr + b * s_wb + kv * s_wh + first[:, None] + tl.arange(0, 4)[None, :]
    b0 = tl.full([BLOCK_P], -float("inf"), tl.float32)
    b1 = b0
    b2 = b0
    b3 = b0
    # The page's tokens in steps of TOKEN_STEP, unrolled within a step (a one-step loop folds away).
    for t0 in range(0, PAGE, TOKEN_STEP):
        for dt in tl.static_range(TOKEN_STEP):
            t = t0 + dt
            slot = p_col * PAGE + t
            words = tl.load(word_col + slot[:, None] * s_wt, mask=(pm_col & (slot >= start) & (slot < length))[:, None],
                            other=0).to(tl.uint32, bitcast=True)
            w02, w13 = tl.split(tl.reshape(words, (NC, 2, 2)))  # words 0, 2 and 1, 3 of the run
            k0, k2 = tl.split(w02)
            k1, k3 = tl.split(w13)
            codes = (_code_pairs(k0, EMULATE), _code_pairs(k1, EMULATE), _code_pairs(k2, EMULATE), _code_pairs(k3, EMULATE))
            slot_p = p_row * PAGE + t
            seen = pm_row & (slot_p >= start) & (slot_p < length)
            b0 = _head_best(codes, h0, b0, seen, BLOCK_P, CG, EMULATE)
            if G > 1:
                b1 = _head_best(codes, h1, b1, seen, BLOCK_P, CG, EMULATE)
            if G > 2:
                b2 = _head_best(codes, h2, b2, seen, BLOCK_P, CG, EMULATE)
            if G > 3:
                b3 = _head_best(codes, h3, b3, seen, BLOCK_P, CG, EMULATE)

    g = tl.arange(0, G_PAD)[None, :]
    best = tl.where(g == 0, b0[:, None], tl.where(g == 1, b1[:, None], tl.where(g == 2, b2[:, None], b3[:, None])))
    store_best(out_ptr, best * scale, b, kv, s_ob, s_oh, offs_p, offs_p < n_entries, G, G_PAD, AGG)


def fits(codes: Tensor, group: int) -> bool:
    """Whether the half2 method takes ``codes`` with query groups of ``group``: whole runs of four
    aligned 32-bit words a token, a power-of-two number of runs, at most `MAX_GROUP` query heads a
    group (their weights stay in a thread's registers)."""
    dh = codes.shape[-1]
    runs = dh // 16
    return (dh % 16 == 0 and runs & (runs - 1) == 0 and group <= MAX_GROUP and codes.stride(-1) == 1
            and codes.data_ptr() % 16 == 0 and all(st % 16 == 0 for st in codes.stride()[:-1]))


def launch(q, codes, page_min, page_max, start, length, listed, out, n_pages, n_entries, scale, agg, pages, cfg) -> None:
    """Launch `_sketch_half2_kernel` on codes that `fits` takes, ``block_p`` pages a program (capped so
    that a program's columns fit one warp: ``block_p·WORDS/4 <= 32·num_warps``)."""
    if not scale > 0:
        raise ValueError(f"the half2 method takes the best token before the scale: it needs a scale > 0, got {scale}")
    b, h, d = q.shape
    h_kv = page_min.shape[1]
    words = codes.view(torch.int32)
    n_words = codes.shape[-1] // 4
    page = codes.shape[2] // n_pages
    block_p = max(1, min(cfg.block_p, 32 * cfg.num_warps // (n_words // 4)))
    _sketch_half2_kernel[(triton.cdiv(n_entries, block_p), h_kv, b)](
        q, words, page_min, page_max, start, length, listed, out,
        q.stride(0), q.stride(1),
        words.stride(0), words.stride(1), words.stride(2),
        page_min.stride(0), page_min.stride(1), page_min.stride(2),
        page_max.stride(0), page_max.stride(1), page_max.stride(2),
        listed.stride(0), listed.stride(1),
        out.stride(0), out.stride(1),
        n_pages, n_entries, float(scale), reference.half2_slack_factor(d),
        G=h // h_kv, G_PAD=triton.next_power_of_2(h // h_kv), D=d, DH=codes.shape[-1], WORDS=n_words, PAGE=page,
        TOKEN_STEP=min(cfg.token_step, page),
        BLOCK_P=block_p, AGG=0 if agg == "none" else 1, LISTED=pages is not None,
        EMULATE=route.INTERPRET, num_warps=cfg.num_warps, **({"maxnreg": cfg.max_registers} if cfg.max_registers else {}),
    )

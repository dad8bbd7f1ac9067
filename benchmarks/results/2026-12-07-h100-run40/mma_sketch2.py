"""Run 40 (offline, compile only): `mma_sketch.py` with its setup trimmed as the README proposes, to
count the instructions. **Not checked on a GPU, and not correct as it stands** (fragment layouts as
read in the PTX ISA; the own term's rounding not bounded; bf16 summaries and queries, head dim 128,
groups of 4, every page listed only). Changes from `mma_sketch.py`:

- q is loaded once a program, as raw bf16 pairs, and kept in registers (fp32, over 15);
- the summaries are loaded as raw bf16 pairs (32-bit words, 16-byte loads);
- one σ a page from ``max|q| · max step``, a bound of the largest weight;
- the page's own term ``q·min + κ·|q|·(max − min) + 2^-20·|q|·(|min| + |max|)`` comes from bf16
  MMAs: A's rows are ``min``, ``max``, ``|min|`` and ``|max|`` of pages ``a`` and ``b`` (the raw
  words, chosen by bit masks), B's columns ``q_h`` and ``|q_h|``: the products are exact, the sums
  fp32.

    TRITON_DEFAULT_FP_FUSION=1 PYTHONPATH=/tmp/t36:$PWD python benchmarks/results/2026-12-07-h100-run40/mma_sketch2.py
"""
import pathlib
import sys

import triton
import triton.language as tl

from policyzoo.kernels.ops.sketch_page_bound.half2 import _pack

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from mma_sketch import _pair_bound, count  # noqa: E402


@triton.jit
def _mma_bf16(a0, a2, b0, b1):
    """``D = A·B`` of one m16n8k16 bf16 MMA with fp32 sums whose A rows 8-15 are zero: per lane, A's
    row-g pair registers, B's two; D's first two floats (row g)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 z;
        .reg .f32 d2, d3, c;
        mov.b32 z, 0;
        mov.f32 c, 0f00000000;
        mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0,$1,d2,d3}, {$2,z,$3,z}, {$4,$5}, {c,c,c,c};
        }""",
        constraints="=f,=f,r,r,r,r", args=[a0, a2, b0, b1], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _eight(x):
    """``[32, 8]`` → its 8 columns, in order."""
    e, o = tl.split(tl.reshape(x, (32, 4, 2)))  # columns 0 2 4 6 / 1 3 5 7
    e0, e1 = tl.split(tl.reshape(e, (32, 2, 2)))  # 0 4 / 2 6
    o0, o1 = tl.split(tl.reshape(o, (32, 2, 2)))  # 1 5 / 3 7
    c0, c4 = tl.split(e0)
    c2, c6 = tl.split(e1)
    c1, c5 = tl.split(o0)
    c3, c7 = tl.split(o1)
    return (c0, c1, c2, c3, c4, c5, c6, c7)


@triton.jit
def _row_words(ptr, t, DH: tl.constexpr):
    """The lane's 16 words (bf16 pairs) of its row ``ptr [32]``: channels ``16t .. 16t+15``, then
    ``DH+16t ..``."""
    w = tl.arange(0, 8)[None, :]
    r1 = tl.load(ptr[:, None] + (8 * t)[:, None] + w)
    r2 = tl.load(ptr[:, None] + (DH // 2 + 8 * t)[:, None] + w)
    return _eight(r1) + _eight(r2)


@triton.jit
def _lo(w):
    return (w << 16).to(tl.float32, bitcast=True)


@triton.jit
def _hi(w):
    return (w & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _mma2_kernel(q_ptr, word_ptr, mn_ptr, mx_ptr, start_ptr, length_ptr, out_ptr, s_qh, s_wh, s_wt, s_mh, s_mp,
                 s_oh, n_pages, scale, slack_k, G: tl.constexpr, D: tl.constexpr, DH: tl.constexpr,
                 PAGE: tl.constexpr, PAIRS: tl.constexpr):
    kv = tl.program_id(1)
    start = tl.load(start_ptr)
    length = tl.load(length_ptr)
    lane = tl.arange(0, 32)
    g = lane // 4
    t = lane % 4
    first = 4 * t
    q_words = q_ptr.to(tl.pointer_type(tl.int32))
    # This lane's head for the tokens' B (g % 4) and for the own term's B (g // 2, its sign g % 2).
    qw = _row_words(q_words + (kv * G + g % 4) * (s_qh // 2), t, DH)
    qo = _row_words(q_words + (kv * G + g // 2) * (s_qh // 2), t, DH)
    sign = tl.where(g % 2 == 1, 0x7FFF7FFF, -1)
    qo = (qo[0] & sign, qo[1] & sign, qo[2] & sign, qo[3] & sign, qo[4] & sign, qo[5] & sign, qo[6] & sign, qo[7] & sign,
          qo[8] & sign, qo[9] & sign, qo[10] & sign, qo[11] & sign, qo[12] & sign, qo[13] & sign, qo[14] & sign,
          qo[15] & sign)
    # q over 15 in fp32, channel m of run r at qf[r][m].
    qf = ((_lo(qw[0]), _hi(qw[0]), _lo(qw[1]), _hi(qw[1]), _lo(qw[2]), _hi(qw[2]), _lo(qw[3]), _hi(qw[3]),
           _lo(qw[4]), _hi(qw[4]), _lo(qw[5]), _hi(qw[5]), _lo(qw[6]), _hi(qw[6]), _lo(qw[7]), _hi(qw[7])),
          (_lo(qw[8]), _hi(qw[8]), _lo(qw[9]), _hi(qw[9]), _lo(qw[10]), _hi(qw[10]), _lo(qw[11]), _hi(qw[11]),
           _lo(qw[12]), _hi(qw[12]), _lo(qw[13]), _hi(qw[13]), _lo(qw[14]), _hi(qw[14]), _lo(qw[15]), _hi(qw[15])))
    qmax = tl.abs(qf[0][0])
    for j in tl.static_range(1, 16):
        qmax = tl.maximum(qmax, tl.maximum(tl.abs(qf[0][j]), tl.abs(qf[1][j])))
    qmax = tl.max(qmax, 0) / 15.0
    kappa = (0.5 + 1.0 / 4096) / 15.0 + slack_k
    s = g % 4
    pick_mn = tl.where(s % 2 == 0, -1, 0)
    pick_mx = ~pick_mn
    keep_sign = tl.where(s >= 2, 0x7FFF7FFF, -1)
    word_row = word_ptr + kv * s_wh
    for i in range(PAIRS):
        a = (tl.program_id(0) * PAIRS + i) * 2
        page = a + g // 4
        row = kv * (s_mh // 2) + page * (s_mp // 2)
        mnw = _row_words(mn_ptr.to(tl.pointer_type(tl.int32)) + row, t, DH)
        mxw = _row_words(mx_ptr.to(tl.pointer_type(tl.int32)) + row, t, DH)
        # The page's own term through 8 bf16 MMAs: lane (g, t) gets Σ row_g · q_t and Σ row_g · |q_t|.
        o0 = tl.zeros([32], tl.float32)
        o1 = tl.zeros([32], tl.float32)
        for kb in tl.static_range(8):
            # Row g of A: min (s 0), max (1), |min| (2) or |max| (3) of the lane's page, by bit masks.
            a0 = ((mnw[2 * kb] & pick_mn) | (mxw[2 * kb] & pick_mx)) & keep_sign
            a2 = ((mnw[2 * kb + 1] & pick_mn) | (mxw[2 * kb + 1] & pick_mx)) & keep_sign
            d0, d1 = _mma_bf16(a0, a2, qo[2 * kb], qo[2 * kb + 1])
            o0 += d0
            o1 += d1
        # own = q·min + κ·(|q|·max − |q|·min) + 2^-20·(|q|·|min| + |q|·|max|), a bound of the radius's last term.
        part = tl.where(s == 0, o0 - kappa * o1, tl.where(s == 1, kappa * o1, (1.0 / 1048576) * o1))
        own = tl.reshape(tl.sum(tl.reshape(part, (2, 4, 4)), 1), (8,))  # [page a's heads, page b's]
        # Steps (max - min, over 15 in q) and one σ a page.
        dstep = ((_lo(mxw[0]) - _lo(mnw[0]), _hi(mxw[0]) - _hi(mnw[0]), _lo(mxw[1]) - _lo(mnw[1]), _hi(mxw[1]) - _hi(mnw[1]),
                  _lo(mxw[2]) - _lo(mnw[2]), _hi(mxw[2]) - _hi(mnw[2]), _lo(mxw[3]) - _lo(mnw[3]), _hi(mxw[3]) - _hi(mnw[3]),
                  _lo(mxw[4]) - _lo(mnw[4]), _hi(mxw[4]) - _hi(mnw[4]), _lo(mxw[5]) - _lo(mnw[5]), _hi(mxw[5]) - _hi(mnw[5]),
                  _lo(mxw[6]) - _lo(mnw[6]), _hi(mxw[6]) - _hi(mnw[6]), _lo(mxw[7]) - _lo(mnw[7]), _hi(mxw[7]) - _hi(mnw[7])),
                 (_lo(mxw[8]) - _lo(mnw[8]), _hi(mxw[8]) - _hi(mnw[8]), _lo(mxw[9]) - _lo(mnw[9]), _hi(mxw[9]) - _hi(mnw[9]),
                  _lo(mxw[10]) - _lo(mnw[10]), _hi(mxw[10]) - _hi(mnw[10]), _lo(mxw[11]) - _lo(mnw[11]), _hi(mxw[11]) - _hi(mnw[11]),
                  _lo(mxw[12]) - _lo(mnw[12]), _hi(mxw[12]) - _hi(mnw[12]), _lo(mxw[13]) - _lo(mnw[13]), _hi(mxw[13]) - _hi(mnw[13]),
                  _lo(mxw[14]) - _lo(mnw[14]), _hi(mxw[14]) - _hi(mnw[14]), _lo(mxw[15]) - _lo(mnw[15]), _hi(mxw[15]) - _hi(mnw[15])))
        smax = tl.maximum(dstep[0][0], dstep[1][0])
        for j in tl.static_range(1, 16):
            smax = tl.maximum(smax, tl.maximum(dstep[0][j], dstep[1][j]))
        smax = tl.reshape(tl.broadcast_to(tl.max(tl.reshape(smax, (2, 16)), 1)[:, None], (2, 16)), (32,))
        top = qmax * smax
        e = tl.minimum(tl.maximum(((top.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -100), 100)
        sig = ((141 - e) << 23).to(tl.float32, bitcast=True) * (1.0 / 15.0)
        sig16 = sig * 0.0625
        # B of the tokens' MMAs: word u's pairs (4u, 4u+2), (DH + 4u, DH + 4u + 2)/16, (4u+1, 4u+3), (DH + 4u+1, ..)/16.
        wb = ((_pack(qf[0][0] * sig * dstep[0][0], qf[0][2] * sig * dstep[0][2], False),
               _pack(qf[1][0] * sig16 * dstep[1][0], qf[1][2] * sig16 * dstep[1][2], False),
               _pack(qf[0][1] * sig * dstep[0][1], qf[0][3] * sig * dstep[0][3], False),
               _pack(qf[1][1] * sig16 * dstep[1][1], qf[1][3] * sig16 * dstep[1][3], False)),
              (_pack(qf[0][4] * sig * dstep[0][4], qf[0][6] * sig * dstep[0][6], False),
               _pack(qf[1][4] * sig16 * dstep[1][4], qf[1][6] * sig16 * dstep[1][6], False),
               _pack(qf[0][5] * sig * dstep[0][5], qf[0][7] * sig * dstep[0][7], False),
               _pack(qf[1][5] * sig16 * dstep[1][5], qf[1][7] * sig16 * dstep[1][7], False)),
              (_pack(qf[0][8] * sig * dstep[0][8], qf[0][10] * sig * dstep[0][10], False),
               _pack(qf[1][8] * sig16 * dstep[1][8], qf[1][10] * sig16 * dstep[1][10], False),
               _pack(qf[0][9] * sig * dstep[0][9], qf[0][11] * sig * dstep[0][11], False),
               _pack(qf[1][9] * sig16 * dstep[1][9], qf[1][11] * sig16 * dstep[1][11], False)),
              (_pack(qf[0][12] * sig * dstep[0][12], qf[0][14] * sig * dstep[0][14], False),
               _pack(qf[1][12] * sig16 * dstep[1][12], qf[1][14] * sig16 * dstep[1][14], False),
               _pack(qf[0][13] * sig * dstep[0][13], qf[0][15] * sig * dstep[0][15], False),
               _pack(qf[1][13] * sig16 * dstep[1][13], qf[1][15] * sig16 * dstep[1][15], False)))
        bound = _pair_bound(word_row, s_wt, first, a, g, t, start, length, wb, e, own, PAGE) * scale
        offs = a + tl.arange(0, 2)
        tl.store(out_ptr + kv * s_oh + offs, bound, mask=offs < n_pages)


if __name__ == "__main__":
    print(count(_mma2_kernel, 4))

"""Run 40 (offline, compile only): a prototype of the key-sketch bound's products on the tensor cores,
written to count its sm_90 instructions against half2's, not to run. **Not checked on a GPU, and not
correct as it stands**: the MMA fragments follow the PTX ISA's m16n8k16 layout as read, never
tested; the page's own term is summed on CUDA cores; no listed pages, no agg="none", bf16 codes of
head dim 128 and groups of 4 only. The design is in this folder's README ("What would cut the
instructions").

One warp a program; lane ``L = 4g + t``. Each step takes two pages, ``a`` and ``b``. The MMA's A rows
are 8 tokens of ``a`` then 8 of ``b`` (two token halves a pair), and its B columns the 4 heads of
``a`` then the 4 of ``b``. K is the 128 channels in the order of the lane's code words: lane ``(g, t)``
loads words ``4t .. 4t+3`` of its tokens and builds B for head ``g % 4`` of its page over the same
channels. Sums are fp32, so each page takes one power of two ``σ``, with its largest weight in
``[2^14, 2^15)``.

    TRITON_DEFAULT_FP_FUSION=1 PYTHONPATH=/tmp/t36:$PWD python benchmarks/results/2026-12-07-h100-run40/mma_sketch.py
"""
import collections
import pathlib
import sys
import time

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from policyzoo.kernels.ops.sketch_page_bound.half2 import _code_pairs, _pack, _word_channels, _word_grid, _word_weights

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "2026-12-06-h100-run33"))
import sass_count as S  # noqa: E402


@triton.jit
def _mma(a, b0, b1, c):
    """``d = A·B + C`` of one m16n8k16 fp16 MMA with fp32 sums, per lane: A's four pair registers,
    B's two, C's and D's four floats."""
    return tl.inline_asm_elementwise(
        asm="mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
        constraints="=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
        args=[a[0], a[1], a[2], a[3], b0, b1, c[0], c[1], c[2], c[3]],
        dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _words(word_ptr, slot, s_wt, first):
    """The lane's four code words of token ``slot`` (``[32]`` each)."""
    w = tl.load(word_ptr + slot[:, None] * s_wt + first[:, None] + tl.arange(0, 4)[None, :]).to(tl.uint32, bitcast=True)
    w02, w13 = tl.split(tl.reshape(w, (32, 2, 2)))
    k0, k2 = tl.split(w02)
    k1, k3 = tl.split(w13)
    return (_code_pairs(k0, False), _code_pairs(k1, False), _code_pairs(k2, False), _code_pairs(k3, False))


@triton.jit
def _half_pages(word_ptr, s_wt, first, slot_a, slot_b, wb, acc):
    """One token half of a pair of pages through 8 MMAs (k-block ``2u + s`` takes word ``u``'s pairs
    ``2s`` and ``2s + 1``)."""
    ca = _words(word_ptr, slot_a, s_wt, first)
    cb = _words(word_ptr, slot_b, s_wt, first)
    for u in tl.static_range(4):
        for s in tl.static_range(2):
            acc = _mma((ca[u][2 * s], cb[u][2 * s], ca[u][2 * s + 1], cb[u][2 * s + 1]), wb[u][2 * s], wb[u][2 * s + 1], acc)
    return acc


@triton.jit
def _pair_bound(word_row, s_wt, first, a, g, t, start, length, wb, e, own, PAGE: tl.constexpr):
    """Pages ``a`` and ``a + 1``'s bounds, the group's max (``[2]``, before the scale): each token
    half through `_half_pages`, each head's best visible token, ``best / σ + own`` (``e``: the
    exponent σ was made from, ``own [8]``: page a's heads, then page b's)."""
    best0 = tl.full([32], -float("inf"), tl.float32)
    best1 = best0
    for hh in tl.static_range(2):
        tok = 8 * hh + g
        zero = tl.zeros([32], tl.float32)
        d = _half_pages(word_row, s_wt, first, a * PAGE + tok, (a + 1) * PAGE + tok, wb, (zero, zero, zero, zero))
        # Useful blocks: rows of page a with its heads (lanes t < 2: d0, d1), rows of page b with its (t >= 2: d2, d3).
        slot = tl.where(t < 2, a, a + 1) * PAGE + tok
        seen = (slot >= start) & (slot < length)
        best0 = tl.maximum(best0, tl.where(seen, tl.where(t < 2, d[0], d[2]), -float("inf")))
        best1 = tl.maximum(best1, tl.where(seen, tl.where(t < 2, d[1], d[3]), -float("inf")))
    best = tl.reshape(tl.join(tl.max(tl.reshape(best0, (8, 4)), 0), tl.max(tl.reshape(best1, (8, 4)), 0)), (8,))
    inv_sig = tl.max(tl.reshape(((e + 113) << 23).to(tl.float32, bitcast=True), (2, 16)), 1)  # 1/σ of pages a, b
    inv = tl.reshape(tl.broadcast_to(inv_sig[:, None], (2, 4)), (8,))
    return tl.max(tl.reshape(best * inv + own, (2, 4)), 1)


@triton.jit
def _mma_sketch_kernel(q_ptr, word_ptr, mn_ptr, mx_ptr, start_ptr, length_ptr, out_ptr, s_qh, s_wh, s_wt, s_mh, s_mp,
                       s_oh, n_pages, scale, slack_k, G: tl.constexpr, D: tl.constexpr, DH: tl.constexpr,
                       PAGE: tl.constexpr, PAIRS: tl.constexpr):
    kv = tl.program_id(1)
    start = tl.load(start_ptr)
    length = tl.load(length_ptr)
    lane = tl.arange(0, 32)
    g = lane // 4
    t = lane % 4
    first = 4 * t  # the lane's first code word
    chans = (_word_channels(16 * t, DH), _word_channels(16 * t + 4, DH), _word_channels(16 * t + 8, DH),
             _word_channels(16 * t + 12, DH))
    q_row = q_ptr + (kv * G + g % 4) * s_qh
    word_row = word_ptr + kv * s_wh
    for i in range(PAIRS):
        a = (tl.program_id(0) * PAIRS + i) * 2
        page = a + g // 4  # the page whose head g % 4 this lane builds B for
        mn_row = mn_ptr + kv * s_mh + page * s_mp
        mx_row = mx_ptr + kv * s_mh + page * s_mp
        live = page < n_pages
        grids = (_word_grid(mn_row, mx_row, chans[0], live, D), _word_grid(mn_row, mx_row, chans[1], live, D),
                 _word_grid(mn_row, mx_row, chans[2], live, D), _word_grid(mn_row, mx_row, chans[3], live, D))
        w0, o0 = _word_weights(q_row, chans[0], grids[0], slack_k, D)
        w1, o1 = _word_weights(q_row, chans[1], grids[1], slack_k, D)
        w2, o2 = _word_weights(q_row, chans[2], grids[2], slack_k, D)
        w3, o3 = _word_weights(q_row, chans[3], grids[3], slack_k, D)
        # One σ a page: its largest |weight| over its 16 lanes in [2^14, 2^15).
        top = tl.maximum(tl.maximum(tl.abs(w0[0]), tl.abs(w1[0])), tl.maximum(tl.abs(w2[0]), tl.abs(w3[0])))
        for j in tl.static_range(1, 8):
            top = tl.maximum(top, tl.maximum(tl.maximum(tl.abs(w0[j]), tl.abs(w1[j])), tl.maximum(tl.abs(w2[j]), tl.abs(w3[j]))))
        top2 = tl.max(tl.reshape(top, (2, 16)), 1)
        top = tl.reshape(tl.broadcast_to(top2[:, None], (2, 16)), (32,))
        e = tl.minimum(tl.maximum(((top.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -100), 100)
        sig = ((141 - e) << 23).to(tl.float32, bitcast=True)
        sig16 = sig * 0.0625
        wb = ((_pack(w0[0] * sig, w0[1] * sig, False), _pack(w0[2] * sig16, w0[3] * sig16, False),
               _pack(w0[4] * sig, w0[5] * sig, False), _pack(w0[6] * sig16, w0[7] * sig16, False)),
              (_pack(w1[0] * sig, w1[1] * sig, False), _pack(w1[2] * sig16, w1[3] * sig16, False),
               _pack(w1[4] * sig, w1[5] * sig, False), _pack(w1[6] * sig16, w1[7] * sig16, False)),
              (_pack(w2[0] * sig, w2[1] * sig, False), _pack(w2[2] * sig16, w2[3] * sig16, False),
               _pack(w2[4] * sig, w2[5] * sig, False), _pack(w2[6] * sig16, w2[7] * sig16, False)),
              (_pack(w3[0] * sig, w3[1] * sig, False), _pack(w3[2] * sig16, w3[3] * sig16, False),
               _pack(w3[4] * sig, w3[5] * sig, False), _pack(w3[6] * sig16, w3[7] * sig16, False)))
        own = tl.sum(tl.reshape((o0 + o1) + (o2 + o3), (8, 4)), 1)  # [8]: page a's heads, then page b's
        bound = _pair_bound(word_row, s_wt, first, a, g, t, start, length, wb, e, own, PAGE) * scale
        offs = a + tl.arange(0, 2)
        tl.store(out_ptr + kv * s_oh + offs, bound, mask=offs < n_pages)


POINTERS = dict(q_ptr="*bf16", word_ptr="*i32", mn_ptr="*bf16", mx_ptr="*bf16", start_ptr="*i64", length_ptr="*i64",
                out_ptr="*fp32")

def count(fn, pairs: int) -> str:
    """Compile ``fn`` (one warp, `POINTERS`, the Llama shape, ``pairs`` pairs of pages a program) for
    sm_90 and describe its SASS: instructions a page, spills, the loop body's opcodes."""
    names = fn.arg_names
    const = dict(G=4, D=128, DH=64, PAGE=16, PAIRS=pairs)
    sig = {n: POINTERS.get(n, "constexpr" if n in const else ("fp32" if n in ("scale", "slack_k") else "i32")) for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n] not in ("constexpr", "fp32")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    t0 = time.time()
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))
    code, labels = S.sass(k)
    body = S.loop_body(code, labels)
    ops = collections.Counter(S.opcode(i) for i in body)
    total = len(code) + (pairs - 1) * len(body)
    spills = sum(1 for _, i in code if S.opcode(i) in ("STL", "LDL"))
    return (f"triton {triton.__version__}: {len(code)} static instructions ({spills} spills), loop body (a pair of pages) "
            f"{len(body)}, {total} a program of {2 * pairs} pages: {total / (2 * pairs):.0f} a page (half2: 4,416 / 8 = 552); "
            f"compile {time.time() - t0:.0f} s\nloop body: " + ", ".join(f"{o} {n}" for o, n in ops.most_common(18)))


if __name__ == "__main__":
    print(count(_mma_sketch_kernel, 4))

"""Run 38 (no GPU): warp instructions a program issues per code byte, the key-sketch bound's "rows"
method against "half2", compiled offline for sm_90 with the Triton of this checkout (nvdisasm from
its bundle; run 33's `sass_count.py`). Llama-3.1-8B layer shape (32 q / 8 KV heads, head dim 128,
pages of 16), 8 pages a program. "rows" loops over a token's words: its count is the program's
static code with the loop body counted once per trip (4 trips of 4 words). "half2" has no loop
(its tokens are a static loop): its static code is what it issues. From the repository root:

    TRITON_DEFAULT_FP_FUSION=1 python benchmarks/results/2026-12-07-offline-run38/half2_sass.py

It compiles the half2 kernel as of 1a9bee5 (its ``TOKENS`` parameter is gone since run 39's rewrite).
"""
import collections
import pathlib
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "2026-12-06-h100-run33"))
import sass_count as S  # noqa: E402

from policyzoo.kernels.ops.sketch_page_bound import half2, kernel as K  # noqa: E402

CODE_BYTES_PER_THREAD = 8 * 16 * 64 / 32  # 8 pages of 16 tokens, 64 code bytes a token, one warp


def compiled(fn, const: dict, warps: int):
    names = fn.arg_names
    sig = {n: S.POINTERS.get(n, "constexpr" if n in const else ("fp32" if n in ("scale", "slack_k") else "i32"))
           for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n] not in ("constexpr", "fp32")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))


def line(label, counts, total):
    top = ", ".join(f"{k} {v}" for k, v in counts.most_common(8))
    print(f"{label:<34} {total:6.0f} a thread, {total / CODE_BYTES_PER_THREAD:5.1f} a code byte; {top}")


if __name__ == "__main__":  # run 39's script imports `compiled` and `line`
    rows = compiled(K._sketch_rows_kernel, dict(G=4, G_PAD=4, D=128, D_PAD=128, DH=64, WORDS=16, VW=4, PAGE=16, BLOCK_P=8,
                                                AGG=1, LISTED=False), 1)
    code, labels = S.sass(rows)
    body = S.loop_body(code, labels)
    counts = collections.Counter(S.opcode(i) for _, i in code) + collections.Counter(
        {k: 3 * v for k, v in collections.Counter(S.opcode(i) for i in body).items()})
    line("rows 8 pages/1 warp/4 words", counts, len(code) + 3 * len(body))

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import sum16  # noqa: E402  (the variant that adds a column's two chains, and a pair's halves, in fp16)

    for label, module in (("half2", half2), ("half2, fp16 sums (sum16)", sum16.sum16)):
        for tokens in (4, 8, 16):
            k = compiled(module._sketch_half2_kernel, dict(G=4, G_PAD=4, D=128, DH=64, WORDS=16, PAGE=16, BLOCK_P=8,
                                                           TOKENS=tokens, AGG=1, LISTED=False, EMULATE=False), 1)
            code, _ = S.sass(k)
            spills = sum(1 for _, i in code if S.opcode(i) in ("STL", "LDL"))
            line(f"{label} 8/1/{tokens}" + (f" ({spills} spills)" if spills else ""),
                 collections.Counter(S.opcode(i) for _, i in code), len(code))

"""Offline SASS counts of the rows kernel with its registers capped (maxnreg; sm_90, no GPU): TRITON_DEFAULT_FP_FUSION=1 python benchmarks/results/2026-12-06-h100-run34/maxnreg_sass.py"""
import sys, collections, triton
sys.path.insert(0, "benchmarks/results/2026-12-06-h100-run33")
import sass_count as S
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from policyzoo.kernels.ops.sketch_page_bound import kernel as K
def compiled(fn, const, warps, maxnreg):
    names = fn.arg_names
    sig = {n: S.POINTERS.get(n, "constexpr" if n in const else ("fp32" if n == "scale" else "i32")) for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n] not in ("constexpr", "fp32")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    opts = dict(num_warps=warps) | ({"maxnreg": maxnreg} if maxnreg else {})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
for bp, warps, vw in ((8, 1, 4), (16, 1, 4)):
    for r in (None, 160, 128, 96):
        k = compiled(K._sketch_rows_kernel, dict(G=4, G_PAD=4, D=128, D_PAD=128, DH=64, WORDS=16, VW=vw, PAGE=16, BLOCK_P=bp, AGG=1, LISTED=False), warps, r)
        code, labels = S.sass(k)
        allc = collections.Counter(S.opcode(i) for _, i in code)
        print(f"maxnreg={r} STL={allc['STL']} LDL={allc['LDL']}", end=" ")
        S.report(f"rows {bp}/{warps}/{vw}", S.loop_body(code, labels), bp * 16 * vw * 4 / (32 * warps))

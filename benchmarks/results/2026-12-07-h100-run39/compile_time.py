"""Run 39 (offline): how long Triton takes to compile the key-sketch bound's "rows" and "half2"
kernels for sm_90 (a fresh cache), their SASS length and spills, and for a kernel with a token loop
(`token-loop.patch` applied) the instructions it issues. From the repository root:

    TRITON_DEFAULT_FP_FUSION=1 TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=$PWD \
        python benchmarks/results/2026-12-07-h100-run39/compile_time.py
"""
import collections
import pathlib
import sys
import time

import triton

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "2026-12-06-h100-run33"))
sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "2026-12-07-offline-run38"))
import sass_count as S  # noqa: E402
from half2_sass import compiled  # noqa: E402

from policyzoo.kernels.ops.sketch_page_bound import half2, kernel as K  # noqa: E402

print(f"triton {triton.__version__}")
for name, fn, const in (
    ("rows", K._sketch_rows_kernel, dict(G=4, G_PAD=4, D=128, D_PAD=128, DH=64, WORDS=16, VW=4, PAGE=16, BLOCK_P=8,
                                         AGG=1, LISTED=False)),
    ("half2", half2._sketch_half2_kernel, dict(G=4, G_PAD=4, D=128, DH=64, WORDS=16, PAGE=16, BLOCK_P=8, AGG=1,
                                               LISTED=False, EMULATE=False)),
):
    t = time.time()
    k = compiled(fn, const, 1)
    took = time.time() - t
    code, labels = S.sass(k)
    spills = sum(1 for _, i in code if S.opcode(i) in ("STL", "LDL"))
    print(f"{name}: compiled in {took:.1f} s, {len(code)} instructions, {spills} spills")
    body = S.loop_body(code, labels) if labels else []
    if name == "half2" and len(body) > 16:  # the token loop's kernel: its body runs once a token of the page's 16
        issued = len(code) + 15 * len(body)
        print(f"  with a token loop: {issued} issued ({issued / 256:.1f} a code byte), {len(body)} a token: "
              + ", ".join(f"{k} {v}" for k, v in collections.Counter(S.opcode(i) for i in body).most_common(8)))

"""Run 39 (offline): warp instructions a program issues per code byte, the key-sketch bound's "rows"
method against "half2" (one token a step, no head axis), compiled for sm_90 with whichever Triton is
first on the path (run 38's `half2_sass.py` counts the same way; its "rows" count method is run 33's
`sass_count.py`). Llama-3.1-8B layer shape (32 q / 8 KV heads, head dim 128, pages of 16), 8 pages a
program, one warp. From the repository root, with this checkout's Triton and with the GPU image's:

    TRITON_DEFAULT_FP_FUSION=1 PYTHONPATH=$PWD python benchmarks/results/2026-12-07-h100-run39/half2_sass.py
    pip install --no-deps --target /tmp/t36 triton==3.6.0
    TRITON_DEFAULT_FP_FUSION=1 PYTHONPATH=/tmp/t36:$PWD python benchmarks/results/2026-12-07-h100-run39/half2_sass.py
"""
import collections
import pathlib
import sys

import triton

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "2026-12-06-h100-run33"))
sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "2026-12-07-offline-run38"))
import sass_count as S  # noqa: E402
from half2_sass import compiled, line  # noqa: E402

from policyzoo.kernels.ops.sketch_page_bound import half2, kernel as K  # noqa: E402

print(f"triton {triton.__version__}")
rows = compiled(K._sketch_rows_kernel, dict(G=4, G_PAD=4, D=128, D_PAD=128, DH=64, WORDS=16, VW=4, PAGE=16, BLOCK_P=8,
                                            AGG=1, LISTED=False), 1)
code, labels = S.sass(rows)
body = S.loop_body(code, labels)
counts = collections.Counter(S.opcode(i) for _, i in code) + collections.Counter(
    {k: 3 * v for k, v in collections.Counter(S.opcode(i) for i in body).items()})
line("rows 8 pages/1 warp/4 words", counts, len(code) + 3 * len(body))
for g in (4, 2, 1):
    k = compiled(half2._sketch_half2_kernel, dict(G=g, G_PAD=g, D=128, DH=64, WORDS=16, PAGE=16, BLOCK_P=8, AGG=1,
                                                  LISTED=False, EMULATE=False), 1)
    code, _ = S.sass(k)
    spills = sum(1 for _, i in code if S.opcode(i) in ("STL", "LDL"))
    line(f"half2 8/1, group {g}" + (f" ({spills} spills)" if spills else ""),
         collections.Counter(S.opcode(i) for _, i in code), len(code))

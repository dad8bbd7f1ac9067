"""Run 40 (offline): the half2 kernel compiled for sm_90 under register caps (ptxas' maxnreg), its
registers and stack (`cuobjdump --dump-resource-usage`), instructions and spills (STL/LDL), at the
Llama-3.1-8B layer's shape (8 pages a program, one warp). With the GPU image's Triton, from the
repository root (each compile takes about 45 s):

    pip install --no-deps --target /tmp/t36 triton==3.6.0
    TRITON_DEFAULT_FP_FUSION=1 PYTHONPATH=/tmp/t36:$PWD python benchmarks/results/2026-12-07-h100-run40/caps_sass.py 0,200,184,176,168,128
"""
import collections
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from policyzoo.kernels.ops.sketch_page_bound import half2

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "2026-12-06-h100-run33"))
import sass_count as S  # noqa: E402

BIN = pathlib.Path(triton.__file__).parent / "backends/nvidia/bin"
CONST = dict(G=4, G_PAD=4, D=128, DH=64, WORDS=16, PAGE=16, TOKEN_STEP=int(os.environ.get("TOKEN_STEP", 16)), BLOCK_P=8, AGG=1,
             LISTED=False, EMULATE=False)


def compiled(fn, const: dict, warps: int, maxnreg: int | None):
    names = fn.arg_names
    sig = {n: S.POINTERS.get(n, "constexpr" if n in const else ("fp32" if n in ("scale", "slack_k") else "i32"))
           for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n] not in ("constexpr", "fp32")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    options = dict(num_warps=warps, **({"maxnreg": maxnreg} if maxnreg else {}))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def resources(kernel) -> tuple[str, str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([str(BIN / "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                             text=True).stdout
    return re.search(r"REG:(\d+)", out).group(1), re.search(r"STACK:(\d+)", out).group(1)


print("triton", triton.__version__)
for cap in [int(a) or None for a in sys.argv[1].split(",")]:
    t = time.time()
    k = compiled(half2._sketch_half2_kernel, CONST, 1, cap)
    code, _ = S.sass(k)
    ops = collections.Counter(S.opcode(i) for _, i in code)
    regs, stack = resources(k)
    print(f"maxnreg {cap}: {regs} registers, stack {stack}, {len(code)} instructions, STL {ops['STL']} LDL {ops['LDL']}, "
          f"compile {time.time() - t:.0f} s", flush=True)

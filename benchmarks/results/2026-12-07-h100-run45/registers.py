"""Run 45, offline: registers and stack of the one-row threshold GEMV (`_gemv_scan_kernel`, BLOCK_B 1)
compiled for sm_90 with the Triton that runs on the GPU image, with and without a register cap
(ptxas' maxnreg, `GemvConfig.max_registers`). No GPU needed::

    pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36:. python benchmarks/results/2026-12-07-h100-run45/registers.py
"""
import pathlib
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from policyzoo.kernels.ops.sparse_gemv import kernel as K

fn = K._gemv_scan_kernel
cuobjdump = pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
ptr = {"t_ptr": "*fp32", "part_ptr": "*fp32", "done_ptr": "*i32"}
for bn, bk, warps in ((64, 128, 4), (64, 64, 4), (64, 128, 8), (64, 32, 2)):
    for cap in (None, 168, 128, 96):
        const = dict(FROM_MASK=False, HAS_BIAS=False, SPLIT=True, FUSE=True, BLOCK_B=1, BLOCK_N=bn, BLOCK_K=bk,
                     IEEE=False, PREFETCH=False, TILE_SUM=False, ATOMIC=False, WARM_X=0, X_LINE=64, W_CACHE="")
        sig = {n: (ptr.get(n, "*bf16") if n.endswith("_ptr") else "constexpr" if n in const else "i32")
               for n in fn.arg_names}
        src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
        opts = dict(num_warps=warps, num_stages=3, **({"maxnreg": cap} if cap else {}))
        cubin = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["cubin"]
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        regs, stack = int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1))
        programs = min(65536 // (regs * 32 * warps), 64 // warps)  # by registers (64K a SM), 64 warps at most
        print(f"triton {triton.__version__} {bn}x{bk}, {warps} warps, cap {cap}: {regs} registers, stack {stack} B, "
              f"{programs} programs an SM", flush=True)

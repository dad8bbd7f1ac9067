"""Instructions per code byte of the key-sketch page bound, compiled offline for sm_90 (no GPU).

Compiles `_sketch_bound_kernel` (method "sum") and `_sketch_rows_kernel` (method "rows") with the
Triton of this checkout for an H100/H200 target, disassembles the cubin with the nvdisasm Triton
ships, and counts the warp instructions of the loop body (rows) or of the whole program (sum: no
loop), divided by the code bytes a thread reads per pass. The shapes are the Llama-3.1-8B layer's
(32 q / 8 KV heads, head dim 128, pages of 16, bf16 summaries); integer arguments and pointers are
marked divisible by 16, as the JIT marks them at 128K. Run from the repository root:

    TRITON_DEFAULT_FP_FUSION=1 python benchmarks/results/2026-12-06-h100-run33/sass_count.py
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from policyzoo.kernels.ops.sketch_page_bound import kernel as K

D, G, PAGE = 128, 4, 16
POINTERS = dict(q_ptr="*bf16", code_ptr="*u8", word_ptr="*i32", mn_ptr="*bf16", mx_ptr="*bf16", start_ptr="*i64",
                length_ptr="*i64", list_ptr="*fp32", out_ptr="*fp32")


def compiled(fn, const: dict, warps: int):
    names = fn.arg_names
    sig = {n: POINTERS.get(n, "constexpr" if n in const else ("fp32" if n == "scale" else "i32")) for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n] not in ("constexpr", "fp32")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))


def sass(kernel) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """The kernel's SASS as ``(address, instruction)`` pairs, and the address of each label."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
    text = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    code, labels, pending = [], {}, []
    for line in text.splitlines():
        label = re.match(r"\s*\.(L_x_\d+):", line)
        ins = re.search(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", line)
        if label:
            pending.append(label.group(1))
        elif ins:
            address = int(ins.group(1), 16)
            labels.update({name: address for name in pending})
            pending = []
            code.append((address, ins.group(2).strip()))
    return code, labels


def opcode(ins: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0]


def loop_body(code: list[tuple[int, str]], labels: dict[str, int]) -> list[str]:
    """The instructions of the longest backward branch's span (the main loop), or all of them."""
    best: list[str] = []
    for a, ins in code:
        target = re.search(r"BRA\W+(L_x_\d+)", ins)
        if target and labels.get(target.group(1), a + 1) <= a:
            span = [i for x, i in code if labels[target.group(1)] <= x <= a]
            best = span if len(span) > len(best) else best
    return best or [i for _, i in code]


def report(label: str, instructions: list[str], bytes_per_thread: float) -> None:
    counts = collections.Counter(opcode(i) for i in instructions)
    print(f"{label:<36} {len(instructions):5d} warp instructions, {len(instructions) / bytes_per_thread:5.1f} per code byte; "
          + ", ".join(f"{k} {v}" for k, v in counts.most_common(8)))


def main() -> None:
    for bp, warps in ((4, 4), (2, 2)):
        k = compiled(K._sketch_bound_kernel, dict(G=G, G_PAD=16, D=D, DH=D // 2, DH_PAD=D // 2, PAGE=PAGE, BLOCK_P=bp, AGG=1,
                                                   DOT=False, KEYS=False, LISTED=False), warps)
        report(f"sum  BLOCK_P={bp} warps={warps}", [i for _, i in sass(k)[0]], bp * PAGE * D / 2 / (32 * warps))
    for bp, warps, vw in ((8, 1, 2), (8, 1, 4), (16, 2, 2), (32, 2, 2), (32, 4, 2)):
        k = compiled(K._sketch_rows_kernel, dict(G=G, G_PAD=G, D=D, D_PAD=D, DH=D // 2, WORDS=D // 8, VW=vw, PAGE=PAGE,
                                                  BLOCK_P=bp, AGG=1, LISTED=False), warps)
        report(f"rows BLOCK_P={bp} warps={warps} words={vw}", loop_body(*sass(k)), bp * PAGE * vw * 4 / (32 * warps))


if __name__ == "__main__":
    main()

"""Run 42 (offline): the decode-attention chunk kernel's loop, compiled for sm_90 with Triton 3.6
(the GPU image's), disassembled and counted: instructions a warp a step of the loop, by opcode, and
the registers and shared memory a program. The library's `_softmax_chunk_kernel`, or with
``KFN=_softmax_streams_kernel STREAMS=W`` its opt-in stream variant (`AttentionConfig.streams`). Shapes: the
Llama-3.1-8B layer's (4 query heads a KV head padded to 16 rows, head dim 128, pages of 16, bf16);
pointers and the caches' strides marked divisible by 16, as the JIT marks them. From the
repository root (``DUMP=1`` prints the loop's SASS):

    pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36:$PWD python benchmarks/results/2026-12-07-h100-run42/chunk_sass.py BLOCK_T WARPS STAGES
    KFN=_softmax_streams_kernel STREAMS=4 PYTHONPATH=/tmp/t36:$PWD \\
        python benchmarks/results/2026-12-07-h100-run42/chunk_sass.py 16 4 2
"""
import collections
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "2026-12-06-h100-run33"))
import sass_count as S  # noqa: E402

from policyzoo.kernels.ops.decode_attention import kernel as K  # noqa: E402

POINTERS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "idx_ptr": "*i32", "slot_ptr": "*i32", "cnt_ptr": "*i32",
            "lw_ptr": "*fp32", "start_ptr": "*i64", "len_ptr": "*i64", "m_ptr": "*fp32", "l_ptr": "*fp32", "o_ptr": "*fp32"}
DIVISIBLE = ("s_qb", "s_qh", "s_kb", "s_kh", "s_kn", "s_vb", "s_vh", "s_vn")


def compiled(fn, const: dict, warps: int, stages: int):
    names = fn.arg_names
    sig = {n: POINTERS.get(n, "constexpr" if n in const else ("fp32" if n == "scale" else "i32")) for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*") or n in DIVISIBLE}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 128), options=dict(num_warps=warps, num_stages=stages))


def registers(kernel) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([str(pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"),
                              "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return re.search(r"REG:\d+ STACK:\d+", out).group(0)


if __name__ == "__main__":
    bt, warps, stages = (int(a) for a in (sys.argv[1:4] if len(sys.argv) > 3 else (32, 4, 2)))
    name = os.environ.get("KFN", "_softmax_chunk_kernel")
    fn = getattr(K, name)
    const = dict(G=4, G_PAD=16, D=128, D_PAD=128, BLOCK=16, BLOCK_T=bt, HAS_LW=False, HAS_SLOTS=False, UPCAST=False,
                 PRECISION="tf32")
    streams = int(os.environ.get("STREAMS", "1"))
    if name == "_softmax_streams_kernel":
        const["STREAMS"] = streams
    kernel = compiled(fn, const, warps, stages)
    code, labels = S.sass(kernel)
    loops = [(labels[m.group(1)], a) for a, ins in code
             if (m := re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", ins)) and m.group(1) in labels and labels[m.group(1)] < a]
    lo, hi = max(loops, key=lambda span: span[1] - span[0])  # the token loop: the longest backward branch
    body = [ins for a, ins in code if lo <= a <= hi]
    ops = collections.Counter(S.opcode(i) for i in body)
    tokens = bt * streams
    print(f"{name}, tiles of {bt} x {streams} stream(s), {warps} warps, {stages} stages: {registers(kernel)}, "
          f"shared {kernel.metadata.shared} B; loop {len(body)} instructions a warp a step of {tokens} tokens, "
          f"{len(body) * warps / tokens:.1f} warp instructions a token, {ops['BAR']} barriers")
    print("  " + ", ".join(f"{o} {c}" for o, c in ops.most_common(20)))
    if os.environ.get("DUMP"):
        print("\n".join(f"{a:6x}  {ins}" for a, ins in code if lo <= a <= hi))

"""Instructions per code byte of the key-sketch bound's integer method (`_sketch_int_kernel`, dp4a)
against the rows method, compiled offline for sm_90 (no GPU), the Llama-3.1-8B layer's shapes.
Uses run 33's counter. From the repository root:

    TRITON_DEFAULT_FP_FUSION=1 python benchmarks/results/2026-12-06-offline-run35/int_sass.py
"""
import importlib.util
import sys
from pathlib import Path

spec = importlib.util.spec_from_file_location("sass_count", Path(__file__).parents[1] / "2026-12-06-h100-run33/sass_count.py")
sc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sc)
K = sc.K
D, G, PAGE = 128, 4, 16

for bp, warps, vw in ((8, 1, 4),):
    k = sc.compiled(K._sketch_rows_kernel, dict(G=G, G_PAD=G, D=D, D_PAD=D, DH=D // 2, WORDS=D // 8, VW=vw, PAGE=PAGE,
                                                BLOCK_P=bp, AGG=1, LISTED=False), warps)
    sc.report(f"rows BLOCK_P={bp} warps={warps} words={vw}", sc.loop_body(*sc.sass(k)), bp * PAGE * vw * 4 / (32 * warps))
for bp, warps in [tuple(map(int, a.split("x"))) for a in (sys.argv[1:] or ["2x1", "4x1", "4x2", "8x2", "8x4"])]:
    k = sc.compiled(K._sketch_int_kernel, dict(G=G, G_PAD=G, D=D, DH=D // 2, DH_PAD=D // 2, WORDS=D // 8, PAGE=PAGE,
                                               BLOCK_P=bp, AGG=1, LISTED=False, ASM=True), warps)
    code, _ = sc.sass(k)
    k._init_handles() if False else None
    print("   shared", k.metadata.shared)
    sc.report(f"int  BLOCK_P={bp} warps={warps} (whole program)", [i for _, i in code], bp * PAGE * D / 2 / (32 * warps))

"""Offline SASS counts of keys16.py's kernel (sm_90, no GPU): TRITON_DEFAULT_FP_FUSION=1 python benchmarks/results/2026-12-06-h100-run34/keys16_sass.py"""
import sys, collections
sys.path.insert(0, "benchmarks/results/2026-12-06-h100-run33"); sys.path.insert(0, "benchmarks/results/2026-12-06-h100-run34")
import sass_count as S
import keys16 as K16
for bp, warps in ((2, 4), (4, 4), (8, 4), (8, 8), (1, 2)):
    k = S.compiled(K16._sketch_keys16_kernel, dict(G=4, G_PAD=16, D=128, DH=64, WORDS=16, W_PAD=16, PAGE=16, BLOCK_P=bp, AGG=1, LISTED=False), warps)
    code = [i for _, i in S.sass(k)[0]]
    S.report(f"keys16 {bp}/{warps}", code, bp * 16 * 64 / (32 * warps))
    print("   regs?", k.n_regs if hasattr(k, "n_regs") else getattr(k.metadata, "num_regs", "?"), "mma:", sum(1 for i in code if "MMA" in i or "HGMMA" in i), "HFMA2:", sum(1 for i in code if i.split()[0].startswith("HFMA2") or " HFMA2" in i))

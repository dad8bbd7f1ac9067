export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader; S0=$(date +%s)
timeout 130 python - <<'PY' > $OUT/entmax-probe.txt 2>&1
import torch, triton, itertools
from policyzoo import kernels
from policyzoo.kernels import EntmaxThresholdConfig, Workspace
from policyzoo.kernels.config import override
import unittest.mock as um
from policyzoo.kernels.ops import entmax_threshold as E
from policyzoo.kernels.ops.entmax_threshold import kernel as K, reference as R
from benchmarks import common
dev = "cuda"
ws = Workspace(torch.device(dev))
for P in (8196, 8192, 2052, 16388):
    g = torch.Generator(device=dev).manual_seed(2)
    m = torch.randn(1, 32, P, device=dev, generator=g)
    s = torch.rand(1, 32, P, device=dev, generator=g) * 0.3
    n = torch.full((1, 32, P), 16, device=dev, dtype=torch.int32)
    cap = m + 2.0
    ref = R.gaussian_entmax_threshold(m, s, n, cap, 12)
    def t(iters, old=False, **cfg):
        walk = lambda per, block: 0 if per <= block else None  # before the tail block: a slice past its block is walked
        with override(entmax_threshold=EntmaxThresholdConfig(**cfg)), um.patch.object(E, "tail_block", walk if old else E.tail_block):
            out = kernels.gaussian_entmax_threshold(m, s, n, cap, iters, workspace=ws)
            us = common.graph_time_ms(lambda: kernels.gaussian_entmax_threshold(m, s, n, cap, iters, workspace=ws)) * 1e3
        return out, us
    for old in (True, False, True, False):
        out, us = t(12, old=old)
        err = float(((out - ref).abs() / (1 + ref.abs())).max())
        print(f"P={P} iters=12 {'walked (before)' if old else 'held + tail (after)'}: {us:7.1f} us, err {err:.1e}", flush=True)
    for iters in ((0, 1, 3, 6, 12) if P != 16388 else (0, 12)):
        out, us = t(iters)
        print(f"P={P} iters={iters:2d} default config: {us:7.1f} us", flush=True)
    for cfg in [dict(split=1), dict(split=2), dict(split=8), dict(num_warps=4), dict(num_warps=8), dict(num_warps=32),
                dict(block_p=512), dict(block_p=1024), dict(block_p=4096), dict(block_p=4096, num_warps=32), dict(block_p=8192, num_warps=32), dict(min_pages=256), dict(min_pages=128), dict(min_pages=1024)]:
        try:
            out, us = t(12, **cfg)
            err = float(((out - ref).abs() / (1 + ref.abs())).max())
            print(f"P={P} iters=12 {cfg}: {us:7.1f} us, err {err:.1e}", flush=True)
        except Exception as e:
            print(f"P={P} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    # a fp32-only solve (no fine steps) and its error: what the float64 steps buy
    import unittest.mock as um
    with um.patch.object(K, "FINE_STEPS", 0):
        out, us = t(12)
        err = float(((out - ref).abs() / (1 + ref.abs())).max())
        print(f"P={P} 12 float32 steps, no float64: {us:7.1f} us, err {err:.1e}", flush=True)
        out, us = t(8)
        err = float(((out - ref).abs() / (1 + ref.abs())).max())
        print(f"P={P} 8 float32 steps, no float64: {us:7.1f} us, err {err:.1e}", flush=True)
# the choice from given scores: fused select_scores against the compiled steps, rows past 8,192
from policyzoo.kv.choose import choose_topk_steps
steps_c = torch.compile(choose_topk_steps)
for n_e in (8192, 8196, 12288, 16388):
    g = torch.Generator(device=dev).manual_seed(5)
    sc = torch.randn(1, 8, n_e, device=dev, generator=g)
    forced = torch.zeros(1, n_e, dtype=torch.bool, device=dev); forced[:, :4] = True; forced[:, -8:] = True
    k_max = n_e // 10 + 16
    count = torch.full((1,), n_e // 10, dtype=torch.int64, device=dev)
    try:
        fi, fk = kernels.select_scores(sc, forced, count, k_max, workspace=ws)
        sel = steps_c(sc, forced, k_max, count, workspace=ws)
        same = torch.equal(fk, sel.count) and all(set(fi[0, h, :int(fk[0, h])].tolist()) == set(sel.indices[0, h, :int(sel.count[0, h])].tolist()) for h in range(8))
        f_us = common.graph_time_ms(lambda: kernels.select_scores(sc, forced, count, k_max, workspace=ws)) * 1e3
        s_us = common.graph_time_ms(lambda: steps_c(sc, forced, k_max, count, workspace=ws)) * 1e3
        print(f"given scores [1, 8, {n_e}]: fused {f_us:6.1f} us, steps {s_us:6.1f} us, same choice {same}", flush=True)
    except Exception as e:
        print(f"given scores {n_e}: {type(e).__name__}: {str(e)[:300]}", flush=True)
# registers and spills of the compiled variants
try:
    for key, ck in list(K._entmax_threshold_kernel.device_caches[0][0].items())[:30]:
        print("compiled", getattr(ck, "n_regs", "?"), "regs", getattr(ck, "n_spills", "?"), "spills", str(key)[:300])
except Exception as e:
    print("no compiled listing:", type(e).__name__, e)
PY
tail -60 $OUT/entmax-probe.txt
for v in new old new2; do
T0=$(date +%s)
G=entmax-kv0.1@131072; [ $v = new ] && G=dense@131072,entmax-kv0.1@131072
timeout 140 python - $v $G <<'PY2' > $OUT/gen-$v.txt 2>&1
import sys, unittest.mock as um
from policyzoo.kernels.ops import entmax_threshold as E
from benchmarks import sweep
v, g = sys.argv[1], sys.argv[2]
walk = lambda per, block: 0 if per <= block else None
with um.patch.object(E, "tail_block", walk if v == "old" else E.tail_block):
    sweep.main(["--only", "generate", "--dynamic-capacity", "--generate", g, "--out", f"/tmp/gen-{v}"])
PY2
grep "ms/token" $OUT/gen-$v.txt | grep -v first; echo "$v took $(( $(date +%s) - T0 )) s"
done
timeout 90 python -m benchmarks.select_bench --contexts 131072 --policies quest0.1,entmax-kv0.1 --out $OUT/select.json > $OUT/select.txt 2>&1
tail -15 $OUT/select.txt

export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader; S0=$(date +%s)
cat > /tmp/stopvar.py <<'PY'
import triton.language as tl
from policyzoo.kernels.ops.entmax_threshold import kernel as K
def variant(name):  # "old": every Newton step taken (a stop of 0 only ends a step that moved nothing)
    if name == "old":
        K.STOP_FLOAT32 = tl.constexpr(0.0)
        K.STOP_FLOAT64 = tl.constexpr(0.0)
PY
for v in old new; do
timeout 60 python - $v <<'PY' >> $OUT/probe.txt 2>&1
import sys; sys.path.insert(0, "/tmp")
from stopvar import variant
variant(sys.argv[1])
import torch
from policyzoo import kernels
from policyzoo.kernels import Workspace
from policyzoo.kernels.ops.entmax_threshold import reference as R
from benchmarks import common
dev = "cuda"; ws = Workspace(torch.device(dev))
for P in (8196, 8192, 2052):
    g = torch.Generator(device=dev).manual_seed(2)
    m = torch.randn(1, 32, P, device=dev, generator=g)
    s = torch.rand(1, 32, P, device=dev, generator=g) * 0.3
    n = torch.full((1, 32, P), 16, device=dev, dtype=torch.int32)
    cap = m + 2.0
    for spread in (1.0, 10.0):
        ref = R.gaussian_entmax_threshold(m * spread, s * spread, n, cap * spread, 12)
        out = kernels.gaussian_entmax_threshold(m * spread, s * spread, n, cap * spread, 12, workspace=ws)
        mm, ss, cc = m * spread, s * spread, cap * spread
        us = common.graph_time_ms(lambda: kernels.gaussian_entmax_threshold(mm, ss, n, cc, 12, workspace=ws)) * 1e3
        err = float(((out - ref).abs() / (1 + ref.abs())).max())
        print(f"{sys.argv[1]} P={P} spread={spread}: {us:6.1f} us, err vs reference {err:.1e}", flush=True)
PY
done
cat $OUT/probe.txt | grep -v Warn
echo "probe took $(( $(date +%s) - S0 )) s"
for v in new old; do
T0=$(date +%s)
G=entmax-kv0.1@131072; [ $v = new ] && G=dense@131072,$G
timeout 130 python - $v $G <<'PY2' > $OUT/gen-$v.txt 2>&1
import sys; sys.path.insert(0, "/tmp")
from stopvar import variant
variant(sys.argv[1])
from benchmarks import sweep
sweep.main(["--only", "generate", "--dynamic-capacity", "--generate", sys.argv[2], "--out", f"/tmp/gen-{sys.argv[1]}"])
PY2
cp /tmp/gen-$v/sweep.json $OUT/gen-$v.json 2>/dev/null
grep "ms/token" $OUT/gen-$v.txt | grep -v first; echo "$v took $(( $(date +%s) - T0 )) s"
done
echo "total $(( $(date +%s) - S0 )) s"

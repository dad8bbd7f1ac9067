export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader; S0=$(date +%s)
timeout 60 python - <<'PY' > $OUT/lmhead-check.txt 2>&1
import torch
from policyzoo import kernels
from benchmarks import common
torch.manual_seed(0)
for b in (1, 4):
    x = torch.randn(b, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128256, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    ws = kernels.Workspace(torch.device("cuda"))
    ref = (x.float() @ w.float().t())
    out = kernels.dense_gemv(x, w, None, workspace=ws).float()
    blas = (x @ w.t()).float()
    t_k = common.graph_time_ms(lambda: kernels.dense_gemv(x, w, None, workspace=ws)) * 1e3
    t_b = common.graph_time_ms(lambda: x @ w.t()) * 1e3
    print(f"LM head b={b}: kernel {t_k:.1f} us ({w.numel()*2/t_k/1e6:.2f} TB/s), cuBLAS {t_b:.1f} us ({w.numel()*2/t_b/1e6:.2f} TB/s); "
          f"max err kernel {float((out-ref).abs().max()):.3e} cuBLAS {float((blas-ref).abs().max()):.3e}; argmax same {bool((out.argmax(-1)==ref.argmax(-1)).all())}", flush=True)
PY
cat $OUT/lmhead-check.txt | grep -v Warn
for order in a b; do
T0=$(date +%s)
G=dense@4096,dense-gemv@4096,threshold0.5@4096,threshold0.5-gemv@4096
[ $order = b ] && G=threshold0.5-gemv@4096,threshold0.5@4096,dense-gemv@4096,dense@4096
timeout 270 python -m benchmarks.sweep --only generate --dynamic-capacity --generate $G --out /tmp/gen-$order > $OUT/gen-$order.txt 2>&1
cp /tmp/gen-$order/sweep.json $OUT/gen-$order.json 2>/dev/null
grep "ms/token" $OUT/gen-$order.txt | grep -v first; echo "$order took $(( $(date +%s) - T0 )) s"
done
echo "total $(( $(date +%s) - S0 )) s"

export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader; S0=$(date +%s)
for order in a b; do
T0=$(date +%s)
G=threshold0.5@4096,threshold0.5-gemv@4096
[ $order = b ] && G=threshold0.5-gemv@4096,threshold0.5@4096
timeout 150 python -m benchmarks.sweep --only generate --dynamic-capacity --generate $G --out /tmp/thr-$order > $OUT/thr-$order.txt 2>&1
cp /tmp/thr-$order/sweep.json $OUT/thr-$order.json 2>/dev/null
grep "ms/token\|FAILED" $OUT/thr-$order.txt | grep -v first; echo "$order took $(( $(date +%s) - T0 )) s"
done
T0=$(date +%s)
timeout 330 python -m benchmarks.sweep --only generate --dynamic-capacity --generate dense@32768,community-kv0.1-runs10@32768,community-kv0.1-runs10-whole@32768 --out /tmp/comm > $OUT/comm.txt 2>&1
cp /tmp/comm/sweep.json $OUT/comm.json 2>/dev/null
grep "ms/token\|FAILED" $OUT/comm.txt | grep -v first; echo "community took $(( $(date +%s) - T0 )) s"
echo "total $(( $(date +%s) - S0 )) s"

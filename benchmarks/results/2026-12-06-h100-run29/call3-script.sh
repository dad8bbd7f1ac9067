export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader; S0=$(date +%s)
timeout 100 python -m pytest -q -x tests/test_kernels.py -k "page_gaussians or opcheck or traces_through" -p no:cacheprovider > $OUT/tests.txt 2>&1; tail -2 $OUT/tests.txt
timeout 100 python -m pytest -q -x tests/test_entmax.py -p no:cacheprovider >> $OUT/tests.txt 2>&1; tail -2 $OUT/tests.txt
echo "tests took $(( $(date +%s) - S0 )) s"
cat > /tmp/variant.py <<'PY'
import contextlib, sys, unittest.mock as um
from policyzoo.kernels import reference
from policyzoo.kernels.ops import select_pages as select_op
from policyzoo.kv import entmax as entmax_mod

def einsum_gaussians(state, q):  # before: two einsums over the summaries
    c = state.cache
    return reference.page_gaussians(q, c.page_mean[state.layer], c.page_std[state.layer], state.scale)

def variant(name):
    stack = contextlib.ExitStack()
    if name == "old":
        stack.enter_context(um.patch.object(entmax_mod, "page_gaussians", einsum_gaussians))
        stack.enter_context(um.patch.object(select_op, "MAX_SCORES_ROW", 8192))
    return stack
PY
timeout 150 python - <<'PY' > $OUT/select.txt 2>&1
import sys; sys.path.insert(0, "/tmp")
from variant import variant
from benchmarks import select_bench
for v in ("old", "new"):
    print("variant", v, flush=True)
    with variant(v):
        select_bench.main(["--contexts", "131072", "--policies", "entmax-kv0.1", "--out", f"/tmp/select-{v}.json"])
PY
grep -v Warn $OUT/select.txt | grep -v "warnings.warn" | tail -14
for v in new old new2; do
T0=$(date +%s)
G=entmax-kv0.1@131072,quest0.1-sketch@131072; [ $v = new ] && G=dense@131072,$G
timeout 150 python - ${v%2} $G <<'PY2' > $OUT/gen-$v.txt 2>&1
import sys; sys.path.insert(0, "/tmp")
from variant import variant
from benchmarks import sweep
with variant(sys.argv[1]):
    sweep.main(["--only", "generate", "--dynamic-capacity", "--generate", sys.argv[2], "--out", f"/tmp/gen-{sys.argv[1]}"])
PY2
cp /tmp/gen-${v%2}/sweep.json $OUT/gen-$v.json 2>/dev/null
grep "ms/token" $OUT/gen-$v.txt | grep -v first; echo "$v took $(( $(date +%s) - T0 )) s"
done
echo "total $(( $(date +%s) - S0 )) s"

export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader; S0=$(date +%s)
python -c "import torch,triton,transformers,torch._inductor.config as c;print(torch.__version__,triton.__version__,transformers.__version__,'enable_pdl' in dir(c.triton))"
timeout 150 python benchmarks/results/2026-12-06-h100-run33/layout-experiment.py > $OUT/layout.txt 2>&1; tail -20 $OUT/layout.txt
echo "layout $(( $(date +%s) - S0 )) s"
for pdl in 0 1; do
  LEFT=$(( 575 - ($(date +%s) - S0) ))
  [ $pdl = 0 ] && LEFT=$(( LEFT / 2 ))
  TORCHINDUCTOR_ENABLE_PDL=$pdl timeout $LEFT python benchmarks/results/2026-12-06-h100-run34/pdl_check.py dense,threshold0.5 4096 8 $OUT/pdl$pdl.json > $OUT/pdl$pdl.txt 2>&1
  grep -v Warning $OUT/pdl$pdl.txt | tail -6; echo "pdl=$pdl done $(( $(date +%s) - S0 )) s"
done

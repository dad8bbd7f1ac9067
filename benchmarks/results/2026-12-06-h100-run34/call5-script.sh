export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline | head -1 || true
timeout 330 python -m pytest -q -x tests/test_kernels.py tests/test_kernel_config.py -p no:cacheprovider > $OUT/tests-kernels.txt 2>&1; tail -5 $OUT/tests-kernels.txt

"""Kernel benchmarks: each Triton kernel against its torch reference (pytest-benchmark).

    pytest benchmarks/bench_kernels.py                        # timings (meaningful on a GPU)
    pytest benchmarks/bench_kernels.py --benchmark-disable    # CPU smoke test: one run of each

Every benchmark also checks the kernel's output against the reference, so the smoke run in CI
checks something. On CPU the kernels run in the Triton interpreter (timings then say nothing about
the kernels, only that they run), which needs ``TRITON_INTERPRET=1`` before triton is first
imported; when triton was already imported in compiled mode (``pytest tests benchmarks``: the test
conftest imports transformers, which imports triton), one test re-runs this file in a fresh
interpreter. Sizes are tiny on CPU and decode-like on CUDA.
"""

import os
import sys

import torch

if torch.cuda.is_available():
    MODE = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1":
    MODE = "interpret"
elif "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
    MODE = "interpret"
else:
    MODE = "subprocess"

import functools  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from policyzoo import kernels  # noqa: E402
from policyzoo.kernels import reference as ref  # noqa: E402
from policyzoo.selection import Selection  # noqa: E402

DEVICE = torch.device("cuda" if MODE == "cuda" else "cpu")
TRITON_HERE = kernels.route.HAS_TRITON and MODE != "subprocess"
WORKSPACE = kernels.Workspace(DEVICE) if TRITON_HERE else None  # the GEMV's counters, as a Decoder makes them
IMPLS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(not TRITON_HERE, reason="no triton here"))]

# (batch, query heads, KV heads, head dim, cache slots, selected tokens)
ATTN = dict(cpu=(1, 8, 2, 64, 256, 64), cuda=(4, 32, 8, 128, 32768, 2048))[DEVICE.type]
# (batch, d_in, d_out, kept fraction)
GEMV = dict(cpu=(1, 256, 192, 0.5), cuda=(1, 4096, 14336, 0.5))[DEVICE.type]


@pytest.mark.skipif(MODE != "subprocess" or not kernels.route.HAS_TRITON, reason="the kernels run in this process")
def test_bench_in_fresh_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "--benchmark-disable"]
    res = subprocess.run(cmd, env=env, cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-20000:] + res.stderr[-5000:]


def timed(fn):
    """``fn`` with a device sync, so that a benchmark round covers the kernel and not just its launch."""
    if DEVICE.type != "cuda":
        return fn

    def run(*args, **kwargs):
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        return out

    return run


def close(actual, expected, dtype):
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(actual, expected, **tol)


def attention_inputs(block, dtype):
    b, h, h_kv, d, n, budget = ATTN
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, d, generator=g).to(dtype).to(DEVICE)
    keys = torch.randn(b, h_kv, n, d, generator=g).to(dtype).to(DEVICE)
    values = torch.randn(b, h_kv, n, d, generator=g).to(dtype).to(DEVICE)
    k_max = budget // block
    # A top-k-like selection: distinct entries, the last few rows' budgets partly unused.
    indices = torch.stack([torch.randperm(n // block, generator=g)[:k_max] for _ in range(b * h_kv)])
    indices = indices.view(b, h_kv, k_max).to(torch.int32).to(DEVICE)
    count = torch.full((b, h_kv), k_max, dtype=torch.int32)
    count[-1, -1] = k_max // 2
    sel = Selection(indices, count.to(DEVICE), None, block)
    start = torch.zeros(b, dtype=torch.int64, device=DEVICE)
    length = torch.tensor(n - 3, device=DEVICE)
    return q, keys, values, sel, start, length, d**-0.5


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("block", [1, 16])
@pytest.mark.parametrize("mode", ["softmax", "entmax15"])
def test_decode_attention(benchmark, impl, block, mode):
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    args = attention_inputs(block, dtype)
    reference = ref.decode_attention if mode == "softmax" else ref.decode_attention_entmax15
    benchmark.group = f"decode_attention {mode} block={block}"
    if impl == "reference":
        fn = reference
    else:
        def fn(*a):
            attend = kernels.decode_attention if mode == "softmax" else kernels.decode_attention_entmax15
            return attend.triton(*a)
    out, second = benchmark(timed(fn), *args)
    expected_out, expected_second = reference(*args)
    close(out.float(), expected_out.float(), dtype)
    close(second, expected_second, torch.float32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("agg", ["none", "max"])
def test_quest_page_bound(benchmark, impl, agg):
    b, h, h_kv, d, n, _ = ATTN
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, h, d, generator=g).to(DEVICE)
    centre = torch.randn(b, h_kv, n // 16, d, generator=g).to(DEVICE)
    page_min, page_max = centre - 0.5, centre + 0.5
    args = (q, page_min, page_max, d**-0.5)
    benchmark.group = f"quest_page_bound agg={agg}"
    if agg == "none":
        reference, kernel = ref.quest_page_bound, kernels.quest_page_bound.triton
    else:
        def reference(*a):
            return ref.quest_page_bound_grouped(*a, agg=agg)

        def kernel(*a):
            return kernels.quest_page_bound_grouped.triton(*a, agg=agg)
    got = benchmark(timed(reference if impl == "reference" else kernel), *args)
    close(got, reference(*args), torch.float32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["index", "threshold"])
def test_sparse_gemv(benchmark, impl, kind):
    b, d_in, d_out, keep = GEMV
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(2)
    x = torch.randn(b, d_in, generator=g).to(dtype).to(DEVICE)
    w_t = (torch.randn(d_in, d_out, generator=g) * d_in**-0.5).to(dtype).to(DEVICE)
    benchmark.group = f"sparse_gemv {kind}"
    if kind == "index":
        sparsity = x.abs().topk(int(keep * d_in), dim=-1).indices.to(torch.int32)
        reference, kernel = ref.sparse_gemv_index, functools.partial(kernels.sparse_gemv_index.triton, workspace=WORKSPACE)
    else:
        sparsity = torch.quantile(x.float().abs(), 1 - keep).to(DEVICE)
        reference, kernel = ref.sparse_gemv_threshold, functools.partial(kernels.sparse_gemv_threshold.triton,
                                                                         workspace=WORKSPACE)
    args = (x, sparsity, w_t, None)
    got = benchmark(timed(reference if impl == "reference" else kernel), *args)
    close(got.float(), reference(*args).float(), dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["output_major", "input_major"])
def test_dense_gemv(benchmark, impl, layout):
    """The dense GEMV of a decode row (the down projection's shape on CUDA) against cuBLAS (its
    reference, `F.linear`), in nn.Linear's layout and input-major."""
    b, d_in, d_out, _ = GEMV
    d_in, d_out = d_out, d_in  # the down projection: many inputs, fewer outputs
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(4)
    x = torch.randn(b, d_in, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(d_out, d_in, generator=g) * d_in**-0.5).to(dtype).to(DEVICE)
    benchmark.group = f"dense_gemv {layout}"
    if layout == "output_major":
        reference, kernel, weight = ref.dense_gemv, kernels.dense_gemv.triton, w
    else:
        reference, kernel, weight = ref.dense_gemv_t, kernels.dense_gemv_t.triton, w.t().contiguous()
    args = (x, weight, None)
    got = benchmark(timed(reference if impl == "reference" else functools.partial(kernel, workspace=WORKSPACE)), *args)
    close(got.float(), reference(*args).float(), dtype)

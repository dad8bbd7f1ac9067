"""The dense GEMV's Triton kernels (`kernels.dense_gemv`, `kernels.dense_gemv_t`) against their torch
references (`policyzoo.kernels.reference`).

Without a GPU the kernels run on CPU tensors through the Triton interpreter. Triton decides between
compiled and interpreted kernels when each ``@triton.jit`` function is defined, so
``TRITON_INTERPRET=1`` must be in the environment before triton is first imported. This module sets
it first thing when it can (on CPU, when triton is not yet loaded); when triton is loaded already in
compiled mode, a single test re-runs this file in a fresh interpreter with the variable set
(`triton_mode.run_in_fresh_interpreter`).

Every example draws fresh random inputs (seeded by hypothesis), and every buffer the kernels allocate
— outputs and split-K partials — starts as NaN, so an output element the kernel forgets to write, or
a partial it reads without having written it, fails the test.
"""

from triton_mode import MODE, poisoned, run_in_fresh_interpreter  # first: it may set TRITON_INTERPRET before triton loads

import torch  # noqa: E402

from unittest import mock  # noqa: E402

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton")

from policyzoo import kernels  # noqa: E402
from policyzoo.kernels import DenseGemvConfig, route  # noqa: E402
from policyzoo.kernels import reference as ref  # noqa: E402
from policyzoo.kernels.config import override  # noqa: E402
from policyzoo.kernels.ops import dense_gemv as dense_op  # noqa: E402

pytestmark = pytest.mark.skipif(not route.HAS_TRITON, reason="triton does not import here")
# Every test but the subprocess runner runs in this process only when the kernels can run here.
here = pytest.mark.skipif(MODE == "subprocess", reason="run by test_dense_gemv_in_fresh_interpreter")

DEVICE = torch.device("cuda" if MODE == "cuda" else "cpu")
if route.HAS_TRITON:
    from policyzoo.kernels.ops.dense_gemv import kernel as dense_kernel  # noqa: E402
# The arrival counters, as a Decoder on CUDA makes them: every launch must leave them zero.
WORKSPACE = kernels.Workspace(DEVICE) if MODE != "subprocess" else None

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
SETTINGS = settings(max_examples=60, deadline=None, database=None)


@pytest.mark.skipif(MODE != "subprocess", reason="the kernels run in this process")
def test_dense_gemv_in_fresh_interpreter():
    run_in_fresh_interpreter(__file__)


def kernel_buffers_poisoned():
    """Every buffer the kernels allocate starts as NaN (integer buffers as -7)."""
    return poisoned(dense_kernel)


def workspace_is_zero() -> bool:
    return all(int(b.abs().sum()) == 0 for b in WORKSPACE.buffers.values())


def randn(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@st.composite
def dense_cases(draw):
    """Inputs of either layout and a launch config: tiles that d_in and d_out need not divide, one
    slice or several, the epilogue fused (from 2 slices up) or launched, rows one per program or in
    tl.dot row blocks."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    b = draw(st.integers(1, 5))
    d_in = draw(st.one_of(st.integers(1, 200), st.sampled_from([64, 128])))  # ragged, or whole tiles
    d_out = draw(st.one_of(st.integers(1, 90), st.sampled_from([32, 64])))
    input_major = draw(st.booleans())
    weight = randn(g, d_out, d_in, dtype=dtype)  # output-major: nn.Linear's layout
    # Input-major as stored (contiguous), or as the transposed view of an nn.Linear weight; the
    # output-major weight as stored, or as the transposed view of an input-major one.
    view = draw(st.booleans())
    if input_major:
        w = weight.t() if view else weight.t().contiguous()
    else:
        w = weight.t().contiguous().t() if view else weight
    bias = randn(g, d_out, dtype=dtype) if draw(st.booleans()) else None
    cfg = DenseGemvConfig(
        block_n=draw(st.sampled_from([0, 16, 32])),
        block_k=draw(st.sampled_from([0, 16, 64])),
        num_warps=draw(st.sampled_from([1, 2, 4])),
        split=draw(st.sampled_from([0, 1, 2, 5])),  # slices of the inputs (split-K); 0: by shape
        fuse_epilogue=draw(st.booleans()),
        min_fused_split=2,
        target_programs=draw(st.sampled_from([1, 64])),
        min_tiles_per_split=1,
        sum_block=draw(st.sampled_from([16, 1024])),
        dot_from_rows=draw(st.sampled_from([2, 6])),  # 6: one program per row at every batch here
    )
    lead = draw(st.sampled_from([(b,), (1, b)]))  # leading dims: [B, d_in] or [1, B, d_in]
    x = randn(g, *lead, d_in, dtype=dtype)
    return dict(x=x, w=w, weight=weight, bias=bias, dtype=dtype, input_major=input_major, cfg=cfg)


def assert_dense_close(got, expected, dtype):
    assert got.dtype == expected.dtype and got.shape == expected.shape and not got.isnan().any()
    # Both sides round a sum of d_in products to the output dtype: scale atol by the output size.
    tol = TOL[dtype]
    scale = expected.float().abs().max().item() + 1
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol["rtol"], atol=tol["atol"] * scale)


@here
@SETTINGS
@given(case=dense_cases())
def test_dense_gemv_matches_the_reference(case):
    x, w, bias, cfg = case["x"], case["w"], case["bias"], case["cfg"]
    op, spec = (kernels.dense_gemv_t, ref.dense_gemv_t) if case["input_major"] else (kernels.dense_gemv, ref.dense_gemv)
    with kernel_buffers_poisoned(), override(dense_gemv=cfg):
        got = op.triton(x, w, bias, workspace=WORKSPACE)
    if case["dtype"] == torch.float32:
        expected = spec(x, w, bias)
    else:  # the products exact and summed in fp32, rounded once (the reference rounds twice with a bias)
        expected = spec(x.float(), w.float(), None if bias is None else bias.float()).to(case["dtype"])
    assert_dense_close(got, expected, case["dtype"])
    assert workspace_is_zero(), "the arrival counters were left set"
    if case["dtype"] == torch.float32:  # both layouts compute the same function of the same weight
        assert_dense_close(expected, ref.dense_gemv(x, case["weight"], bias), torch.float32)


@here
@pytest.mark.parametrize("input_major", [False, True])
@pytest.mark.parametrize("b", [1, 4, 16])
def test_fused_split_leaves_the_counters_zero(input_major, b):
    """A split that the last program of each block sums, twice in a row on one workspace: the second
    launch finds the counters zero, as the first left them."""
    g = torch.Generator().manual_seed(b)
    x, weight, bias = randn(g, b, 96), randn(g, 40, 96), randn(g, 40)
    w = weight.t().contiguous() if input_major else weight
    op = kernels.dense_gemv_t if input_major else kernels.dense_gemv
    cfg = DenseGemvConfig(block_n=16, block_k=16, split=3, min_fused_split=2)
    with override(dense_gemv=cfg):
        launched = dense_op.dense_gemv_config(96, 40, b, input_major)
        assert (launched.split, launched.fuse_epilogue) == (3, True)
        for _ in range(2):
            with kernel_buffers_poisoned():
                got = op.triton(x, w, bias, workspace=WORKSPACE)
            assert workspace_is_zero()
            torch.testing.assert_close(got, ref.dense_gemv(x, weight, bias), rtol=1e-4, atol=1e-4)


@here
def test_public_functions_route_and_keep_leading_dims(monkeypatch):
    """Under POLICYZOO_TRITON=1 the public functions call the kernels (a 1-D x too); off it, the
    references, bit for bit on CPU."""
    g = torch.Generator().manual_seed(1)
    x, weight = randn(g, 2, 3, 50), randn(g, 30, 50)
    monkeypatch.setenv("POLICYZOO_TRITON", "1")
    with mock.patch.object(dense_kernel, "launch", wraps=dense_kernel.launch) as launch:
        y = kernels.dense_gemv(x, weight)
        y_t = kernels.dense_gemv_t(x[0, 0], weight.t())
    assert launch.call_count == 2 and y.shape == (2, 3, 30) and y_t.shape == (30,)
    torch.testing.assert_close(y, ref.dense_gemv(x, weight), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y_t, ref.dense_gemv_t(x[0, 0], weight.t()), rtol=1e-4, atol=1e-4)
    monkeypatch.delenv("POLICYZOO_TRITON")
    if DEVICE.type == "cpu":
        assert torch.equal(kernels.dense_gemv(x, weight), ref.dense_gemv(x, weight))


@here
def test_bad_shapes_raise():
    x, w = torch.randn(2, 8, device=DEVICE), torch.randn(8, 6, device=DEVICE)
    for fn in (kernels.dense_gemv.triton, torch.ops.policyzoo.dense_gemv):
        with pytest.raises(ValueError, match="d_in"):
            fn(x, w, None)  # an input-major weight where an output-major one belongs
    with pytest.raises(ValueError, match="d_in"):
        kernels.dense_gemv_t.triton(x, w.t())
    with pytest.raises(ValueError, match="d_in"):
        kernels.dense_gemv_t.triton(x, w[None])  # not 2-D
    with pytest.raises(ValueError, match="bias"):
        kernels.dense_gemv_t.triton(x, w, torch.randn(5, device=DEVICE))
    with pytest.raises(ValueError, match="dtype"):
        kernels.dense_gemv_t.triton(x, w.to(torch.bfloat16))


@here
def test_empty_batch_and_single_input():
    w = torch.randn(1, 7, device=DEVICE)
    assert kernels.dense_gemv_t.triton(torch.randn(0, 1, device=DEVICE), w).shape == (0, 7)
    x = torch.randn(3, 1, device=DEVICE)
    torch.testing.assert_close(kernels.dense_gemv_t.triton(x, w), ref.dense_gemv_t(x, w))


def test_config_by_shape():
    rule = dense_op.dense_gemv_config
    o = rule(4096, 4096, 1, False)  # one row output-major: 256 blocks of 16 whole rows, 8 warps
    assert (o.block_n, o.block_k, o.num_warps, o.split, o.fuse_epilogue) == (16, 512, 8, 1, False)
    split_o = rule(4096, 4096, 1, True)  # input-major: split by the program target, 4 warps
    assert (split_o.block_n, split_o.num_warps, split_o.split, split_o.fuse_epilogue) == (64, 4, 8, True)
    qkv = rule(4096, 6144, 1, True)  # 96 blocks of 64: 6 slices of 5.33 tiles -> 6 slices of 768
    assert (qkv.block_n, qkv.block_k, qkv.split) == (64, 128, 6)
    head = rule(4096, 128256, 1, False)  # 8016 blocks: no split
    assert (head.split, head.fuse_epilogue) == (1, False)
    rows = rule(4096, 4096, 4, False)  # row blocks through tl.dot
    assert (rows.block_n, rows.block_k) == (64, 64)
    assert rule(20, 10, 1, False).block_k == 32  # tiles no wider than the inputs
    assert rule(4096, 4096, 4, False).num_warps == 4
    with override(dense_gemv=DenseGemvConfig(block_n=8, block_k=8, split=5, fuse_epilogue=False)):
        assert (rule(4096, 64, 1, True).block_n, rule(4096, 64, 1, True).split) == (8, 5)
        assert (rule(4096, 64, 4, True).block_n, rule(4096, 64, 4, True).block_k) == (16, 16)  # tl.dot's size
        assert not rule(4096, 64, 1, True).fuse_epilogue
        assert rule(20, 64, 1, True).split == 3  # rounded to whole tiles: 20 inputs in 3 slices of 8


@pytest.mark.parametrize("fields, message", [
    (dict(block_n=48), "block_n must be a power of two or 0"),
    (dict(block_k=-16), "block_k must be a power of two or 0"),
    (dict(split=-1), "split must be an int >= 0"),
    (dict(block_b=8), "block_b must be 16 at least"),
    (dict(fuse_epilogue=1), "fuse_epilogue must be a bool"),
    (dict(min_fused_split=0), "min_fused_split must be a positive int"),
])
def test_invalid_config_fields_raise(fields, message):
    with pytest.raises(ValueError, match=f"DenseGemvConfig.{message}"):
        DenseGemvConfig(**fields)


@here
def test_custom_ops_opcheck():
    """Schemas, fake (meta) implementations and dispatcher registrations are consistent, with a
    workspace's counters too (left as they were found: not a mutation)."""
    checks = "test_schema", "test_faketensor"
    x, w_t, bias = torch.randn(2, 40, device=DEVICE), torch.randn(40, 24, device=DEVICE), torch.randn(24, device=DEVICE)
    torch.library.opcheck(torch.ops.policyzoo.dense_gemv.default, (x, w_t.t().contiguous(), bias), test_utils=checks)
    torch.library.opcheck(torch.ops.policyzoo.dense_gemv_t.default, (x, w_t, None), test_utils=checks)
    with override(dense_gemv=DenseGemvConfig(split=3, block_k=16)):
        torch.library.opcheck(torch.ops.policyzoo.dense_gemv_t.default, (x, w_t, bias, WORKSPACE.gemv_counters),
                              test_utils=checks)


@here
def test_torch_compile_traces_through(monkeypatch):
    """A compiled step that calls both ops with a `Workspace` traces without graph breaks (fullgraph),
    agrees with eager and leaves the workspace zero."""
    monkeypatch.setenv("POLICYZOO_TRITON", "1")
    g = torch.Generator().manual_seed(3)
    x, weight, w_t = randn(g, 1, 2, 96), randn(g, 48, 96), randn(g, 48, 64)

    def step(x, weight, w_t):
        h = kernels.dense_gemv(x, weight, workspace=WORKSPACE)
        return kernels.dense_gemv_t(h * 2, w_t, workspace=WORKSPACE)

    torch._dynamo.reset()
    with override(dense_gemv=DenseGemvConfig(split=3, block_k=16)):
        got = torch.compile(step, fullgraph=True, backend="aot_eager")(x, weight, w_t)
        want = step(x, weight, w_t)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, ref.dense_gemv_t(ref.dense_gemv(x, weight) * 2, w_t), rtol=1e-4, atol=1e-4)
    assert workspace_is_zero()

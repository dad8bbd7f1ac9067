"""The Triton kernels against their torch references (`policyzoo.kernels.reference`).

Without a GPU the kernels run on CPU tensors through the Triton interpreter. Triton decides between
compiled and interpreted kernels when each ``@triton.jit`` function is defined, its own standard
library included, so ``TRITON_INTERPRET=1`` must be in the environment before triton is first
imported. This module sets it first thing when it can (on CPU, when triton is not yet loaded). In a
pytest session triton is usually loaded already — conftest imports policyzoo, whose transformers
import pulls in torch._dynamo, which imports triton — and then a single test re-runs this file in a
fresh interpreter with the variable set (``TRITON_INTERPRET=1 pytest ...`` avoids the detour).

Every example draws fresh random inputs (seeded by hypothesis), and every buffer the kernels allocate
— outputs and scratch — starts as NaN, so an output element the kernel forgets to write, or a
scratch element it reads without having written it, fails the test.
"""

import os
import sys

import torch

if torch.cuda.is_available():
    MODE = "cuda"  # test the compiled kernels
elif os.environ.get("TRITON_INTERPRET") == "1":
    MODE = "interpret"  # set before the process started
elif "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
    MODE = "interpret"
else:
    MODE = "subprocess"  # triton loaded in compiled mode: interpreted kernels cannot run in this process

import subprocess  # noqa: E402
from contextlib import ExitStack, contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402
from unittest import mock  # noqa: E402

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton")

from policyzoo import kernels  # noqa: E402
from policyzoo.kernels import dispatch  # noqa: E402
from policyzoo.kernels import reference as ref  # noqa: E402
from policyzoo.selection import Selection  # noqa: E402

pytestmark = pytest.mark.skipif(not dispatch.HAS_TRITON, reason="triton does not import here")
# Every test but the subprocess runner runs in this process only when the kernels can run here.
here = pytest.mark.skipif(MODE == "subprocess", reason="run by test_kernels_in_fresh_interpreter")

DEVICE = torch.device("cuda" if MODE == "cuda" else "cpu")
KERNEL_MODULES = tuple(m for m in (dispatch._attn, dispatch._page, dispatch._gemv, dispatch._select) if m is not None)


@pytest.mark.skipif(MODE != "subprocess", reason="the kernels run in this process")
def test_kernels_in_fresh_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"]
    res = subprocess.run(cmd, env=env, cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-20000:] + res.stderr[-5000:]


TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
SETTINGS = settings(max_examples=20, deadline=None, database=None)
ATTENTION_SETTINGS = settings(max_examples=25, deadline=None, database=None)


@contextmanager
def poisoned():
    """Make every buffer the kernels allocate start as NaN (integer buffers as -7)."""

    def alloc(*shape, dtype, device):
        return torch.full(shape, float("nan") if dtype.is_floating_point else -7, dtype=dtype, device=device)

    with ExitStack() as stack:
        for mod in KERNEL_MODULES:
            stack.enter_context(mock.patch.object(mod, "_alloc", alloc))
        yield


def assert_close(actual, expected, dtype, scale=1.0):
    """Closeness at the tolerance of ``dtype``; ``scale`` widens atol for outputs of large magnitude."""
    tol = TOL[dtype]
    torch.testing.assert_close(actual, expected, rtol=tol["rtol"], atol=tol["atol"] * scale, equal_nan=False)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


# --------------------------------------------------------------------------------------------------
# Decode attention


@st.composite
def attention_cases(draw, dtypes=(torch.float32, torch.bfloat16)):
    """Random decode-attention inputs: a cache, a token or page Selection with padding, left padding."""
    g_rand = gen(draw(st.integers(0, 2**31 - 1)))
    dtype = draw(st.sampled_from(dtypes))
    d = draw(st.sampled_from([64, 128]))
    b = draw(st.integers(1, 2))
    h_kv = draw(st.integers(1, 2))
    group = draw(st.integers(1, 8))
    block = draw(st.sampled_from([1, 16, 64]))
    if block == 1:
        n = draw(st.integers(1, 45)) * 2 + 1  # odd cache lengths
        k_max = draw(st.integers(1, 40))
    else:
        n = draw(st.integers(1, 3)) * block  # the cache capacity is a whole number of pages
        k_max = draw(st.integers(1, n // block + 1))
    length = draw(st.integers(0, n))
    start = [draw(st.integers(0, length)) for _ in range(b)]
    n_entries = n // block
    # Real entries index the cache; padding entries (at or past count) hold garbage that must never
    # be dereferenced, including ids far out of range.
    indices = torch.randint(0, n_entries, (b, h_kv, k_max), generator=g_rand, dtype=torch.int32)
    count = torch.randint(0, k_max + 1, (b, h_kv), generator=g_rand, dtype=torch.int32)
    if draw(st.booleans()):
        count[0, 0] = 0  # an empty selection
    garbage = torch.randint(-(2**20), 2**20, (b, h_kv, k_max), generator=g_rand, dtype=torch.int32)
    indices = torch.where(torch.arange(k_max) < count.unsqueeze(-1), indices, garbage)
    log_weight = randn(g_rand, b, h_kv, k_max) if draw(st.booleans()) else None
    sharpness = draw(st.sampled_from([1.0, 4.0]))  # sharper logits make entmax sparser
    q = (randn(g_rand, b, h_kv * group, d) * sharpness).to(dtype)
    keys = randn(g_rand, b, h_kv, n, d, dtype=dtype)
    values = randn(g_rand, b, h_kv, n, d, dtype=dtype)
    sel = Selection(indices.to(DEVICE), count.to(DEVICE), log_weight, block)
    chunk = draw(st.sampled_from([0, 1, 2, 3, 7]))  # entries per program; 1 gives > 32 chunks to merge
    return dict(
        q=q, keys=keys, values=values, sel=sel,
        start=torch.tensor(start, dtype=torch.int64, device=DEVICE),
        length=torch.tensor(length, dtype=torch.int64, device=DEVICE),
        scale=d**-0.5, chunk=chunk, dtype=dtype,
    )


def run_attention(case, mode):
    args = (case["q"], case["keys"], case["values"], case["sel"], case["start"], case["length"], case["scale"])
    with poisoned():
        out, second = dispatch.decode_attention(*args, mode=mode, chunk=case["chunk"])
    reference = ref.decode_attention if mode == "softmax" else ref.decode_attention_entmax15
    ref_out, ref_second = reference(*args)
    return out, second, ref_out, ref_second


@here
@ATTENTION_SETTINGS
@given(case=attention_cases(), merge=st.sampled_from([(0, 128), (0, 16), (32, 128)]))
def test_decode_attention_softmax(case, merge):
    """``merge``: the merge's (BLOCK_C, MAX_BLOCK_C), i.e. every chunk in one step, in steps of at
    most 16 (with > 16 chunks), or in fixed steps of 32."""
    with mock.patch.object(dispatch._attn, "BLOCK_C", merge[0]), mock.patch.object(dispatch._attn, "MAX_BLOCK_C", merge[1]):
        out, lse, ref_out, ref_lse = run_attention(case, "softmax")
    assert out.dtype == case["q"].dtype and out.shape == ref_out.shape
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    assert not out.isnan().any() and not lse.isnan().any()
    assert_close(out.float(), ref_out.float(), case["dtype"])
    assert_close(lse, ref_lse, torch.float32)  # lse is fp32 arithmetic even from bf16 inputs


@here
@ATTENTION_SETTINGS
@given(case=attention_cases())
def test_decode_attention_entmax15(case):
    out, tau, ref_out, ref_tau = run_attention(case, "entmax15")
    assert out.dtype == case["q"].dtype and tau.dtype == torch.float32
    assert not out.isnan().any() and not tau.isnan().any()
    assert_close(out.float(), ref_out.float(), case["dtype"])
    assert_close(tau, ref_tau, torch.float32)


@here
@pytest.mark.parametrize("mode", ["softmax", "entmax15"])
@pytest.mark.parametrize("block", [1, 16])
def test_decode_attention_empty(mode, block):
    """No visible entry (count 0, or every selected slot outside start..length): out 0, lse/tau -inf."""
    g_rand = gen(0)
    b, h_kv, group, n, d = 2, 2, 4, 64, 64
    q = randn(g_rand, b, h_kv * group, d)
    keys, values = randn(g_rand, b, h_kv, n, d), randn(g_rand, b, h_kv, n, d)
    indices = torch.zeros(b, h_kv, 3, dtype=torch.int32, device=DEVICE)  # slot/page 0: left padding in row 1
    count = torch.tensor([[0, 0], [3, 3]], dtype=torch.int32, device=DEVICE)
    sel = Selection(indices, count, randn(g_rand, b, h_kv, 3), block)
    start = torch.tensor([0, block + 1], device=DEVICE)
    length = torch.tensor(n, device=DEVICE)
    with poisoned():
        out, second = dispatch.decode_attention(q, keys, values, sel, start, length, d**-0.5, mode=mode, chunk=1)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(second, torch.full_like(second, -torch.inf))


@here
@settings(max_examples=10, deadline=None, database=None)
@given(case=attention_cases(dtypes=(torch.float32,)))
def test_entmax15_kernel_weights_sum_to_one(case):
    """With all values 1 the output is Σp: 1 for a row with a visible entry, 0 otherwise."""
    values = torch.ones_like(case["values"])
    args = (case["q"], case["keys"], values, case["sel"], case["start"], case["length"], case["scale"])
    out, tau = dispatch.decode_attention(*args, mode="entmax15", chunk=case["chunk"])
    nonempty = torch.isfinite(tau)
    expected = torch.where(nonempty, 1.0, 0.0).unsqueeze(-1).expand_as(out)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------------
# The entmax reference itself, against a plain bisection


def bisect_entmax15(x, iters=200):
    """``p = max(0, x − tau)²`` with Σp = 1 along the last dim, by bisection in float64."""
    x = x.double()
    top = x.amax(-1, keepdim=True)
    lo, hi = top - 1, top.clone()  # mass(top - 1) >= 1 >= mass(top) = 0
    for _ in range(iters):
        mid = (lo + hi) / 2
        mass = (x - mid).clamp(min=0).pow(2).sum(-1, keepdim=True)
        lo, hi = torch.where(mass >= 1, mid, lo), torch.where(mass >= 1, hi, mid)
    tau = (lo + hi) / 2
    return (x - tau).clamp(min=0).pow(2), tau


@settings(max_examples=25, deadline=None, database=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 6),
    width=st.integers(1, 50),
    spread=st.sampled_from([0.1, 1.0, 10.0]),
)
def test_entmax15_reference_threshold(seed, rows, width, spread):
    x = torch.randn(rows, width, generator=gen(seed)) * spread
    hidden = torch.rand(rows, width, generator=gen(seed + 1)) < 0.3
    hidden[0] = True  # one row without candidates
    x = x.masked_fill(hidden, -torch.inf)
    tau = ref.entmax15_threshold(x)
    p = torch.where(x > tau, (x - tau) ** 2, 0.0)
    has = ~hidden.all(-1)
    assert torch.isneginf(tau[~has]).all() and torch.isfinite(tau[has]).all()
    assert (p[~has] == 0).all()
    torch.testing.assert_close(p.sum(-1)[has], torch.ones(int(has.sum())), rtol=1e-5, atol=1e-5)
    if has.any():
        p_bis, tau_bis = bisect_entmax15(x[has])
        torch.testing.assert_close(p[has].double(), p_bis, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(tau[has].double(), tau_bis, rtol=1e-5, atol=1e-6)
    assert (p[hidden] == 0).all()


def test_entmax15_reference_known_values():
    # Two equal scores share the mass; a score more than 1 above the rest takes all of it.
    tau = ref.entmax15_threshold(torch.tensor([[0.0, 0.0], [3.0, 1.0], [0.5, -torch.inf]]))
    torch.testing.assert_close(tau.squeeze(-1), torch.tensor([-(0.5**0.5), 2.0, -0.5]))
    # Sparse, unlike softmax: spread scores leave most entries at exactly zero.
    x = torch.linspace(-5, 5, 101).unsqueeze(0)
    tau = ref.entmax15_threshold(x)
    p = torch.where(x > tau, (x - tau) ** 2, 0.0)
    assert 0 < (p > 0).sum() < 10 and abs(p.sum().item() - 1) < 1e-5


def test_entmax15_reference_attention_matches_plain_entmax():
    """`decode_attention_entmax15` with a dense token selection is entmax over z/2 with z = scale·q·k."""
    g_rand = gen(3)
    b, h_kv, group, n, d = 2, 2, 3, 20, 16
    q = torch.randn(b, h_kv * group, d, generator=g_rand) * 3
    keys, values = (torch.randn(b, h_kv, n, d, generator=g_rand) for _ in range(2))
    indices = torch.arange(n, dtype=torch.int32).expand(b, h_kv, n).contiguous()
    sel = Selection(indices, torch.full((b, h_kv), n, dtype=torch.int32))
    start, length = torch.tensor([0, 4]), torch.tensor(n - 1)
    out, tau = ref.decode_attention_entmax15(q, keys, values, sel, start, length, 0.5)
    z = torch.einsum("bkgd,bknd->bkgn", q.view(b, h_kv, group, d), keys) * 0.5
    z = z.masked_fill(~ref.visible(start, length, n)[:, None, None, :], -torch.inf)
    p, _ = bisect_entmax15(z / 2)
    expected = torch.einsum("bkgn,bknd->bkgd", p.float(), values).reshape(b, -1, d)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# Page scores

PAGE_METHODS = dispatch._page.METHODS if dispatch._page is not None else ("loop",)


@contextmanager
def page_method(method: str):
    """The page-bound kernel computed by ``method`` (a module constant the sweep's probe sets)."""
    saved = dispatch._page.METHOD
    dispatch._page.METHOD = method
    try:
        yield
    finally:
        dispatch._page.METHOD = saved


@here
@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    d=st.sampled_from([8, 64, 128]),  # 8: below tl.dot's minimum, the loop
    b=st.integers(1, 2),
    h_kv=st.integers(1, 2),
    group=st.integers(1, 8),
    pages=st.integers(1, 37),
    agg=st.sampled_from(["none", "max", "sum"]),
    width=st.sampled_from([0.0, 1.0]),
    summaries_like_q=st.booleans(),
    method=st.sampled_from(PAGE_METHODS),
)
def test_quest_page_bound(seed, dtype, d, b, h_kv, group, pages, agg, width, summaries_like_q, method):
    g_rand = gen(seed)
    q = randn(g_rand, b, h_kv * group, d, dtype=dtype)
    centre = randn(g_rand, b, h_kv, pages, d)
    # width 0: single-key pages (min == max), whose bounds are often negative for every head.
    half = randn(g_rand, b, h_kv, pages, d).abs() * width
    page_min, page_max = centre - half, centre + half
    if summaries_like_q:  # the cache keeps its extremes in its own dtype (exact)
        page_min, page_max = page_min.to(dtype), page_max.to(dtype)
    scale = d**-0.5
    with poisoned(), page_method(method):
        if agg == "none":
            got = dispatch.quest_page_bound(q, page_min, page_max, scale)
        else:
            got = dispatch.quest_page_bound_grouped(q, page_min, page_max, scale, agg)
    if agg == "none":
        expected = ref.quest_page_bound(q, page_min, page_max, scale)
    else:
        expected = ref.quest_page_bound_grouped(q, page_min, page_max, scale, agg)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    # The bound is fp32 arithmetic on exact (bf16 → fp32) inputs, whatever q's dtype.
    assert_close(got, expected, torch.float32, scale=expected.abs().max().item() + 1)


@here
@pytest.mark.parametrize("method", PAGE_METHODS)
@pytest.mark.parametrize("group", [3, 5])
def test_quest_page_bound_grouped_negative(group, method):
    """Groups padded to a power of two: the padding heads must not enter the max (all bounds < 0)."""
    q = torch.rand(2, 2 * group, 64, device=DEVICE) + 0.1
    centre = -torch.rand(2, 2, 7, 64, device=DEVICE) - 0.1
    with poisoned(), page_method(method):
        got = dispatch.quest_page_bound_grouped(q, centre, centre, 0.125, "max")
    expected = ref.quest_page_bound_grouped(q, centre, centre, 0.125, "max")
    assert (expected < 0).all()
    assert_close(got, expected, torch.float32)


# --------------------------------------------------------------------------------------------------
# Sparse GEMV


@st.composite
def gemv_cases(draw):
    g_rand = gen(draw(st.integers(0, 2**31 - 1)))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    b = draw(st.integers(1, 3))
    d_in = draw(st.integers(1, 300))  # > BLOCK_K (128), so that split-K has slices to split
    d_out = draw(st.integers(1, 130))
    x = randn(g_rand, b, d_in, dtype=dtype)
    if draw(st.booleans()):
        w_t = randn(g_rand, d_in, d_out, dtype=dtype)  # input-major, contiguous
    else:
        w_t = randn(g_rand, d_out, d_in, dtype=dtype).t()  # an nn.Linear weight read through .t()
    bias = randn(g_rand, d_out, dtype=dtype) if draw(st.booleans()) else None
    split = draw(st.sampled_from([0, 1, 2, 5]))  # slices of the inputs (split-K); 0 picks from the shapes
    return dict(x=x, w_t=w_t, bias=bias, dtype=dtype, g=g_rand, d_in=d_in, split=split)


def assert_gemv_close(got, expected, case):
    assert got.dtype == case["x"].dtype and got.shape == expected.shape and not got.isnan().any()
    # Both sides round sums of up to d_in products to the output dtype: scale atol by the output size.
    assert_close(got.float(), expected.float(), case["dtype"], scale=expected.float().abs().max().item() + 1)


@here
@SETTINGS
@given(case=gemv_cases(), frac=st.sampled_from([0.0, 0.1, 0.5, 1.0]))
def test_sparse_gemv_index(case, frac):
    b, d_in = case["x"].shape
    k = round(frac * d_in)
    idx = torch.stack([torch.randperm(d_in, generator=case["g"])[:k] for _ in range(b)]).to(torch.int32).to(DEVICE)
    with poisoned():
        got = dispatch.sparse_gemv_index(case["x"], idx, case["w_t"], case["bias"], split=case["split"])
    assert_gemv_close(got, ref.sparse_gemv_index(case["x"], idx, case["w_t"], case["bias"]), case)


@here
@SETTINGS
@given(case=gemv_cases(), quantile=st.sampled_from([0.0, 0.5, 0.9, None]))
def test_sparse_gemv_threshold(case, quantile):
    x = case["x"]
    # None: a threshold above every |x| (nothing kept: y = bias). A tensor threshold stays on device.
    t = float("inf") if quantile is None else torch.quantile(x.float().abs(), quantile).item()
    t_arg = torch.tensor(t, device=DEVICE) if quantile == 0.5 else t
    with poisoned():
        got = dispatch.sparse_gemv_threshold(x, t_arg, case["w_t"], case["bias"], split=case["split"])
    assert_gemv_close(got, ref.sparse_gemv_threshold(x, t, case["w_t"], case["bias"]), case)


@here
@SETTINGS
@given(case=gemv_cases(), p_keep=st.sampled_from([0.0, 0.3, 1.0]))
def test_sparse_linear_mask(case, p_keep):
    x, w_t = case["x"], case["w_t"]
    keep = (torch.rand(x.shape, generator=case["g"]) < p_keep).to(DEVICE)
    weight = w_t.t()  # nn.Linear layout [d_out, d_in]
    with poisoned():
        if case["split"] == 0:  # through sparse_linear: x [B, 1, d_in] and the nn.Linear weight
            got = dispatch.sparse_linear(x.unsqueeze(1), weight, case["bias"], keep.unsqueeze(1)).squeeze(1)
        else:
            got = dispatch.sparse_gemv_mask(x, keep, w_t, case["bias"], split=case["split"])
    assert_gemv_close(got, ref.sparse_linear(x, weight, case["bias"], keep), case)


# --------------------------------------------------------------------------------------------------
# Dispatch: the switch, the custom ops, torch.compile


def small_attention_args(seed=0, block=1):
    g_rand = gen(seed)
    b, h_kv, group, n, d = 2, 2, 2, 32, 64
    q = randn(g_rand, b, h_kv * group, d)
    keys, values = randn(g_rand, b, h_kv, n, d), randn(g_rand, b, h_kv, n, d)
    k_max = 6 if block == 1 else 2
    indices = torch.randint(0, n // block, (b, h_kv, k_max), generator=g_rand, dtype=torch.int32).to(DEVICE)
    sel = Selection(indices, torch.tensor([[k_max, 2], [0, 3]], dtype=torch.int32, device=DEVICE),
                    randn(g_rand, b, h_kv, k_max), block)
    return q, keys, values, sel, torch.tensor([0, 3], device=DEVICE), torch.tensor(29, device=DEVICE), d**-0.5


@here
def test_use_triton_switch(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.delenv("POLICYZOO_TRITON", raising=False)
    assert dispatch.use_triton(cpu) is False  # the CPU default stays on the references
    monkeypatch.setenv("POLICYZOO_TRITON", "1")
    assert dispatch.use_triton(cpu) is True
    monkeypatch.setattr(dispatch, "HAS_TRITON", False)
    assert dispatch.use_triton(cpu) is False


@here
def test_ops_route_through_kernels(monkeypatch):
    """`kernels.*` call the Triton ops under POLICYZOO_TRITON=1 and the references otherwise."""
    args = small_attention_args()
    q, sel = args[0], args[3]
    page_min = torch.randn(2, 2, 5, 64, device=DEVICE)
    page_max = page_min + 1
    x = torch.randn(2, 1, 40, device=DEVICE)
    weight, bias, keep = torch.randn(24, 40, device=DEVICE), torch.randn(24, device=DEVICE), x.abs() > 0.5
    monkeypatch.delenv("POLICYZOO_TRITON", raising=False)
    if DEVICE.type == "cpu":  # the default path is the reference, bit for bit
        torch.testing.assert_close(kernels.decode_attention(*args), ref.decode_attention(*args), rtol=0, atol=0)
    monkeypatch.setenv("POLICYZOO_TRITON", "1")
    calls = []
    monkeypatch.setattr(dispatch, "_need_triton", lambda: calls.append(1))  # counts custom-op calls
    out, lse = kernels.decode_attention(*args)
    bound = kernels.quest_page_bound(q, page_min, page_max, 0.125)
    y = kernels.sparse_linear(x, weight, bias, keep)
    assert len(calls) == 3
    torch.testing.assert_close((out, lse), ref.decode_attention(*args), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(bound, ref.quest_page_bound(q, page_min, page_max, 0.125), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y, ref.sparse_linear(x, weight, bias, keep), rtol=1e-4, atol=1e-4)
    assert sel.k_max == 6


@here
def test_custom_ops_opcheck():
    """Schemas, fake (meta) implementations and dispatcher registrations are consistent."""
    q, keys, values, sel, start, length, scale = small_attention_args(block=16)
    checks = "test_schema", "test_faketensor"
    for mode in ("softmax", "entmax15"):
        torch.library.opcheck(
            torch.ops.policyzoo.decode_attention.default,
            (q, keys, values, sel.indices, sel.count, sel.log_weight, sel.block, start, length, scale, mode, 1),
            test_utils=checks,
        )
    page_min = torch.randn(2, 2, 5, 64, device=DEVICE)
    for agg in ("none", "max"):
        torch.library.opcheck(
            torch.ops.policyzoo.quest_page_bound.default, (q, page_min, page_min + 1, 0.5, agg), test_utils=checks
        )
    x, w_t = torch.randn(2, 40, device=DEVICE), torch.randn(40, 24, device=DEVICE)
    idx = torch.stack([torch.randperm(40)[:10] for _ in range(2)]).to(torch.int32).to(DEVICE)
    torch.library.opcheck(torch.ops.policyzoo.sparse_gemv_index.default, (x, idx, w_t, None), test_utils=checks)
    torch.library.opcheck(
        torch.ops.policyzoo.sparse_gemv_threshold.default,
        (x, torch.tensor(0.5, device=DEVICE), w_t, None),
        test_utils=checks,
    )
    torch.library.opcheck(torch.ops.policyzoo.sparse_gemv_mask.default, (x, x > 0, w_t, None), test_utils=checks)


@here
def test_torch_compile_traces_through(monkeypatch):
    """A compiled step that calls the ops traces without graph breaks (fullgraph) and agrees."""
    monkeypatch.setenv("POLICYZOO_TRITON", "1")
    args = small_attention_args(block=16)
    q, keys, values, sel, start, length, scale = args

    def step(q, keys, values, indices, count, log_weight, start, length):
        s = Selection(indices, count, log_weight, 16)
        out, lse = kernels.decode_attention(q, keys, values, s, start, length, scale)
        return out * 2, lse

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(q, keys, values, sel.indices, sel.count, sel.log_weight, start, length)
    out, lse = ref.decode_attention(*args)
    torch.testing.assert_close(got, (out * 2, lse), rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------------
# Top-count selection


@here
@settings(max_examples=60, deadline=None, database=None)
@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 5),
    n=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    absolute=st.booleans(),
    ties=st.booleans(),
    infinities=st.booleans(),
    data=st.data(),
)
def test_select_top(seed, rows, n, dtype, absolute, ties, infinities, data):
    """Same positions as the reference, ties (frequent in bf16 and after rounding) included."""
    g = gen(seed)
    s = torch.randn(rows, n, generator=g)
    if ties:
        s = (s * 4).round() / 4  # many equal scores, ±0 among them
    if infinities:
        s[:, : n // 3] = -torch.inf  # invalid entries
        s[:, n - n // 4 :] = torch.inf  # forced entries
    s = s.to(dtype).to(DEVICE)
    k_max = data.draw(st.integers(0, n))
    count = torch.tensor(data.draw(st.lists(st.integers(0, k_max + 2), min_size=rows, max_size=rows)), device=DEVICE)
    if infinities and not absolute:  # callers never ask for invalid entries
        count = torch.minimum(count, (s > -torch.inf).sum(-1))
    with poisoned():
        got = dispatch.select_top(s, count, k_max, absolute)
    assert torch.equal(got, ref.select_top(s, count, k_max, absolute))


@here
def test_select_top_rows_longer_than_the_registers():
    """The kernel holds a row in registers and refuses a longer one; the library's seam sends such
    rows to the reference."""
    s = torch.randn(2, 300).to(DEVICE)
    count = torch.tensor([0, 17], device=DEVICE)
    with mock.patch.object(dispatch._select, "MAX_BLOCK_N", 64):
        with pytest.raises(ValueError, match="at most 64 entries"):
            dispatch._select.select_top(s, count, 20)
        with mock.patch.object(dispatch, "use_triton", lambda t: True):
            assert torch.equal(kernels.select_top(s, count, 20), ref.select_top(s, count, 20))


def _hard_rows(g, n):
    """Score rows that defeat a naive interpolation search: a few forced +inf above finite scores,
    two far-apart clusters, powers of two over 200 binades (few distinct keys), all equal."""
    return torch.stack([
        torch.cat([torch.full((5,), torch.inf), torch.randn(n - 5, generator=g)]),
        torch.where(torch.rand(n, generator=g) < 0.5, 1e-30, 1e30),
        2.0 ** torch.randint(-100, 100, (n,), generator=g).float(),
        torch.ones(n),
    ])


@here
@pytest.mark.parametrize("interp_steps", [0, 1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_select_top_search_paths(interp_steps, dtype):
    """Interpolating probes, halving probes and their switch-over select what the reference selects,
    on rows built to make interpolation slow (`_search` bounds the steps by halving after
    `INTERP_STEPS`)."""
    g = gen(11)
    s = _hard_rows(g, 700).to(dtype).to(DEVICE)
    for k in (1, 5, 6, 350, 699, 700):
        count = torch.full((4,), k, device=DEVICE)
        with mock.patch.object(dispatch._select, "INTERP_STEPS", interp_steps), poisoned():
            got = dispatch._select.select_top(s, count, k, absolute=dtype == torch.bfloat16)
        assert torch.equal(got, ref.select_top(s, count, k, absolute=dtype == torch.bfloat16)), (k, interp_steps)


@here
@pytest.mark.parametrize("n", [129, 150, 257, 4100])
def test_select_top_row_with_a_tail_tile(n):
    """A row just over a power of two is held as a tile and a small tail (`select_top.tiles`):
    the tail's keys are counted and emitted after the tile's, ties ranked across both."""
    block, tail = dispatch._select.tiles(n)
    assert 0 < tail < block and n <= block + tail
    g = gen(n)
    s = ((torch.randn(2, n, generator=g) * 2).round() / 2).to(DEVICE)  # ties across the boundary
    count = torch.tensor([n // 3, n - 1], device=DEVICE)
    with poisoned():
        got = dispatch._select.select_top(s, count, n)
    assert torch.equal(got, ref.select_top(s, count, n))


def test_select_top_reference_semantics():
    s = torch.tensor([[0.5, 2.0, -1.0, 2.0, 0.0, -torch.inf]])
    # the 3 largest: 2.0 (pos 1), 2.0 (pos 3), 0.5 (pos 0) -> ascending positions, then zeros
    assert ref.select_top(s, torch.tensor([3]), 5).tolist() == [[0, 1, 3, 0, 0]]
    # a tie at the boundary goes to the lower position; |x| with absolute
    assert ref.select_top(s, torch.tensor([1]), 2).tolist() == [[1, 0]]
    assert ref.select_top(torch.tensor([[-3.0, 1.0, 2.0]]), torch.tensor([2]), 2, absolute=True).tolist() == [[0, 2]]

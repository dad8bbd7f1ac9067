"""Tests of `policyzoo.kv.EntmaxKV` (support-aware page selection; entmax and softmax modes).

The oracle of α-entmax attention is the ``entmax`` package's ``entmax15`` (a test dependency),
applied to the dense logits of the visible tokens in float64.

The Triton kernel of the pooled threshold (`kernels/ops/entmax_threshold/kernel.py`) is checked against its
torch reference at the end. Without a GPU it runs in the Triton interpreter, which needs
``TRITON_INTERPRET=1`` before triton is first imported: set by conftest on CPU machines, and handled
here as in ``test_kernels.py`` (a fresh interpreter re-runs the kernel tests when triton was loaded
in compiled mode without a GPU).
"""

from __future__ import annotations

import os
import sys

from triton_mode import MODE, examples  # first: it may set TRITON_INTERPRET before triton loads

import torch  # noqa: E402

import math  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402
from unittest import mock  # noqa: E402

import pytest  # noqa: E402
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from policyzoo import kernels  # noqa: E402
from policyzoo.kernels import reference, route  # noqa: E402
from policyzoo.kernels import EntmaxThresholdConfig  # noqa: E402
from policyzoo.kernels.config import override  # noqa: E402
from policyzoo.kv import Dense, EntmaxKV, Quest  # noqa: E402
from policyzoo.kv.entmax import censored_relu_sq, gaussian_entmax_threshold, gaussian_relu_sq  # noqa: E402

SETTINGS = settings(max_examples=30, deadline=None)


@st.composite
def entmax_args(draw, modes=("gaussian", "topk"), attentions=("softmax", "entmax")):
    budget = draw(st.integers(1, 80)) if draw(st.booleans()) else draw(st.floats(1e-3, 1.0))
    return dict(
        budget=budget,
        mode=draw(st.sampled_from(modes)),
        attention=draw(st.sampled_from(attentions)),
        sinks=draw(st.integers(0, 8)),
        window=draw(st.integers(0, 20)),
        z=draw(st.sampled_from([0.0, 1.0, 3.0])),
    )


def dense_entmax(case) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p float64[B, H, N], o float64[B, H, D])``: full 1.5-entmax attention by the package (a test
    dependency, imported here so that a machine without it still runs the kernel tests below)."""
    entmax15 = pytest.importorskip("entmax").entmax15
    c = case.cache
    qg = case.q.double().view(case.b, case.h_kv, case.g, case.d)
    logits = torch.einsum("bkgd,bknd->bkgn", qg, c.keys[0].double()) * case.scale
    logits = logits.masked_fill(~case.token_valid()[:, None, None, :], -torch.inf)
    p = entmax15(logits, dim=-1)
    o = torch.einsum("bkgn,bknd->bkgd", p, c.values[0].double())
    return p.reshape(case.b, case.h, -1), o.reshape(case.b, case.h, -1)


def sparse_entmax(case, sel) -> torch.Tensor:
    c = case.cache
    out, _ = reference.decode_attention_entmax15(case.q, c.keys[0], c.values[0], sel, c.start, c.length, case.scale)
    return out.double()


def max_value_norm(case) -> torch.Tensor:
    c = case.cache
    tv = case.token_valid()
    vnorm = c.values[0].double().norm(dim=-1).masked_fill(~tv[:, None, :], 0.0).amax(-1)
    return vnorm.repeat_interleave(case.g, dim=1)  # [B, H]


# ------------------------------------------------------------------------------------ contract
@SETTINGS
@given(data=st.data(), args=entmax_args())
def test_entmaxkv_contract(data, cases, contract, args):
    case = data.draw(cases(page_sizes=(1, 4, 16)))
    policy = EntmaxKV(page=case.page, **args)
    assert policy.page_size == case.page and policy.attention == args["attention"]
    sel = policy.select(case.state(), case.q)
    assert sel.block == case.page and sel.log_weight is None
    contract.check_entries(sel, case, policy.sinks, policy.window, pages=True)
    if policy.mode == "topk":
        contract.check_budget(sel, case, policy.budget, policy.sinks, policy.window, pages=True)
    else:  # the budget is a cap
        for r in range(case.b):
            n_valid = len(case.visible_pages(r))
            want = math.ceil(policy.budget * n_valid - 1e-9) if isinstance(policy.budget, float) else -(-policy.budget // case.page)
            n_forced = len(case.forced_pages(r, policy.sinks, policy.window))
            assert bool((sel.count[r] <= max(want, n_forced)).all())
    if policy.attention == "softmax":
        contract.check_error_bound(sel, case)  # ‖o − ô‖ ≤ 2δ·max‖v‖


@SETTINGS
@given(data=st.data(), args=entmax_args(modes=("topk",)))
def test_topk_mode_is_quest(data, cases, args):
    case = data.draw(cases())
    sel = EntmaxKV(page=case.page, **args).select(case.state(), case.q)
    kw = {k: args[k] for k in ("budget", "sinks", "window")}
    quest = Quest(page=case.page, aggregate="max", **kw).select(case.state(), case.q)
    assert torch.equal(sel.indices, quest.indices) and torch.equal(sel.count, quest.count)


# ------------------------------------------------------------------------------- entmax oracle
@SETTINGS
@given(data=st.data(), args=entmax_args(attentions=("entmax",)))
def test_entmax_exact_on_support_and_bounded_otherwise(data, cases, args):
    """Exact when the selected tokens contain the entmax support; else ``‖o − ô‖ ≤ 2δ·max‖v‖``
    with ``δ`` the dense entmax mass outside the selection."""
    case = data.draw(cases())
    sel = EntmaxKV(page=case.page, **args).select(case.state(), case.q)
    p, o = dense_entmax(case)
    o_hat = sparse_entmax(case, sel)
    keep = sel.token_mask(case.cache.capacity).repeat_interleave(case.g, dim=1)  # [B, H, N]
    delta = (p * ~keep).sum(-1)  # dense entmax mass dropped
    err = (o - o_hat).norm(dim=-1)
    assert bool((err <= 2 * delta * max_value_norm(case) + 1e-4).all())
    covered = ((p > 0) & ~keep).sum(-1) == 0  # support inside the selection
    torch.testing.assert_close(o_hat[covered], o[covered], rtol=1e-4, atol=1e-4)


@SETTINGS
@given(data=st.data(), sinks=st.integers(0, 4), window=st.integers(0, 6))
def test_gaussian_on_one_token_pages_recovers_the_support(data, cases, sinks, window):
    """On 1-token pages the Gaussian model is exact (σ = 0, μ = z), so with an uncapped budget the
    selection is the forced pages plus exactly the entmax support, and entmax attention is exact."""
    case = data.draw(cases(page_sizes=(1,)))
    policy = EntmaxKV(budget=1.0, attention="entmax", page=1, sinks=sinks, window=window)
    sel = policy.select(case.state(), case.q)
    p, o = dense_entmax(case)
    p = p.view(case.b, case.h_kv, case.g, -1)
    for r in range(case.b):
        forced = case.forced_pages(r, sinks, window)
        for hk in range(case.h_kv):
            got = set(sel.indices[r, hk, : int(sel.count[r, hk])].tolist())
            support = set(torch.nonzero(p[r, hk].amax(0) > 1e-9).flatten().tolist())
            assert support <= got
            # Nothing outside the support but the forced entries (and entries on the support's edge).
            for t in got - forced - support:
                assert float(p[r, hk, :, t].max()) <= 1e-6
    torch.testing.assert_close(sparse_entmax(case, sel), o, rtol=1e-4, atol=1e-4)


def test_reference_entmax_matches_the_package(make_case):
    """The kernel reference over a dense selection is the package's entmax15 (the oracle mapping)."""
    case = make_case(b=2, h_kv=2, g=3, d=16, page=4, prompt=30, steps=3, starts=[0, 5], seed=3, sharp=3.0)
    _, o = dense_entmax(case)
    torch.testing.assert_close(sparse_entmax(case, Dense().select(case.state(), case.q)), o, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- threshold model
@settings(max_examples=50, deadline=None)
@given(x=st.lists(st.floats(-5, 5), min_size=1, max_size=30), reps=st.integers(1, 4))
def test_threshold_of_point_masses_is_exact(x, reps):
    """With σ = 0 and integer weights the pooled threshold is the exact entmax threshold."""
    m = torch.tensor(x, dtype=torch.float64)
    tau = gaussian_entmax_threshold(m, torch.zeros_like(m), torch.full_like(m, reps))
    exact = reference.entmax15_threshold(m.repeat(reps))
    assert abs(float(tau) - float(exact)) <= 1e-8


@settings(max_examples=30, deadline=None)
@given(pages=st.integers(1, 300), spread=st.sampled_from([0.1, 1.0, 10.0, 30.0]), seed=st.integers(0, 1000))
def test_threshold_solves_the_pooled_equation(pages, spread, seed):
    """``Σ_p n_p·E[(min(x_p, cap_p) − τ̂)_+²] = 1`` at the returned ``τ̂`` (Gaussian pools with caps)."""
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(4, pages, generator=gen, dtype=torch.float64) * spread
    s = torch.rand(4, pages, generator=gen, dtype=torch.float64) * spread * 0.5
    cap = m + torch.rand(4, pages, generator=gen, dtype=torch.float64) * spread
    n = torch.randint(1, 17, (4, pages), generator=gen).double()
    tau = gaussian_entmax_threshold(m, s, n, cap)
    mass = (n * censored_relu_sq(m, s, cap, tau)).sum(-1)
    torch.testing.assert_close(mass, torch.ones_like(mass), rtol=1e-6, atol=1e-6)
    assert bool((tau < cap.amax(-1, keepdim=True)).all())


@settings(max_examples=30, deadline=None)
@given(pages=st.integers(1, 3000), spread=st.sampled_from([0.1, 1.0, 10.0, 60.0]), seed=st.integers(0, 1000))
@example(pages=569, spread=60.0, seed=569)  # the largest gap found: 1.4e-10 relative
def test_threshold_stops_early_at_the_same_root(pages, spread, seed):
    """Leaving each precision's Newton steps once a step barely moves τ (`STOP_FLOAT32`,
    `STOP_FLOAT64`) gives the root that all 12 steps give, to 1e-9 relative: the last step skipped
    moves τ by about the square of the stopping step's relative move (at most 1e-6), times the
    pool's curvature, which a wide pool (spread 60) makes larger than 1e-10."""
    from policyzoo.kernels.ops.entmax_threshold import reference as threshold_reference

    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(3, pages, generator=gen) * spread
    s = torch.rand(3, pages, generator=gen) * spread * 0.3
    cap = m + torch.rand(3, pages, generator=gen) * spread
    n = torch.randint(1, 17, (3, pages), generator=gen)
    early = gaussian_entmax_threshold(m, s, n, cap)
    with mock.patch.object(threshold_reference, "STOP_FLOAT32", 0.0), mock.patch.object(threshold_reference, "STOP_FLOAT64", 0.0):
        full = gaussian_entmax_threshold(m, s, n, cap)
    torch.testing.assert_close(early, full, rtol=1e-9, atol=1e-10)


# What float32 Newton steps leave of the root, relative to the pool's scale ``1 + max_p (|m_p| + s_p)``
# (documented as about 1e-5; the worst of 1,500 pools of 1-3,000 pages spread over ±60 was 4.7e-6).
FLOAT32_ROOT_TOL = 2e-5


def near_root(tau: torch.Tensor, root: torch.Tensor, m: torch.Tensor, s: torch.Tensor) -> bool:
    """Whether ``tau`` is within `FLOAT32_ROOT_TOL` of the pool's scale of ``root`` on every live row
    (rows of ``m, s [..., P]``; -inf pages are out of the pool), and -inf exactly where it is."""
    scale = reference.pool_scale(m, s)
    finite = root > -torch.inf
    if not torch.equal(tau > -torch.inf, finite):
        return False
    return bool(((tau - root).abs()[finite] <= FLOAT32_ROOT_TOL * scale[finite]).all())


@settings(max_examples=30, deadline=None)
@given(pages=st.integers(1, 3000), spread=st.sampled_from([0.1, 1.0, 10.0, 60.0]), seed=st.integers(0, 1000),
       caps=st.booleans(), point_masses=st.booleans())
def test_threshold_in_float32_lands_near_the_float64_root(pages, spread, seed, caps, point_masses):
    """``float64_steps=0`` (every Newton step in float32, `EntmaxKV`'s default) gives the root of the
    float64 steps to within `FLOAT32_ROOT_TOL` of the pool's scale, on pools with and without caps
    and of point masses."""
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(3, pages, generator=gen, dtype=torch.float64) * spread
    s = torch.zeros_like(m) if point_masses else torch.rand(3, pages, generator=gen, dtype=torch.float64) * spread * 0.3
    cap = m + torch.rand(3, pages, generator=gen, dtype=torch.float64) * spread if caps else None
    n = torch.randint(1, 17, (3, pages), generator=gen).double()
    root = gaussian_entmax_threshold(m, s, n, cap)
    fast = gaussian_entmax_threshold(m, s, n, cap, 12, 0)
    assert near_root(fast, root, m, s), (fast - root).abs().max()


def test_threshold_float64_steps_must_not_be_negative():
    x = torch.zeros(1, 4)
    with pytest.raises(ValueError, match="float64_steps"):
        gaussian_entmax_threshold(x, x, x, None, 12, -1)


def test_gaussian_relu_sq_is_the_expectation():
    gen = torch.Generator().manual_seed(0)
    for c, s in [(0.3, 1.0), (-1.0, 0.5), (2.0, 0.1), (0.0, 2.0)]:
        x = c + s * torch.randn(400_000, generator=gen, dtype=torch.float64)
        mc = x.clamp(min=0).pow(2).mean()
        got = gaussian_relu_sq(torch.tensor(c, dtype=torch.float64), torch.tensor(s, dtype=torch.float64))
        assert abs(float(got) - float(mc)) <= 0.02 * (1 + float(mc))
    assert float(gaussian_relu_sq(torch.tensor(1.5), torch.tensor(0.0))) == pytest.approx(2.25)
    assert float(gaussian_relu_sq(torch.tensor(-1.5), torch.tensor(0.0))) == 0.0


def test_censored_expectation_is_the_expectation():
    gen = torch.Generator().manual_seed(1)
    for m, sd, cap, tau in [(0.0, 1.0, 0.5, -0.5), (1.0, 2.0, 1.5, 1.0), (-1.0, 0.5, 3.0, -2.0), (0.0, 1.0, 0.5, 0.7)]:
        x = (m + sd * torch.randn(400_000, generator=gen, dtype=torch.float64)).clamp(max=cap)
        mc = (x - tau).clamp(min=0).pow(2).mean()
        t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
        got = censored_relu_sq(t(m), t(sd), t(cap), t(tau))
        assert abs(float(got) - float(mc)) <= 0.02 * (1 + float(mc))


def test_threshold_of_empty_pool_is_minus_inf():
    m = torch.full((2, 3), -torch.inf)
    tau = gaussian_entmax_threshold(m, torch.zeros(2, 3), torch.zeros(2, 3))
    assert bool((tau == -torch.inf).all())


def test_budget_adapts_to_the_score_distribution(make_case):
    """A peaked query keeps fewer pages than a flat one under the same cap."""
    case = make_case(b=1, h_kv=1, g=1, d=16, page=4, prompt=64, steps=0, starts=[0], seed=1)
    c = case.cache
    q = torch.zeros(1, 1, 16)
    q[0, 0, 0] = 1.0
    keys = torch.randn(1, 1, 64, 16, generator=torch.Generator().manual_seed(2)) * 0.1
    keys[0, 0, 21, 0] = 40.0  # one needle, far above everything: the support is that token
    c.reset(torch.tensor([0]), 64)
    c.write_prefill(0, keys, keys)
    policy = EntmaxKV(budget=1.0, attention="entmax", page=4, sinks=0, window=0)
    state = case.state()
    peaked = policy.select(state, q * 4.0)
    flat = policy.select(state, q * 0.01)
    assert int(peaked.count) == 2 and set(peaked.indices[0, 0, :2].tolist()) == {5, 15}  # needle + last
    assert int(flat.count) == c.num_pages
    assert float(reference.decode_attention_entmax15(q * 4.0, c.keys[0], c.values[0], peaked, c.start, c.length, state.scale)[0][0, 0, 0]) == pytest.approx(40.0, rel=1e-5)


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        (dict(budget=0), ValueError, "budget"),
        (dict(budget=2.0), ValueError, "budget"),
        (dict(alpha=2.0), ValueError, "alpha"),
        (dict(mode="support"), ValueError, "mode"),
        (dict(attention="sparsemax"), ValueError, "attention"),
        (dict(page=0), ValueError, "page"),
        (dict(sinks=-1), ValueError, "sinks"),
        (dict(window=0.5), TypeError, "window"),
        (dict(z=float("nan")), ValueError, "z"),
        (dict(iters=0), ValueError, "iters"),
        (dict(float64_steps=-1), ValueError, "float64_steps"),
        (dict(float64_steps=True), TypeError, "float64_steps"),
        (dict(aggregate="mean"), ValueError, "aggregate"),
    ],
)
def test_entmaxkv_rejects_bad_args(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        EntmaxKV(**kwargs)


def test_entmaxkv_needs_matching_cache(make_case):
    case = make_case(b=1, h_kv=1, g=1, d=8, page=4, prompt=8, steps=0, starts=[0], seed=0)
    with pytest.raises(ValueError, match="page_size"):
        EntmaxKV(page=8).select(case.state(), case.q)


# ------------------------------------------------------------------------ threshold Triton kernel
# Kernel tests run in this process only when the kernel can run here (``threshold_kernel`` in their
# names: the subprocess runner selects them by it).
kernel_here = pytest.mark.skipif(
    not route.HAS_TRITON or MODE == "subprocess", reason="no triton, or run by test_threshold_kernel_in_fresh_interpreter"
)
KERNEL_DEVICE = torch.device("cuda" if MODE == "cuda" else "cpu")
KERNEL_SETTINGS = settings(max_examples=examples(20), deadline=None, database=None)


@pytest.mark.skipif(not route.HAS_TRITON or MODE != "subprocess", reason="the kernel runs in this process")
def test_threshold_kernel_in_fresh_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-k", "threshold_kernel"]
    res = subprocess.run(cmd, env=env, cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-20000:] + res.stderr[-5000:]


def _poisoned_alloc(*shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def threshold_kernel():
    """The threshold's Triton module (imported where triton is)."""
    from policyzoo.kernels.ops.entmax_threshold import kernel

    return kernel


def poisoned():
    """The kernel's output starts as NaN, so an unwritten row fails the comparison."""
    return mock.patch.object(threshold_kernel(), "_alloc", _poisoned_alloc)


@st.composite
def threshold_pools(draw):
    """``(m, s, n, cap)`` pools on the kernel's device: odd and multi-block page counts, point masses,
    pages out of the pool (``n = 0`` or ``m = -inf``), empty rows, caps or none."""
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    p = draw(st.integers(1, 64)) if draw(st.booleans()) else draw(st.integers(1000, 2500))
    if p > 64:
        lead = lead[:1]  # keep the interpreter's time down: few long rows
    shape = (*lead, p)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    spread = draw(st.sampled_from([0.1, 1.0, 10.0, 60.0]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    m = torch.randn(shape, generator=gen, dtype=torch.float64) * spread
    s_kind = draw(st.sampled_from(["zero", "some_zero", "random"]))
    s = torch.rand(shape, generator=gen, dtype=torch.float64) * spread * draw(st.sampled_from([0.05, 0.5, 1.0]))
    if s_kind == "zero":
        s = torch.zeros_like(s)  # point masses
    elif s_kind == "some_zero":
        s = torch.where(torch.rand(shape, generator=gen) < 0.5, 0.0, s)
    n = torch.randint(0, 17, shape, generator=gen)
    n = torch.where(torch.rand(shape, generator=gen) < draw(st.sampled_from([0.0, 0.3, 0.9])), 0, n)
    m = torch.where(torch.rand(shape, generator=gen) < draw(st.sampled_from([0.0, 0.3])), -torch.inf, m)
    rows = m.view(-1, p)
    if draw(st.booleans()):  # one row out of the pool entirely (either way)
        r = draw(st.integers(0, rows.shape[0] - 1))
        if draw(st.booleans()):
            rows[r] = -torch.inf
        else:
            n.view(-1, p)[r] = 0
    cap_kind = draw(st.sampled_from(["none", "finite", "mixed"]))
    cap = None
    if cap_kind != "none":
        cap = m.nan_to_num(neginf=0.0) + torch.rand(shape, generator=gen, dtype=torch.float64) * spread
        if cap_kind == "mixed":  # some +inf (uncensored), some below the mean (the mean guard)
            u = torch.rand(shape, generator=gen)
            cap = torch.where(u < 0.3, torch.inf, torch.where(u > 0.8, cap - 2 * spread, cap))
        cap = cap.to(dtype).to(KERNEL_DEVICE)
    n = n.to(draw(st.sampled_from([torch.int64, torch.float32])))
    iters = draw(st.sampled_from([1, 12]))
    float64_steps = draw(st.sampled_from([0, 3]))
    # Short rows walk several blocks too when the kernel's page block is shrunk.
    block = draw(st.sampled_from([16, 32, None])) if p <= 64 else None
    return (m.to(dtype).to(KERNEL_DEVICE), s.to(dtype).to(KERNEL_DEVICE), n.to(KERNEL_DEVICE), cap, iters, float64_steps,
            block)


@kernel_here
@KERNEL_SETTINGS
@given(pool=threshold_pools())
def test_threshold_kernel_matches_reference(pool):
    """The kernel is the reference's algorithm: with float64 steps the same τ̂ to ~1e-9, -inf for
    empty rows. With float32 steps alone (``float64_steps=0``) the kernel's sums round in another
    order than torch's, so each is held to the float64 root: within `FLOAT32_ROOT_TOL` of the
    pool's scale, and -inf on the same rows."""
    m, s, n, cap, iters, float64_steps, block = pool
    cfg = EntmaxThresholdConfig(block_p=block) if block else EntmaxThresholdConfig()
    with poisoned(), override(entmax_threshold=cfg):
        got = kernels.gaussian_entmax_threshold.triton(m, s, n, cap, iters, float64_steps)
    args = (m.cpu(), s.cpu(), n.cpu(), None if cap is None else cap.cpu(), iters)
    want = reference.gaussian_entmax_threshold(*args, float64_steps)
    assert got.dtype == torch.float64 and got.shape == (*m.shape[:-1], 1)
    if float64_steps or iters == 1:  # one float32 step from the same start: the same τ to float32's rounding
        tol = 1e-9 if float64_steps else 1e-5
        torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)
    else:
        pool = torch.where(n.cpu() > 0, m.cpu().double(), -torch.inf)
        assert near_root(got.cpu(), reference.gaussian_entmax_threshold(*args), pool, s.cpu().double())


@kernel_here
@pytest.mark.parametrize("pages, block", [(36, 32), (34, 32), (2052, None), (2049, None)])
def test_threshold_kernel_holds_a_slice_a_little_past_its_block(pages, block):
    """A slice a few pages past its block (a 128K cache's pages split four ways) is held as the
    block and a tail block (`tail_block`), and solves as the reference does."""
    from policyzoo.kernels.ops.entmax_threshold import entmax_threshold_config, tail_block

    cfg = EntmaxThresholdConfig(block_p=block) if block else EntmaxThresholdConfig()
    with override(entmax_threshold=cfg):
        settled = entmax_threshold_config(pages)
        assert tail_block(pages, settled.block_p) > 0  # the case under test: a tail, not the walk
        g = torch.Generator().manual_seed(pages)
        m = (torch.randn(2, pages, generator=g) * 4).to(KERNEL_DEVICE)
        s = torch.rand(2, pages, generator=g).to(KERNEL_DEVICE)
        n = torch.randint(1, 17, (2, pages), generator=g).to(KERNEL_DEVICE)
        m[1, -3:] += 30.0  # row 1's mass sits in the tail
        with poisoned():
            got = kernels.gaussian_entmax_threshold.triton(m, s, n, m + 2.0)
    want = reference.gaussian_entmax_threshold(m.cpu(), s.cpu(), n.cpu(), m.cpu() + 2.0)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-9, atol=1e-9)


@kernel_here
def test_threshold_kernel_edge_cases():
    """Broadcast inputs (page counts shared by the heads), one page, all pages out of the pool."""
    g = torch.Generator().manual_seed(3)
    m = torch.randn(2, 3, 37, generator=g).to(KERNEL_DEVICE)
    s = torch.rand(2, 3, 37, generator=g).to(KERNEL_DEVICE)
    n = torch.randint(0, 5, (2, 1, 37), generator=g).to(KERNEL_DEVICE).expand(2, 3, 37)
    with poisoned():
        got = kernels.gaussian_entmax_threshold.triton(m, s, n, m + 1.0)
        one = kernels.gaussian_entmax_threshold.triton(m[..., :1], s[..., :1] * 0, torch.ones_like(n[..., :1]))
        empty = kernels.gaussian_entmax_threshold.triton(m, s, torch.zeros_like(n))
    torch.testing.assert_close(got.cpu(), reference.gaussian_entmax_threshold(m.cpu(), s.cpu(), n.cpu(), m.cpu() + 1.0), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(one.cpu(), m[..., :1].double().cpu() - 1.0, rtol=1e-12, atol=1e-12)  # (x − τ)² = 1
    assert bool((empty == -torch.inf).all()) and empty.shape == (2, 3, 1)


def test_threshold_kernel_routing_defaults_to_the_reference(monkeypatch):
    """Without POLICYZOO_TRITON, CPU calls of `kernels.gaussian_entmax_threshold` are the reference."""
    monkeypatch.delenv("POLICYZOO_TRITON", raising=False)
    g = torch.Generator().manual_seed(0)
    m, s, n = torch.randn(2, 9, generator=g), torch.rand(2, 9, generator=g), torch.randint(0, 4, (2, 9), generator=g)
    assert torch.equal(kernels.gaussian_entmax_threshold(m, s, n, m + 0.5, 7), gaussian_entmax_threshold(m, s, n, m + 0.5, 7))


@kernel_here
def test_threshold_kernel_needs_the_interpreter_on_cpu(monkeypatch):
    monkeypatch.setattr(route, "INTERPRET", False)
    x = torch.zeros(1, 4)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.gaussian_entmax_threshold.triton(x, x, x)


@kernel_here
@pytest.mark.skipif(MODE == "cuda", reason="the cases are CPU tensors, which reach the kernel through the interpreter only")
@settings(max_examples=8, deadline=None, database=None)
@given(data=st.data(), args=entmax_args(modes=("gaussian",)), float64_steps=st.sampled_from([0, 3]))
def test_threshold_kernel_selects_like_the_reference(data, cases, args, float64_steps):
    """The kernel is what computes EntmaxKV's τ̂ on the kernel path (POLICYZOO_TRITON=1), from the
    reference path's inputs. With float64 steps it agrees with the reference to ~1e-12, and EntmaxKV
    selects the same pages either way. With float32 steps alone (the default) the kernel's sums
    round in another order than torch's, so a page whose margin lies within that rounding of zero
    may go either way: there τ̂ is held to the float64 root of its inputs (`near_root`) instead."""
    case = data.draw(cases(page_sizes=(1, 4, 16), max_prompt=64))
    policy = EntmaxKV(page=case.page, float64_steps=float64_steps, **args)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("POLICYZOO_TRITON", raising=False)
        want = policy.select(case.state(), case.q)
        calls = []
        launch = threshold_kernel().gaussian_entmax_threshold

        def counted(*a):
            calls.append((a[:6], launch(*a)))
            return calls[-1][1]

        mp.setattr(threshold_kernel(), "gaussian_entmax_threshold", counted)
        mp.setenv("POLICYZOO_TRITON", "1")
        with poisoned():
            got = policy.select(case.state(), case.q)
    assert len(calls) == 1
    (m, s, n, cap, iters, steps), tau = calls[0]
    assert steps == float64_steps and iters == policy.iters
    root = reference.gaussian_entmax_threshold(m.cpu(), s.cpu(), n.cpu(), cap.cpu(), iters)
    pool = torch.where(n.cpu() > 0, m.cpu().double(), -torch.inf)
    assert near_root(tau.cpu(), root, pool, s.cpu().double())
    if float64_steps == 0:
        return
    assert torch.equal(got.count, want.count)
    for r in range(case.b):
        for hk in range(case.h_kv):
            c = int(want.count[r, hk])
            assert sorted(got.indices[r, hk, :c].tolist()) == sorted(want.indices[r, hk, :c].tolist())


@kernel_here
def test_threshold_kernel_opcheck():
    """Schema and fake (meta) implementation of ``policyzoo::gaussian_entmax_threshold``."""
    g = torch.Generator().manual_seed(1)
    m = torch.randn(2, 3, 20, generator=g).to(KERNEL_DEVICE)
    s = torch.rand(2, 3, 20, generator=g).to(KERNEL_DEVICE)
    n = torch.randint(0, 5, (2, 3, 20), generator=g).to(KERNEL_DEVICE)
    op = torch.ops.policyzoo.gaussian_entmax_threshold.default
    for cap in (None, m + 1.0):
        for float64_steps in (0, 3):
            torch.library.opcheck(op, (m, s, n, cap, 12, float64_steps), test_utils=("test_schema", "test_faketensor"))


@kernel_here
def test_threshold_kernel_torch_compile_traces_through(monkeypatch):
    """A compiled function calling the threshold traces without graph breaks (fullgraph): the op is
    one opaque node, so Inductor never sees the Newton passes."""
    monkeypatch.setenv("POLICYZOO_TRITON", "1")
    g = torch.Generator().manual_seed(2)
    m = torch.randn(2, 4, 40, generator=g).to(KERNEL_DEVICE)
    s = torch.rand(2, 4, 40, generator=g).to(KERNEL_DEVICE)
    n = torch.randint(0, 5, (2, 1, 40), generator=g).to(KERNEL_DEVICE)

    def step(m, s, n):
        tau = kernels.gaussian_entmax_threshold(m * 0.5, s * 0.5, n.expand_as(m), 0.5 * m + 1.0, 12).float()
        return m - tau

    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(m, s, n)
    want = m - reference.gaussian_entmax_threshold(m * 0.5, s * 0.5, n.expand_as(m), 0.5 * m + 1.0, 12).float()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@SETTINGS
@given(data=st.data(), args=entmax_args(), factor=st.sampled_from([1, 3]), aggregate=st.sampled_from(["max", "sum"]))
def test_rescored_entmaxkv_keeps_tokens_of_its_candidate_pages(data, cases, contract, args, factor, aggregate):
    """With ``rescore`` the chosen pages are candidates for an exact token ranking (the group folded
    by its max logit or its summed softmax mass): a token selection inside them, no larger than the
    pages' tokens, holding the forced tokens; the entmax path stays exact on its support and
    bounded otherwise. Without ``rescore`` the aggregate changes nothing."""
    case = data.draw(cases(page_sizes=(1, 4, 16)))
    state = case.state()
    pages = EntmaxKV(page=case.page, **args).select(state, case.q)
    other = "sum" if aggregate == "max" else "max"
    same = EntmaxKV(page=case.page, aggregate=other, **args).select(state, case.q)
    assert torch.equal(same.indices, pages.indices) and torch.equal(same.count, pages.count)
    sel = EntmaxKV(page=case.page, rescore=factor, aggregate=aggregate, **args).select(state, case.q)
    assert sel.block == 1 and sel.log_weight is None
    contract.check_entries(sel, case, args["sinks"], args["window"], pages=False)
    assert bool((sel.count <= pages.count * case.page).all())
    if args["attention"] == "softmax":
        contract.check_error_bound(sel, case)
    else:
        p, o = dense_entmax(case)
        keep = sel.token_mask(case.cache.capacity).repeat_interleave(case.g, dim=1)
        err = (o - sparse_entmax(case, sel)).norm(dim=-1)
        assert bool((err <= 2 * (p * ~keep).sum(-1) * max_value_norm(case) + 1e-4).all())

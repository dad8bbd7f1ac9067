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

from triton_mode import MODE, examples, poisoned as poisoned_buffers, run_for_sm90, run_in_fresh_interpreter  # first: it may set TRITON_INTERPRET before triton loads

import torch  # noqa: E402

from contextlib import contextmanager  # noqa: E402
from unittest import mock  # noqa: E402

import pytest  # noqa: E402
from hypothesis import example, given, settings  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton")

from policyzoo import kernels  # noqa: E402
from policyzoo.kernels import (  # noqa: E402
    AttentionConfig,
    AttentionEdgesConfig,
    GatheredLogitsConfig,
    GemvConfig,
    PageScoreConfig,
    SketchScoreConfig,
    SelectTopConfig,
    route,
)
from policyzoo.kernels import reference as ref  # noqa: E402
from policyzoo.kernels.ops.sketch_page_bound import sketch_score_config  # noqa: E402
from policyzoo.kernels.config import override  # noqa: E402
from policyzoo.kernels.ops import select_top as select_op  # noqa: E402
from policyzoo.selection import Selection  # noqa: E402

pytestmark = pytest.mark.skipif(not route.HAS_TRITON, reason="triton does not import here")
# Every test but the subprocess runner runs in this process only when the kernels can run here.
here = pytest.mark.skipif(MODE == "subprocess", reason="run by test_kernels_in_fresh_interpreter")

DEVICE = torch.device("cuda" if MODE == "cuda" else "cpu")
# (cache_append allocates nothing: its tests poison the summaries it writes.)
if route.HAS_TRITON:
    from policyzoo.kernels.ops.attention_edges import kernel as edges_kernel  # noqa: E402
    from policyzoo.kernels.ops.cache_append import kernel as append_kernel  # noqa: E402
    from policyzoo.kernels.ops.decode_attention import kernel as attention_kernel  # noqa: E402
    from policyzoo.kernels.ops.page_gaussians import kernel as gaussians_kernel  # noqa: E402
    from policyzoo.kernels.ops.quest_page_bound import kernel as quest_kernel  # noqa: E402
    from policyzoo.kernels.ops.select_top import kernel as select_kernel  # noqa: E402
    from policyzoo.kernels.ops.sketch_page_bound import half2 as sketch_half2  # noqa: E402
    from policyzoo.kernels.ops.sketch_page_bound import kernel as sketch_kernel  # noqa: E402
    from policyzoo.kernels.ops.sparse_gemv import kernel as gemv_kernel  # noqa: E402

    KERNEL_MODULES = (attention_kernel, quest_kernel, sketch_kernel, gemv_kernel, select_kernel, edges_kernel,
                      gaussians_kernel)
# The kernels' histograms and arrival counters, as a Decoder on CUDA makes them: the tests that
# pass it check that every launch leaves it zero.
WORKSPACE = kernels.Workspace(DEVICE) if MODE != "subprocess" else None
# The Triton path of each attention mode, by its name in the tests.
ATTEND = {"softmax": kernels.decode_attention.triton, "entmax15": kernels.decode_attention_entmax15.triton}


def workspace_is_zero() -> bool:
    return all(int(b.abs().sum()) == 0 for b in WORKSPACE.buffers.values())


@pytest.mark.skipif(MODE != "subprocess", reason="the kernels run in this process")
def test_kernels_in_fresh_interpreter():
    run_in_fresh_interpreter(__file__)


TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
SETTINGS = settings(max_examples=examples(20), deadline=None, database=None)
ATTENTION_SETTINGS = settings(max_examples=examples(25), deadline=None, database=None)


def poisoned():
    """Make every buffer the kernels allocate start as NaN (integer buffers as -7)."""
    return poisoned_buffers(*KERNEL_MODULES)


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
        # The cache capacity is a whole number of pages of 16; entries of 64 (`kv.Forecast`'s blocks
        # of four pages) may reach past its end, where nothing is visible.
        n = draw(st.integers(1, 3)) * block - (draw(st.sampled_from([0, 16, 48])) if block == 64 else 0)
        k_max = draw(st.integers(1, -(-n // block) + 1))
    length = draw(st.integers(0, n))
    start = [draw(st.integers(0, length)) for _ in range(b)]
    n_entries = -(-n // block)
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
    chunk = draw(st.sampled_from([0, 1, 2, 3, 7]))  # entries per program (0: by shape); 1 gives > 32 chunks to merge
    return dict(
        q=q, keys=keys, values=values, sel=sel,
        start=torch.tensor(start, dtype=torch.int64, device=DEVICE),
        length=torch.tensor(length, dtype=torch.int64, device=DEVICE),
        scale=d**-0.5, chunk=chunk, dtype=dtype,
    )


def run_attention(case, mode, cfg=None):
    """The kernels on ``case`` under ``cfg`` (default: the case's chunk), and the reference."""
    args = (case["q"], case["keys"], case["values"], case["sel"], case["start"], case["length"], case["scale"])
    with poisoned(), override(attention=cfg or AttentionConfig(chunk=case["chunk"])):
        out, second = ATTEND[mode](*args)
    reference = ref.decode_attention if mode == "softmax" else ref.decode_attention_entmax15
    ref_out, ref_second = reference(*args)
    return out, second, ref_out, ref_second


@here
@ATTENTION_SETTINGS
@given(case=attention_cases(), merge=st.sampled_from([(0, 128), (0, 16), (32, 128)]))
def test_decode_attention_softmax(case, merge):
    """``merge``: the merge's (block_c, max_block_c): every chunk in one step, in steps of at most
    16 (with > 16 chunks), or in fixed steps of 32."""
    cfg = AttentionConfig(chunk=case["chunk"], block_c=merge[0], max_block_c=merge[1])
    out, lse, ref_out, ref_lse = run_attention(case, "softmax", cfg)
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


_SM90_MERGE = """
import re, subprocess, tempfile, pathlib
from policyzoo.kernels import AttentionConfig
from policyzoo.kernels.ops.decode_attention import _choose
from policyzoo.kernels.ops.decode_attention import kernel as K
fn = K._merge_kernel
cuobjdump = pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
for d in (64, 128, 256):
  for k_max in (16, 64, 128, 512):  # 16 to 128 partials a merge step (one row of one KV head)
    cfg = _choose(AttentionConfig(min_chunk_tokens=1), k_max, 1, 1, d)
    const = dict(D=d, D_PAD=d, BLOCK_C=cfg.block_c)
    types = {n: "*bf16" if n == "out_ptr" else "*fp32" for n in fn.arg_names if n.endswith("_ptr")}
    cubin = compile_sm90(fn, const, types, warp_size=128, num_warps=cfg.merge_warps).asm["cubin"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    print(d, cfg.block_c, cfg.merge_warps, re.search(r"STACK:(\\d+)", usage).group(1))
"""


def test_decode_attention_merge_keeps_its_partials_in_registers():
    """The merge holds a step's ``block_c x D`` partial outputs in registers: with the warps the
    config chooses, compiled for an H100/H200 (sm_90) with the toolchain Triton ships, no step of
    16 to 128 partials of head dims 64 to 256 spills to local memory (128 x 128 in 2 warps did)."""
    steps = [line.split() for line in run_for_sm90(_SM90_MERGE).splitlines()]
    assert [int(s[1]) for s in steps] == [16, 64, 128, 128] * 2 + [16, 64, 64, 64], steps
    assert all(int(stack) == 0 for *_, stack in steps), steps


@here
def test_decode_attention_walks_many_tiles():
    """Chunks of 7 pages walked in tiles of 16 tokens (7 steps a program; the last
    chunk shorter), with log-weights, left padding and an unfilled last page: the reference's output."""
    g_rand = gen(1)
    b, h_kv, group, n, d = 2, 2, 4, 16 * 24, 64
    q = randn(g_rand, b, h_kv * group, d)
    keys, values = randn(g_rand, b, h_kv, n, d), randn(g_rand, b, h_kv, n, d)
    indices = torch.stack([torch.randperm(24, generator=g_rand)[:17].sort().values for _ in range(b * h_kv)])
    sel = Selection(indices.view(b, h_kv, 17).int().to(DEVICE), torch.tensor([[17, 12], [17, 5]], dtype=torch.int32, device=DEVICE),
                    randn(g_rand, b, h_kv, 17), 16)
    start, length = torch.tensor([0, 37], device=DEVICE), torch.tensor(n - 9, device=DEVICE)
    case = dict(q=q, keys=keys, values=values, sel=sel, start=start, length=length, scale=d**-0.5)
    out, lse, ref_out, ref_lse = run_attention(case, "softmax", AttentionConfig(chunk=7, block_t=16))
    assert_close(out, ref_out, torch.float32)
    assert_close(lse, ref_lse, torch.float32)


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
    with poisoned(), override(attention=AttentionConfig(chunk=1)):
        out, second = ATTEND[mode](q, keys, values, sel, start, length, d**-0.5)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(second, torch.full_like(second, -torch.inf))


@here
@settings(max_examples=10, deadline=None, database=None)
@given(case=attention_cases(dtypes=(torch.float32,)))
def test_entmax15_kernel_weights_sum_to_one(case):
    """With all values 1 the output is Σp: 1 for a row with a visible entry, 0 otherwise."""
    values = torch.ones_like(case["values"])
    args = (case["q"], case["keys"], values, case["sel"], case["start"], case["length"], case["scale"])
    with override(attention=AttentionConfig(chunk=case["chunk"])):
        out, tau = ATTEND["entmax15"](*args)
    nonempty = torch.isfinite(tau)
    expected = torch.where(nonempty, 1.0, 0.0).unsqueeze(-1).expand_as(out)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def in_slots(case, g_rand, extra):
    """The case's selected entries copied into random distinct slots of a page cache (``extra``
    slots more than entries, the rest garbage) → ``(keys, values, slots)``; padding entries get
    slots far out of range, which must never be read."""
    sel, keys, values = case["sel"], case["keys"], case["values"]
    b, h_kv, k_max = sel.indices.shape
    block, n, d = sel.block, keys.shape[2], keys.shape[3]
    n_slots = k_max + extra
    slot_keys = randn(g_rand, b, h_kv, n_slots * block, d, dtype=keys.dtype)
    slot_values = randn(g_rand, b, h_kv, n_slots * block, d, dtype=keys.dtype)
    slots = torch.stack([torch.randperm(n_slots, generator=g_rand)[:k_max] for _ in range(b * h_kv)]).view(b, h_kv, k_max)
    slots = slots.to(torch.int32).to(DEVICE)
    valid = sel.entry_valid()
    for i, j, e in valid.nonzero().tolist():
        first = int(sel.indices[i, j, e]) * block
        rows = min(block, n - first)  # an entry may reach past the cache's end
        to = int(slots[i, j, e]) * block
        slot_keys[i, j, to : to + rows] = keys[i, j, first : first + rows]
        slot_values[i, j, to : to + rows] = values[i, j, first : first + rows]
    slots = torch.where(valid, slots, torch.full_like(slots, 2**20))
    return slot_keys, slot_values, slots


@here
@ATTENTION_SETTINGS
@given(case=attention_cases(), mode=st.sampled_from(["softmax", "entmax15"]), extra=st.integers(0, 3))
def test_decode_attention_reads_entries_from_their_slots(case, mode, extra):
    """With ``slots``, the kernels read each entry from its slot of a page cache and still mask by
    the entry's position: the output is the attention over the cache itself."""
    slot_keys, slot_values, slots = in_slots(case, gen(case["chunk"] + 7 * extra), extra)
    args = (case["q"], case["keys"], case["values"], case["sel"], case["start"], case["length"], case["scale"])
    reference = ref.decode_attention if mode == "softmax" else ref.decode_attention_entmax15
    want_out, want_second = reference(*args)
    paged = (case["q"], slot_keys, slot_values, case["sel"], case["start"], case["length"], case["scale"])
    ref_out, ref_second = reference(*paged, slots)
    torch.testing.assert_close(ref_out, want_out)  # the reference's slots read the same values
    torch.testing.assert_close(ref_second, want_second)
    with poisoned(), override(attention=AttentionConfig(chunk=case["chunk"])):
        out, second = ATTEND[mode](*paged, slots=slots)
    assert_close(out.float(), want_out.float(), case["dtype"])
    assert_close(second, want_second, torch.float32)


@here
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), page=st.sampled_from([4, 16, 24]), d=st.sampled_from([32, 128]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), programs=st.sampled_from([1, 3, 32]))
def test_page_fetch_copies_the_listed_pages_and_nothing_else(seed, page, d, dtype, programs):
    from policyzoo.kernels import PageFetchConfig

    g_rand = gen(seed)
    b, h, n_pages, n_slots = 2, 2, 6, 4
    src_k, src_v = randn(g_rand, b, h, n_pages * page, d, dtype=dtype), randn(g_rand, b, h, n_pages * page, d, dtype=dtype)
    dst_k, dst_v = randn(g_rand, b, h, (n_slots + 1) * page, d, dtype=dtype), randn(g_rand, b, h, (n_slots + 1) * page, d, dtype=dtype)
    m = 7
    count = int(torch.randint(0, m + 1, (1,), generator=g_rand))
    src = torch.randint(0, b * h * n_pages, (m,), generator=g_rand)
    # Distinct destinations among the listed pages; the rest of the list points at scratch slot 4 of row 0.
    dst = torch.randperm(b * h * (n_slots + 1), generator=g_rand)
    dst = dst[dst % (n_slots + 1) != n_slots][:m]
    dst[count:], src[count:] = n_slots, 0
    src, dst, count_t = src.to(DEVICE), dst.to(DEVICE), torch.tensor([count], device=DEVICE)
    want_k, want_v = dst_k.clone(), dst_v.clone()
    ref.page_fetch(src_k, src_v, want_k, want_v, src, dst, count_t, page)
    with override(page_fetch=PageFetchConfig(programs=programs)):
        kernels.page_fetch.triton(src_k, src_v, dst_k, dst_v, src, dst, count_t, page)
    not_scratch = (torch.arange(n_slots + 1, device=DEVICE) != n_slots).repeat_interleave(page)
    torch.testing.assert_close(dst_k[:, :, not_scratch], want_k[:, :, not_scratch], rtol=0, atol=0)
    torch.testing.assert_close(dst_v[:, :, not_scratch], want_v[:, :, not_scratch], rtol=0, atol=0)


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

PAGE_METHODS = PageScoreConfig.METHODS


def page_method(method: str):
    """The page-bound kernel computed by ``method`` (head dims under 16 take the loop either way)."""
    return override(page_score=PageScoreConfig(method=method))


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
            got = kernels.quest_page_bound.triton(q, page_min, page_max, scale)
        else:
            got = kernels.quest_page_bound_grouped.triton(q, page_min, page_max, scale, agg)
    if agg == "none":
        expected = ref.quest_page_bound(q, page_min, page_max, scale)
    else:
        expected = ref.quest_page_bound_grouped(q, page_min, page_max, scale, agg)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    # The bound is fp32 arithmetic on exact (bf16 → fp32) inputs, whatever q's dtype.
    assert_close(got, expected, torch.float32, scale=expected.abs().max().item() + 1)


@here
@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    d=st.sampled_from([8, 64, 96, 128]),
    b=st.integers(1, 2),
    h_kv=st.integers(1, 2),
    group=st.integers(1, 8),
    pages=st.integers(1, 70),
    block_p=st.sampled_from([16, 32, 64]),
    zero_std=st.booleans(),
)
def test_page_gaussians(seed, dtype, d, b, h_kv, group, pages, block_p, zero_std):
    """μ and σ of every query head and page, as the reference's einsums give them (fp32 sums in
    another order), whatever the block of pages a program takes; σ = 0 where the page's keys agree."""
    g_rand = gen(seed)
    q = randn(g_rand, b, h_kv * group, d, dtype=dtype)
    mean = randn(g_rand, b, h_kv, pages, d)
    std = randn(g_rand, b, h_kv, pages, d).abs() * (0.0 if zero_std else 1.0)
    scale = d**-0.5
    with poisoned(), override(page_gaussians=kernels.PageGaussiansConfig(block_p=block_p)):
        mu, sigma = kernels.page_gaussians.triton(q, mean, std, scale)
    want_mu, want_sigma = ref.page_gaussians(q, mean, std, scale)
    assert mu.dtype == sigma.dtype == torch.float32 and mu.shape == sigma.shape == (b, h_kv * group, pages)
    assert_close(mu, want_mu, torch.float32, scale=want_mu.abs().max().item() + 1)
    assert_close(sigma, want_sigma, torch.float32, scale=want_sigma.abs().max().item() + 1)
    assert bool((sigma >= 0).all()) and (not zero_std or bool((sigma == 0).all()))


@here
@pytest.mark.parametrize("method", PAGE_METHODS)
@pytest.mark.parametrize("group", [3, 5])
def test_quest_page_bound_grouped_negative(group, method):
    """Groups padded to a power of two: the padding heads must not enter the max (all bounds < 0)."""
    q = torch.rand(2, 2 * group, 64, device=DEVICE) + 0.1
    centre = -torch.rand(2, 2, 7, 64, device=DEVICE) - 0.1
    with poisoned(), page_method(method):
        got = kernels.quest_page_bound_grouped.triton(q, centre, centre, 0.125, "max")
    expected = ref.quest_page_bound_grouped(q, centre, centre, 0.125, "max")
    assert (expected < 0).all()
    assert_close(got, expected, torch.float32)


@here
@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    d=st.sampled_from([7, 32, 64, 128, 256]),  # 7: an odd head dim, whose last byte holds one code
    b=st.integers(1, 2),
    h_kv=st.integers(1, 2),
    group=st.integers(1, 5),
    pages=st.integers(1, 11),
    page=st.sampled_from([1, 4, 16]),
    agg=st.sampled_from(["none", "max"]),
    block_p=st.sampled_from([1, 4]),
    method=st.sampled_from(SketchScoreConfig.METHODS),
)
@example(seed=7557386, dtype=torch.float32, d=64, b=2, h_kv=2, group=4, pages=8, page=16, agg="none", block_p=1, method="dot")
@example(seed=416634, dtype=torch.float32, d=7, b=2, h_kv=2, group=2, pages=9, page=16, agg="none", block_p=1, method="dot")
def test_sketch_page_bound(seed, dtype, d, b, h_kv, group, pages, page, agg, block_p, method):
    """The kernel's page bound is the reference's (masked slots, padding rows and all), and above
    every visible key's exact logit."""
    if method == "half2" and MODE != "cuda":
        block_p = 4  # the interpreter runs each half2 program for about half a second: 4 pages each, not 1
    g_rand = gen(seed)
    n = pages * page
    keys = randn(g_rand, b, h_kv, pages, page, d, dtype=dtype) * 2 + randn(g_rand, b, h_kv, pages, 1, d, dtype=dtype)
    length = torch.randint(1, n + 1, (), generator=g_rand)
    start = torch.randint(0, int(length), (b,), generator=g_rand)
    seen = ref.visible(start, length, n).view(b, 1, pages, page, 1).to(DEVICE)
    page_min = torch.where(seen, keys, torch.inf).amin(3).nan_to_num(0.0, posinf=0.0).to(dtype)
    page_max = torch.where(seen, keys, -torch.inf).amax(3).nan_to_num(0.0, neginf=0.0).to(dtype)
    codes = ref.sketch_encode(keys, page_min, page_max).flatten(2, 3).contiguous()
    q = randn(g_rand, b, h_kv * group, d, dtype=dtype)
    scale = d**-0.5
    start, length = start.to(DEVICE), length.to(DEVICE)
    with poisoned(), override(sketch_score=SketchScoreConfig(method=method, block_p=block_p)):
        got = kernels.sketch_page_bound.triton(q, codes, page_min, page_max, start, length, scale, agg)
    expected = ref.sketch_page_bound(q, codes, page_min, page_max, start, length, scale, agg)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert torch.equal(got.isneginf(), expected.isneginf())
    live = expected.isfinite()
    half2 = method == "half2" and sketch_half2.fits(codes, group)  # else it falls back to "rows"
    if method in ("sum", "rows") or (method == "half2" and not half2) or (method == "keys" and page * block_p < 16):
        # ("keys" falls back to the sum)
        assert_close(got[live], expected[live], torch.float32, scale=expected[live].abs().max().item() + 1 if live.any() else 1)
    elif half2:  # fp16 products, their worst case added back: 0 to twice the slack above the reference
        slack = 2 * ref.half2_slack(q, page_min, page_max, scale, agg)
        tol = 1e-4 * (1 + expected[live].abs())
        assert bool((got[live] >= expected[live] - tol).all())
        assert bool((got[live] <= expected[live] + slack[live] + tol).all())
    elif method == "keys":  # fp16 keys and queries, each rounding's worst case added: 0 to twice it above
        big = torch.maximum(page_min.float().abs(), page_max.float().abs())  # [B, H_kv, P, D]
        q16 = q.float().clamp(-60000, 60000).half().float()
        worst = (torch.einsum("bkgd,bkpd->bkgp", q.float().abs().view(b, h_kv, group, d), big * 2.0**-11 + 2.0**-24)
                 + torch.einsum("bkgd,bkpd->bkgp", (q.float() - q16).abs().view(b, h_kv, group, d), big * (1 + 2.0**-10)))
        slack = 2 * scale * worst
        slack = slack.reshape(b, -1, pages) if agg == "none" else slack.amax(2)
        tol = 1e-4 * (1 + expected[live].abs())
        assert bool((got[live] >= expected[live] - tol).all())
        assert bool((got[live] <= expected[live] + slack[live] + tol).all())
    else:  # fp16 weights W = q·step: codes up to 15 times their rounding δ (|δ| <= 2^-11 |W|) either
        # way, and 15·|δ| added back, so the kernel sits 0 to 30·|δ| above the reference
        step = ref.sketch_grid(page_min, page_max)[1]  # [B, H_kv, P, D]
        weights = torch.einsum("bkgd,bkpd->bkgp", q.float().abs().view(b, h_kv, group, d), step)
        slack = 30 * 2.0**-11 * scale * weights
        slack = slack.reshape(b, -1, pages) if agg == "none" else slack.amax(2)
        tol = 1e-4 * (1 + expected[live].abs())
        assert bool((got[live] >= expected[live] - tol).all())
        assert bool((got[live] <= expected[live] + slack[live] + tol).all())
    exact = torch.einsum("bkgd,bkpnd->bkgpn", q.float().view(b, h_kv, group, d), keys.float()) * scale
    best = exact.masked_fill(~seen.view(b, 1, 1, pages, page), -torch.inf).amax(-1)  # [B, H_kv, G, P]
    best = best.reshape(b, -1, pages) if agg == "none" else best.amax(2)
    assert bool((got[live] >= best[live] - 1e-4 * (1 + best[live].abs())).all())


@here
@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    d=st.sampled_from([7, 64]),
    h_kv=st.integers(1, 2),
    group=st.integers(1, 4),
    pages=st.integers(1, 9),
    listed=st.integers(1, 12),
    page=st.sampled_from([4, 16]),
    agg=st.sampled_from(["none", "max"]),
    method=st.sampled_from(SketchScoreConfig.METHODS),
)
def test_sketch_page_bound_listed(seed, d, h_kv, group, pages, listed, page, agg, method):
    """Scoring a list of pages gives, entry by entry, the full bound of the listed page (the same
    bits as the unlisted kernel), and ``-inf`` for an id outside the cache's pages; the reference
    agrees on shape and on which entries are ``-inf``. In the interpreter, the methods that sum by
    tl.dot agree to rounding only: numpy's matmul may sum a row in another order when the tile's
    other rows differ."""
    g_rand = gen(seed)
    b, n = 2, pages * page
    keys = randn(g_rand, b, h_kv, pages, page, d, dtype=torch.float32)
    length = torch.randint(1, n + 1, (), generator=g_rand)
    start = torch.randint(0, int(length), (b,), generator=g_rand)
    page_min, page_max = keys.amin(3), keys.amax(3)
    codes = ref.sketch_encode(keys, page_min, page_max).flatten(2, 3).contiguous()
    q = randn(g_rand, b, h_kv * group, d, dtype=torch.float32)
    ids = torch.randint(-1, pages + 1, (b, h_kv, listed), generator=g_rand).to(DEVICE)  # -1 and P: no page
    start, length, scale = start.to(DEVICE), length.to(DEVICE), d**-0.5
    with poisoned(), override(sketch_score=SketchScoreConfig(method=method, block_p=4)):
        full = kernels.sketch_page_bound.triton(q, codes, page_min, page_max, start, length, scale, agg)
        got = kernels.sketch_page_bound.triton(q, codes, page_min, page_max, start, length, scale, agg, ids.int())
    expected = ref.sketch_page_bound(q, codes, page_min, page_max, start, length, scale, agg, ids)
    rows = ids if agg == "max" else ids.repeat_interleave(group, dim=1)
    ok = (rows >= 0) & (rows < pages)
    at = torch.gather(full, 2, rows.clamp(0, pages - 1).long()).masked_fill(~ok, -torch.inf)
    assert got.shape == expected.shape == at.shape
    if MODE == "cuda" or method in ("sum", "rows"):
        assert torch.equal(got, at)
    else:
        assert torch.equal(got.isneginf(), at.isneginf())
        torch.testing.assert_close(got, at, rtol=1e-6, atol=1e-6)
    assert torch.equal(got.isneginf(), expected.isneginf())


@here
def test_sketch_page_bound_rows_on_codes_off_the_word_grid():
    """Codes whose rows do not start on a 32-bit word (a view at an odd byte) take the sum, with the
    reference's result; the rows kernel itself refuses them by name."""
    g_rand = gen(3)
    b, h_kv, group, pages, page, d = 1, 2, 4, 3, 16, 64
    keys = randn(g_rand, b, h_kv, pages, page, d, dtype=torch.float32)
    page_min, page_max = keys.amin(3), keys.amax(3)
    codes = ref.sketch_encode(keys, page_min, page_max).flatten(2, 3)
    shifted = torch.zeros(codes.numel() + 1, dtype=torch.uint8, device=codes.device)
    shifted[1:] = codes.flatten()
    odd = shifted[1:].view(codes.shape)  # the same codes, one byte off the word grid
    q = randn(g_rand, b, h_kv * group, d, dtype=torch.float32)
    start, length = torch.zeros(b, dtype=torch.long, device=DEVICE), torch.tensor(pages * page, device=DEVICE)
    args = (q, odd, page_min, page_max, start, length, d**-0.5, "max")
    with poisoned(), override(sketch_score=SketchScoreConfig(method="rows")):
        got = kernels.sketch_page_bound.triton(*args)
    assert_close(got, ref.sketch_page_bound(*args), torch.float32, scale=got.abs().max().item() + 1)
    with pytest.raises(ValueError, match="rows method reads the codes as 32-bit words"):
        sketch_kernel.sketch_page_bound(*args, None, SketchScoreConfig(method="rows"))


@here
@pytest.mark.parametrize("magnitude", [1e-30, 1.0, 1e4])
def test_sketch_page_bound_half2_scales_its_weights(magnitude):
    """The half2 method scales each page's weights by a power of two before fp16: keys and queries
    whose products overflow fp16 (1e4 · 1e4) or sit far below its normal range (1e-30 · 1e-30) still
    give a finite bound between the reference's and twice the slack above it."""
    g_rand = gen(5)
    b, h_kv, group, pages, page, d = 1, 2, 4, 6, 16, 128
    keys = randn(g_rand, b, h_kv, pages, page, d, dtype=torch.float32) * magnitude
    page_min, page_max = keys.amin(3), keys.amax(3)
    codes = ref.sketch_encode(keys, page_min, page_max).flatten(2, 3).contiguous()
    q = randn(g_rand, b, h_kv * group, d, dtype=torch.float32) * magnitude
    start, length = torch.zeros(b, dtype=torch.long, device=DEVICE), torch.tensor(pages * page, device=DEVICE)
    args = (q, codes, page_min, page_max, start, length, 1.0, "none")
    with poisoned(), override(sketch_score=SketchScoreConfig(method="half2")):
        got = kernels.sketch_page_bound.triton(*args)
    expected = ref.sketch_page_bound(*args)
    slack = 2 * ref.half2_slack(q, page_min, page_max, 1.0)
    tol = 1e-5 * (expected.abs() + slack) + 1e-30
    assert bool(got.isfinite().all())
    assert bool((got >= expected - tol).all())
    assert bool((got <= expected + slack + tol).all())


@here
@pytest.mark.parametrize("top", [1.95, 2.6, 3.66])
def test_sketch_page_bound_half2_stays_finite_at_the_top_of_the_grid(top):
    """A token at the top of its page's grid in every channel (every code 15) under a query whose
    weights ``q·step`` are all equal: each chain of eight fp16 products is then as large as the
    scaling allows. The bound stays finite, between the reference's and twice the slack above it
    (with the weights scaled into ``[512, 1024)``, ``top`` 2.6 and 3.66 overflowed to ``inf``)."""
    b, h_kv, group, pages, page, d = 1, 1, 4, 2, 16, 128
    keys = torch.zeros(b, h_kv, pages, page, d, device=DEVICE)
    keys[:, :, :, 0, :] = top
    page_min, page_max = keys.amin(3), keys.amax(3)
    codes = ref.sketch_encode(keys, page_min, page_max).flatten(2, 3).contiguous()
    q = torch.ones(b, h_kv * group, d, device=DEVICE)
    start, length = torch.zeros(b, dtype=torch.long, device=DEVICE), torch.tensor(pages * page, device=DEVICE)
    args = (q, codes, page_min, page_max, start, length, 1.0, "none")
    with poisoned(), override(sketch_score=SketchScoreConfig(method="half2")):
        got = kernels.sketch_page_bound.triton(*args)
    expected = ref.sketch_page_bound(*args)
    slack = 2 * ref.half2_slack(q, page_min, page_max, 1.0)
    assert bool(got.isfinite().all())
    assert bool((got >= expected - 1e-5 * expected.abs()).all())
    assert bool((got <= expected + slack + 1e-5 * expected.abs()).all())
    # A register cap changes where values live, not the arithmetic (on CUDA; the interpreter ignores it).
    with poisoned(), override(sketch_score=SketchScoreConfig(method="half2", max_registers=200)):
        assert torch.equal(kernels.sketch_page_bound.triton(*args), got)


@here
@pytest.mark.parametrize("token_step", [1, 4])
def test_sketch_page_bound_half2_token_steps_give_the_same_bits(token_step):
    """The half2 kernel's token loop in runtime steps of ``token_step`` tokens (unrolled within a
    step) computes what the whole page unrolled computes, bit for bit: the same products and sums
    for every token, and a max over the same tokens."""
    g_rand = gen(7)
    b, h_kv, group, pages, page, d = 1, 2, 4, 5, 16, 64
    keys = randn(g_rand, b, h_kv, pages, page, d, dtype=torch.float32)
    page_min, page_max = keys.amin(3), keys.amax(3)
    codes = ref.sketch_encode(keys, page_min, page_max).flatten(2, 3).contiguous()
    q = randn(g_rand, b, h_kv * group, d, dtype=torch.float32)
    start = torch.tensor([3], device=DEVICE)  # a page cut by the row's start, and one by its length
    length = torch.tensor(pages * page - 5, device=DEVICE)
    args = (q, codes, page_min, page_max, start, length, d**-0.5, "max")
    with poisoned(), override(sketch_score=SketchScoreConfig(method="half2")):
        whole = kernels.sketch_page_bound.triton(*args)
    with poisoned(), override(sketch_score=SketchScoreConfig(method="half2", token_step=token_step)):
        stepped = kernels.sketch_page_bound.triton(*args)
    assert torch.equal(stepped, whole)
    slack = 2 * ref.half2_slack(q, page_min, page_max, d**-0.5, "max")
    expected = ref.sketch_page_bound(*args)
    live = expected.isfinite()
    assert torch.equal(whole.isneginf(), expected.isneginf())
    assert bool((whole[live] >= expected[live] - 1e-5 * expected[live].abs()).all())
    assert bool((whole[live] <= expected[live] + slack[live] + 1e-5 * expected[live].abs()).all())


@here
def test_sketch_page_bound_half2_falls_back_where_it_does_not_fit():
    """Groups of more than `half2.MAX_GROUP` query heads, codes that are not whole runs of four words,
    pages of more than `HALF2_PAGE` tokens and a scale that is not positive take ``"rows"`` through the
    op (the reference's result); the half2 launcher refuses them by name."""
    g_rand = gen(4)
    b, h_kv, pages, page, d = 1, 1, 3, 16, 64
    keys = randn(g_rand, b, h_kv, pages, page, d, dtype=torch.float32)
    page_min, page_max = keys.amin(3), keys.amax(3)
    codes = ref.sketch_encode(keys, page_min, page_max).flatten(2, 3).contiguous()
    start, length = torch.zeros(b, dtype=torch.long, device=DEVICE), torch.tensor(pages * page, device=DEVICE)
    q = randn(g_rand, b, 5, d, dtype=torch.float32)  # a group of 5
    args = (q, codes, page_min, page_max, start, length, 0.125, "max")
    with poisoned(), override(sketch_score=SketchScoreConfig(method="half2")):
        got = kernels.sketch_page_bound.triton(*args)
    assert_close(got, ref.sketch_page_bound(*args), torch.float32, scale=got.abs().max().item() + 1)
    with pytest.raises(ValueError, match="half2 method reads whole runs"):
        sketch_kernel.sketch_page_bound(*args, None, SketchScoreConfig(method="half2"))
    unscaled = (q[:, :4], codes, page_min, page_max, start, length, 0.0, "max")
    with poisoned(), override(sketch_score=SketchScoreConfig(method="half2")):
        assert torch.equal(kernels.sketch_page_bound.triton(*unscaled), ref.sketch_page_bound(*unscaled))  # all zero
    with pytest.raises(ValueError, match="needs a scale > 0"):
        sketch_kernel.sketch_page_bound(*unscaled, None, SketchScoreConfig(method="half2"))
    assert sketch_score_config(16, 24, method="half2").method == "rows"  # 24 bytes: not whole runs of 16
    assert sketch_score_config(16, 48, method="half2").method == "rows"  # 3 runs: not a power of two
    assert sketch_score_config(16, 64, method="half2").method == "half2"
    assert sketch_score_config(32, 64, method="half2").method == "rows"  # the kernel unrolls a page's tokens


def test_sketch_page_bound_listed_shape_error():
    q = torch.zeros(1, 2, 8)
    codes = torch.zeros(1, 1, 16, 4, dtype=torch.uint8)
    mm = torch.zeros(1, 1, 4, 8)
    with pytest.raises(ValueError, match=r"pages must be \[B, H_kv, K\]"):
        ref.sketch_page_bound(q, codes, mm, mm, torch.zeros(1, dtype=torch.long), torch.tensor(16), 1.0, "max",
                              torch.zeros(2, 1, 3, dtype=torch.long))


# --------------------------------------------------------------------------------------------------
# Exact logits of gathered keys


@here
@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    d=st.sampled_from([8, 64, 80, 128]),  # 8: the loop; 80: channels padded to 128
    b=st.integers(1, 2),
    h_kv=st.integers(1, 2),
    group=st.integers(1, 6),
    capacity=st.integers(1, 70),
    n=st.integers(0, 150),  # slots may repeat and come in any order
    method=st.sampled_from(GatheredLogitsConfig.METHODS),
    block_t=st.sampled_from([16, 64]),
    agg=st.sampled_from(["none", "max"]),
)
def test_gathered_logits(seed, dtype, d, b, h_kv, group, capacity, n, method, block_t, agg):
    g_rand = gen(seed)
    q = randn(g_rand, b, h_kv * group, d, dtype=dtype)
    keys = randn(g_rand, b, h_kv, capacity, d, dtype=dtype)
    slots = torch.randint(capacity, (b, h_kv, n), generator=g_rand).to(DEVICE)
    scale = d**-0.5
    with poisoned(), override(gathered_logits=GatheredLogitsConfig(method=method, block_t=block_t)):
        got = kernels.gathered_logits.triton(q, keys, slots, scale, agg)
    expected = ref.gathered_logits(q, keys, slots, scale, agg)
    assert got.dtype == torch.float32 and got.shape == ((b, h_kv, group, n) if agg == "none" else (b, h_kv, n))
    # fp32 sums of exact (bf16 -> fp32) products, in another order.
    assert_close(got, expected, torch.float32, scale=expected.abs().max().item() + 1 if n else 1)


# --------------------------------------------------------------------------------------------------
# The attention graph's edge search


@here
@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    d=st.sampled_from([16, 24, 64]),  # 24: channels padded to 32
    h_kv=st.integers(1, 2),
    group=st.integers(1, 3),
    n=st.integers(1, 150),
    data=st.data(),
    top=st.sampled_from([1, 3, 8]),
    blocks=st.sampled_from([(16, 16), (64, 64), (16, 64)]),
)
def test_attention_edges(seed, dtype, d, h_kv, group, n, data, top, blocks):
    """The same best keys (where they are edges, p > 0) and probabilities as the reference, for query
    blocks anywhere in the prompt, fewer keys than ``top``, GQA groups and padded channels."""
    t = data.draw(st.integers(1, n), label="queries")
    first = data.draw(st.integers(0, n - t), label="first")
    g_rand = gen(seed)
    q = randn(g_rand, h_kv * group, t, d, dtype=dtype) * 2
    keys = randn(g_rand, h_kv, n, d, dtype=dtype)
    block_q, block_k = blocks
    with poisoned(), override(attention_edges=AttentionEdgesConfig(block_q=block_q, block_k=block_k)):
        dst, p = kernels.attention_edges.triton(q, keys, first, d**-0.5, top)
    want_dst, want_p = ref.attention_edges(q, keys, first, d**-0.5, top)
    assert dst.shape == p.shape == (h_kv * group, t, top) and dst.dtype == torch.int32
    edge = want_p > 0
    assert torch.equal(p > 0, edge)  # a query at position i has min(top, i + 1) edges
    assert torch.equal(edge.sum(-1), (first + torch.arange(t, device=DEVICE) + 1).clamp(max=top).expand(h_kv * group, t))
    # Random logits have no ties, so the same keys in the same order (fp32 sums in another order).
    assert torch.equal(dst[edge], want_dst[edge])
    torch.testing.assert_close(p, want_p, rtol=1e-4, atol=1e-6)


def test_attention_edges_reference_semantics():
    """A query sees only the keys up to its own position; its best keys come first; p sums over all
    visible keys (the top p are shares of the whole softmax)."""
    q = torch.tensor([[[1.0], [1.0], [1.0]]])  # one head, queries at positions 1, 2, 3
    keys = torch.tensor([[[0.0], [3.0], [1.0], [5.0]]])  # key 3 is the best, seen only by the last query
    dst, p = ref.attention_edges(q, keys, 1, 1.0, 2)
    assert dst[0, :, 0].tolist() == [1, 1, 3]
    assert dst[0, 2, 1].item() == 1
    z = torch.tensor([0.0, 3.0, 1.0, 5.0])
    torch.testing.assert_close(p[0, 2], torch.softmax(z, 0)[[3, 1]])
    torch.testing.assert_close(p[0, 0], torch.softmax(z[:2], 0)[[1, 0]])
    with pytest.raises(ValueError, match="queries"):
        ref.attention_edges(q, keys, 2, 1.0, 2)  # queries 2..5 over 4 keys


@here
@pytest.mark.parametrize("method", GatheredLogitsConfig.METHODS)
def test_gathered_logits_max_ignores_the_padding_heads(method):
    """Groups of 3 padded to 16 rows: with every logit negative, a padding head's 0 must not win."""
    q = torch.rand(1, 6, 64, device=DEVICE) + 0.1
    keys = -torch.rand(1, 2, 9, 64, device=DEVICE) - 0.1
    slots = torch.arange(9, device=DEVICE).expand(1, 2, 9)
    with poisoned(), override(gathered_logits=GatheredLogitsConfig(method=method)):
        got = kernels.gathered_logits.triton(q, keys, slots, 0.125, "max")
    expected = ref.gathered_logits(q, keys, slots, 0.125, "max")
    assert (expected < 0).all()
    assert_close(got, expected, torch.float32)
    for fn in (kernels.gathered_logits.triton, ref.gathered_logits):
        with pytest.raises(ValueError, match="agg must be"):
            fn(q, keys, slots, 0.125, "sum")


# --------------------------------------------------------------------------------------------------
# Sparse GEMV


@st.composite
def gemv_cases(draw):
    g_rand = gen(draw(st.integers(0, 2**31 - 1)))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    b = draw(st.sampled_from([1, 2, 3, 18]))  # 18: two row blocks of 16 in the scanning kernels
    d_in = draw(st.integers(1, 300))  # > BLOCK_K (128), so that split-K has slices to split
    segment = draw(st.sampled_from([16, 32]))  # column runs of per-column thresholds
    d_out = draw(st.one_of(st.integers(1, 130), st.integers(1, 4).map(lambda n: n * segment)))
    x = randn(g_rand, b, d_in, dtype=dtype)
    if draw(st.booleans()):
        w_t = randn(g_rand, d_in, d_out, dtype=dtype)  # input-major, contiguous
    else:
        w_t = randn(g_rand, d_out, d_in, dtype=dtype).t()  # an nn.Linear weight read through .t()
    bias = randn(g_rand, d_out, dtype=dtype) if draw(st.booleans()) else None
    split = draw(st.sampled_from([0, 1, 2, 5]))  # slices of the inputs (split-K); 0: by shape
    fuse = draw(st.booleans())  # split-K epilogue in the last program of each block, or a launch of its own
    prefetch = draw(st.booleans())  # scanning kernels: activations loaded a tile ahead
    tile_sum = draw(st.booleans())  # scanning kernels at one row: each tile summed at once
    atomic_sum = draw(st.booleans())  # scanning kernels: slices added atomically into one fp32 sum
    max_registers = draw(st.sampled_from([0, 128]))  # ptxas' maxnreg (the interpreter takes and ignores it)
    return dict(x=x, w_t=w_t, bias=bias, dtype=dtype, g=g_rand, d_in=d_in, split=split, fuse=fuse, segment=segment,
                prefetch=prefetch, tile_sum=tile_sum, atomic_sum=atomic_sum, max_registers=max_registers)


@contextmanager
def epilogue(case):
    """Run with the case's split, split-K epilogue (fused from 2 slices up, so small cases reach it
    too), prefetch, tile sums, atomic sums and a register cap; the arrival counters and sums must be
    back to zero after."""
    with override(gemv=GemvConfig(split=case["split"], fuse_epilogue=case["fuse"], min_fused_split=2,
                                  prefetch=case["prefetch"], tile_sum=case["tile_sum"], atomic_sum=case["atomic_sum"],
                                  max_registers=case["max_registers"])):
        yield
    for name, buf in WORKSPACE.buffers.items():
        assert int(buf.abs().sum()) == 0, f"{name} was left set"


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
    with poisoned(), epilogue(case):
        got = kernels.sparse_gemv_index.triton(case["x"], idx, case["w_t"], case["bias"], workspace=WORKSPACE)
    assert_gemv_close(got, ref.sparse_gemv_index(case["x"], idx, case["w_t"], case["bias"]), case)


@here
@SETTINGS
@given(case=gemv_cases(), quantile=st.sampled_from([0.0, 0.5, 0.9, None]), per=st.sampled_from(["one", "row", "column"]))
def test_sparse_gemv_threshold(case, quantile, per):
    """One threshold, one per batch row, or one per run of ``segment`` output columns (q|k|v in one
    pass): each output is the GEMV over the inputs its own threshold keeps."""
    x, w_t, segment = case["x"], case["w_t"], case["segment"]
    b, d_out = x.shape[0], w_t.shape[1]
    if per == "column" and d_out % segment:
        per = "row"
    q = torch.quantile(x.float().abs(), quantile).item() if quantile is not None else float("inf")
    # None: a threshold above every |x| (nothing kept: y = bias). A tensor threshold stays on device.
    if per == "one":
        t = q
        t_arg = torch.tensor(t, device=DEVICE) if quantile == 0.5 else t
    else:
        n = b if per == "row" else d_out // segment
        spread = torch.rand(n, generator=case["g"]) * 0.5 + 0.75  # thresholds that differ by row or run
        t_arg = (q * spread).to(DEVICE)
        t_arg = t_arg[:, None] if per == "row" else t_arg.repeat_interleave(segment)[None, :]
        t = t_arg
    with poisoned(), epilogue(case):
        got = kernels.sparse_gemv_threshold.triton(x, t_arg, w_t, case["bias"], segment if per == "column" else 0,
                                                   workspace=WORKSPACE)
    expected = ref.sparse_gemv_threshold(x, t, w_t, case["bias"], segment)
    assert_gemv_close(got, expected, case)
    if per != "one":  # the specification itself: each row / run against the one-threshold GEMV
        r, c = (slice(0, 1), slice(None)) if per == "row" else (slice(None), slice(0, segment))
        t0 = float(t_arg[0, 0])
        bias = case["bias"][c] if case["bias"] is not None else None
        alone = ref.sparse_gemv_threshold(x[r], t0, w_t[:, c], bias)
        torch.testing.assert_close(expected[r, c], alone)


_SM90_WARM_X = """
from policyzoo.kernels.ops.sparse_gemv import kernel as K
fn = K._gemv_scan_kernel
types = {n: {"t_ptr": "*fp32", "part_ptr": "*fp32", "done_ptr": "*i32"}.get(n, "*bf16") for n in fn.arg_names
         if n.endswith("_ptr")}
for block_b, warm_x in ((1, 0), (1, 32), (16, 32)):  # one row (the loop), a row block (tl.dot)
    const = dict(FROM_MASK=False, HAS_BIAS=False, SPLIT=True, FUSE=True, BLOCK_B=block_b, BLOCK_N=64,
                 BLOCK_K=128 if block_b == 1 else 32, IEEE=False, PREFETCH=False, TILE_SUM=False, ATOMIC=False,
                 WARM_X=warm_x, X_LINE=64, W_CACHE=".cg" if warm_x else "")
    ptx = compile_sm90(fn, const, types, num_warps=4).asm["ptx"]
    print(block_b, warm_x, ptx.count("prefetch.global.L1"), ptx.count("ld.global.cg"))
"""


def test_sparse_gemv_warm_x_compiles_to_l1_prefetches():
    """`GemvConfig.warm_x` is a hardware hint the interpreter cannot run (it takes the plain scan
    there): compiled for an H100/H200 (sm_90) with the toolchain Triton ships, the scanning kernel
    asks for its slice's activation lines in L1 and reads its weights past L1 (``ld.global.cg``),
    at one row and in row blocks, and without it does neither (the epilogue's reads are ``.cg``)."""
    lines = run_for_sm90(_SM90_WARM_X).splitlines()
    counts = {(int(b), int(w)): (int(p), int(cg)) for b, w, p, cg in (line.split() for line in lines)}
    assert counts[(1, 0)][0] == 0 and counts[(1, 32)][0] >= 1 and counts[(16, 32)][0] >= 16, counts
    assert counts[(1, 32)][1] > counts[(1, 0)][1], counts  # the weight loads join the epilogue's .cg reads


def test_per_column_thresholds_need_aligned_runs():
    x, w_t = torch.randn(1, 8, device=DEVICE), torch.randn(8, 48, device=DEVICE)
    t = torch.ones(1, 48, device=DEVICE)
    for segment in (0, 8, 20, 32):  # none, not a multiple of 16, not dividing d_out
        with pytest.raises(ValueError, match="segment"):
            kernels.sparse_gemv_threshold.triton(x, t, w_t, None, segment)
    with pytest.raises(ValueError, match="scalar"):
        kernels.sparse_gemv_threshold.triton(x, torch.ones(2, 48, device=DEVICE), w_t)


@here
@SETTINGS
@given(case=gemv_cases(), p_keep=st.sampled_from([0.0, 0.3, 1.0]))
def test_sparse_linear_mask(case, p_keep):
    x, w_t = case["x"], case["w_t"]
    keep = (torch.rand(x.shape, generator=case["g"]) < p_keep).to(DEVICE)
    weight = w_t.t()  # nn.Linear layout [d_out, d_in]
    with poisoned(), epilogue(case):
        if case["split"] == 0:  # through sparse_linear: x [B, 1, d_in] and the nn.Linear weight
            got = kernels.sparse_linear.triton(x.unsqueeze(1), weight, case["bias"], keep.unsqueeze(1),
                                               workspace=WORKSPACE).squeeze(1)
        else:
            got = kernels.sparse_gemv_mask.triton(x, keep, w_t, case["bias"], workspace=WORKSPACE)
    assert_gemv_close(got, ref.sparse_linear(x, weight, case["bias"], keep), case)


# --------------------------------------------------------------------------------------------------
# Cache append

PAIRS = {"none": (), "min/max": (0, 1), "mean/std": (2, 3), "all": (0, 1, 2, 3)}


@st.composite
def append_cases(draw):
    """A cache with random keys, a length, per-row starts (some after the new slot: a row whose
    token is not visible), poisoned summaries, and the summaries to keep."""
    g = gen(draw(st.integers(0, 2**31 - 1)))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    b, h = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    d = draw(st.sampled_from([8, 64, 80, 128]))
    page = draw(st.sampled_from([1, 3, 4, 16]))
    pages = draw(st.integers(1, 4))
    n = page * pages
    length = draw(st.integers(1, n))
    start = torch.tensor([draw(st.integers(0, length)) for _ in range(b)], dtype=torch.long)
    keys, values = randn(g, b, h, n, d, dtype=dtype), randn(g, b, h, n, d, dtype=dtype)
    k, v = randn(g, b, h, 1, d, dtype=dtype), randn(g, b, h, 1, d, dtype=dtype)
    nan = float("nan")
    summaries = [torch.full((b, h, pages, d), nan, dtype=t, device=DEVICE) for t in (dtype, dtype, torch.float32, torch.float32)]
    kept = draw(st.sampled_from(sorted(PAIRS)))
    summaries = tuple(s if i in PAIRS[kept] else None for i, s in enumerate(summaries))
    return dict(k=k, v=v, keys=keys, values=values, summaries=summaries, start=start.to(DEVICE),
                length=torch.tensor(length, device=DEVICE), page=page)


def _clone(case):
    c = dict(case, keys=case["keys"].clone(), values=case["values"].clone())
    c["summaries"] = tuple(s.clone() if s is not None else None for s in case["summaries"])
    return c


def _append_args(c):
    return c["k"], c["v"], c["keys"], c["values"], c["summaries"], c["start"], c["length"], c["page"]


@here
@SETTINGS
@given(case=append_cases())
def test_cache_append(case):
    """Key and value land at slot length - 1; the touched page's kept summaries equal the reference
    (min and max exactly: they are key values), every other page and slot is left alone."""
    got, want = _clone(case), _clone(case)
    kernels.cache_append.triton(*_append_args(got))
    ref.cache_append(*_append_args(want))
    assert torch.equal(got["keys"], want["keys"]) and torch.equal(got["values"], want["values"])
    for i, (a, e) in enumerate(zip(got["summaries"], want["summaries"])):
        if a is None:
            continue
        tol = dict(rtol=0, atol=0) if i < 2 else dict(rtol=1e-5, atol=1e-5)  # untouched pages stay NaN
        torch.testing.assert_close(a, e, equal_nan=True, **tol)
    page = (int(case["length"]) - 1) // case["page"]
    for s in got["summaries"]:  # the touched page was written everywhere (it started as NaN)
        if s is not None:
            assert not s[:, :, page].isnan().any()


def test_cache_append_refuses_unpaired_summaries_and_bad_shapes():
    keys = torch.zeros(1, 2, 8, 4, device=DEVICE)
    k = torch.zeros(1, 2, 1, 4, device=DEVICE)
    pages = torch.zeros(1, 2, 2, 4, device=DEVICE)
    start, length = torch.zeros(1, dtype=torch.long, device=DEVICE), torch.tensor(3, device=DEVICE)
    with pytest.raises(ValueError, match="min and max together"):
        append_kernel.cache_append(k, k, keys, keys.clone(), (pages, None, None, None), start, length, 4)
    with pytest.raises(ValueError, match="summaries must be"):
        append_kernel.cache_append(k, k, keys, keys.clone(), (pages, pages.clone(), None, None), start, length, 2)
    with pytest.raises(ValueError, match="expected k, v"):
        append_kernel.cache_append(k[:, :1], k, keys, keys.clone(), (None,) * 4, start, length, 4)


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
    assert route.use_triton(cpu) is False  # the CPU default stays on the references
    monkeypatch.setenv("POLICYZOO_TRITON", "1")
    assert route.use_triton(cpu) is True
    monkeypatch.setattr(route, "HAS_TRITON", False)
    assert route.use_triton(cpu) is False


class OpLog(TorchDispatchMode):
    """Records the ``policyzoo`` custom ops called inside it (their names), in order."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "policyzoo":
            self.calls.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


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
    with OpLog() as log:
        out, lse = kernels.decode_attention(*args)
        bound = kernels.quest_page_bound(q, page_min, page_max, 0.125)
        y = kernels.sparse_linear(x, weight, bias, keep)
    assert log.calls == ["decode_attention", "quest_page_bound", "sparse_gemv_mask"]
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
            (q, keys, values, sel.indices, sel.count, sel.log_weight, sel.block, start, length, scale, mode),
            test_utils=checks,
        )
    page_min = torch.randn(2, 2, 5, 64, device=DEVICE)
    for agg in ("none", "max"):
        torch.library.opcheck(
            torch.ops.policyzoo.quest_page_bound.default, (q, page_min, page_min + 1, 0.5, agg), test_utils=checks
        )
    torch.library.opcheck(torch.ops.policyzoo.page_gaussians.default, (q, page_min, page_min.abs(), 0.5), test_utils=checks)
    x, w_t = torch.randn(2, 40, device=DEVICE), torch.randn(40, 24, device=DEVICE)
    idx = torch.stack([torch.randperm(40)[:10] for _ in range(2)]).to(torch.int32).to(DEVICE)
    torch.library.opcheck(torch.ops.policyzoo.sparse_gemv_index.default, (x, idx, w_t, None), test_utils=checks)
    torch.library.opcheck(
        torch.ops.policyzoo.sparse_gemv_threshold.default,
        (x, torch.tensor(0.5, device=DEVICE), w_t, None, 0),
        test_utils=checks,
    )
    torch.library.opcheck(torch.ops.policyzoo.sparse_gemv_mask.default, (x, x > 0, w_t, None), test_utils=checks)
    # With a workspace's buffers, which a launch leaves as it found them (zero): not a mutation.
    with override(gemv=GemvConfig(split=3, min_fused_split=2, block_k=16)):
        torch.library.opcheck(torch.ops.policyzoo.sparse_gemv_mask.default,
                              (x, x > 0, w_t, None, WORKSPACE.gemv_counters, WORKSPACE.gemv_sums), test_utils=checks)
    s = torch.randn(2, 100, device=DEVICE).to(torch.bfloat16)
    with override(select_top=SelectTopConfig(method="histogram", hist_chunk=64)):
        torch.library.opcheck(torch.ops.policyzoo.select_top.default,
                              (s, torch.tensor([3, 40], device=DEVICE), 40, True, WORKSPACE.select_histograms),
                              test_utils=checks)
    keys = torch.randn(2, 2, 8, 16, device=DEVICE)
    mn, mean = torch.randn(2, 2, 2, 16, device=DEVICE), torch.randn(2, 2, 2, 16, device=DEVICE)
    torch.library.opcheck(
        torch.ops.policyzoo.cache_append.default,
        (keys[:, :, :1].clone(), keys[:, :, :1].clone(), keys, keys.clone(), mn, mn.clone(), mean, mean.clone(),
         torch.zeros(2, dtype=torch.long, device=DEVICE), torch.tensor(5, device=DEVICE), 4),
        test_utils=checks,
    )


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


@here
def test_torch_compile_traces_a_workspace_through(monkeypatch):
    """A compiled step that hands the ops a `Workspace` traces without graph breaks (fullgraph),
    computes what the eager calls compute and leaves the workspace zero."""
    monkeypatch.setenv("POLICYZOO_TRITON", "1")
    g = gen(9)
    s, count = randn(g, 3, 300, dtype=torch.bfloat16), torch.tensor([5, 50, 100], device=DEVICE)
    x, w_t = randn(g, 2, 96), randn(g, 96, 64)
    keep = torch.stack([torch.randperm(96, generator=g)[:40] for _ in range(2)]).int().to(DEVICE)

    def step(s, count, x, w_t, keep):
        idx = kernels.select_top(s, count, 100, absolute=True, workspace=WORKSPACE)
        return idx, kernels.sparse_gemv_threshold(x, 0.5, w_t, workspace=WORKSPACE), \
            kernels.sparse_gemv_index(x, keep, w_t, workspace=WORKSPACE)

    torch._dynamo.reset()
    with override(select_top=SelectTopConfig(method="histogram", hist_chunk=64),
                  gemv=GemvConfig(split=3, min_fused_split=2, block_k=16)):  # both take the workspace's buffers
        got = torch.compile(step, fullgraph=True, backend="aot_eager")(s, count, x, w_t, keep)
        want = step(s, count, x, w_t, keep)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1:], want[1:], rtol=1e-5, atol=1e-5)
    assert workspace_is_zero()


@here
def test_compiled_cache_append_writes_the_cache_in_place(monkeypatch):
    """Under Inductor the mutating op runs on the cache's own tensors (re-inplaced, no copy of the
    cache), so a compiled decode step sees its writes; as eager, through the reference."""
    from policyzoo.cache import PagedKVCache

    monkeypatch.setenv("POLICYZOO_TRITON", "1")
    g = gen(3)
    caches = [PagedKVCache(1, 2, 2, 16, 32, page_size=4, summaries=("page_min",), device=DEVICE) for _ in range(2)]
    for c in caches:
        c.keys[0].copy_(randn(gen(1), 2, 2, 32, 16))
        c.reset(torch.tensor([0, 3]), 9)
        c.summarise(0, slice(0, c.num_pages))

    def step(c, k, v):
        c.length += 1
        c.write(0, k, v)
        return c.page_max[0].sum(-1)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    for _ in range(3):
        k, v = randn(g, 2, 2, 1, 16), randn(g, 2, 2, 1, 16)
        got = compiled(caches[0], k, v)
        with monkeypatch.context() as m:
            m.delenv("POLICYZOO_TRITON")
            want = step(caches[1], k, v)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # the compiled sum may add in another order
    for a, b in zip(caches[0].tensors(), caches[1].tensors()):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------------
# Top-count selection


@here
@settings(max_examples=examples(30), deadline=None, database=None)
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
    """Same positions as the reference, ties (frequent in bf16 and after rounding) included, by one
    program; bf16 also by histograms (in chunks of 64, so a row spans up to 5 programs); the
    histogram buffers are zero again after each call."""
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
    want = ref.select_top(s, count, k_max, absolute)
    with override(select_top=SelectTopConfig(method="program")), poisoned():
        got = kernels.select_top.triton(s, count, k_max, absolute, workspace=WORKSPACE)
    assert torch.equal(got, want), "program"
    if dtype == torch.bfloat16:
        with override(select_top=SelectTopConfig(method="histogram", hist_chunk=64)), poisoned():
            got = kernels.select_top.triton(s, count, k_max, absolute, workspace=WORKSPACE)
        assert torch.equal(got, want), "histogram"
        assert workspace_is_zero()


@here
def test_select_top_auto_picks_the_method_by_row_length():
    """``method="auto"``: bf16 rows of `hist_min_n` entries or more by histograms, shorter bf16 rows
    and every fp32 row by one program; the same positions either way."""
    calls = []
    by_histograms = select_kernel.select_by_histograms

    def spy(scores, *args):
        calls.append(scores.shape[-1])
        return by_histograms(scores, *args)

    g = gen(11)
    rule = SelectTopConfig(method="auto", hist_min_n=200, hist_chunk=64)
    with override(select_top=rule), mock.patch.object(select_kernel, "select_by_histograms", spy):
        for n, dtype in ((199, torch.bfloat16), (200, torch.bfloat16), (300, torch.float32)):
            s = torch.randn(2, n, generator=g).to(dtype).to(DEVICE)
            count = torch.tensor([5, n // 2], device=DEVICE)
            with poisoned():
                got = kernels.select_top.triton(s, count, n // 2, True, workspace=WORKSPACE)
            assert torch.equal(got, ref.select_top(s, count, n // 2, True)), (n, dtype)
    assert calls == [200]


@here
def test_select_top_rows_longer_than_the_registers():
    """The kernel holds a row in registers and refuses a longer one; the library's seam sends such
    rows to the reference."""
    s = torch.randn(2, 300).to(DEVICE)
    count = torch.tensor([0, 17], device=DEVICE)
    with mock.patch.object(select_op, "MAX_BLOCK_N", 64):
        with pytest.raises(ValueError, match="at most 64 entries"):
            kernels.select_top.triton(s, count, 20)
        with mock.patch.object(route, "use_triton", lambda t: True):
            assert torch.equal(kernels.select_top(s, count, 20), ref.select_top(s, count, 20))


@here
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(65, 700), rows=st.integers(1, 3), absolute=st.booleans(),
       chunk=st.sampled_from([16, 64]), levels=st.sampled_from([0, 3]))
def test_select_top_long_bf16_rows_by_histograms(seed, n, rows, absolute, chunk, levels):
    """bf16 rows longer than one program holds take the histogram method whatever the config says
    (here rows over 64 entries, chunks of 16 or 64; ``levels`` 3: three distinct values, ties across
    chunks)."""
    g = gen(seed)
    s = torch.randn(rows, n, generator=g)
    if levels:
        s = s.mul(levels / 2).round()
    s = s.to(torch.bfloat16).to(DEVICE)
    k_max = int(torch.randint(1, n + 1, (1,), generator=g))
    count = torch.randint(0, k_max + 1, (rows,), generator=g).to(DEVICE)
    with mock.patch.object(select_op, "MAX_BLOCK_N", 64), \
            override(select_top=SelectTopConfig(method="program", hist_chunk=chunk)), poisoned():
        got = kernels.select_top.triton(s, count, k_max, absolute, workspace=WORKSPACE)
    assert torch.equal(got, ref.select_top(s, count, k_max, absolute))
    assert workspace_is_zero()


@here
def test_select_top_keeps_more_than_2_to_the_15_entries():
    """A row of 40,000 bf16 scores keeping 39,000: the emit launch's running counts pass 2^15 (they
    must not be packed into 16 bits)."""
    s = torch.randn(1, 40000, generator=gen(4)).to(torch.bfloat16).to(DEVICE)
    count = torch.tensor([39000], device=DEVICE)
    got = kernels.select_top.triton(s, count, 39500)  # the histograms made for the call
    assert torch.equal(got, ref.select_top(s, count, 39500))


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
    `interp_steps`)."""
    g = gen(11)
    s = _hard_rows(g, 700).to(dtype).to(DEVICE)
    absolute = dtype == torch.bfloat16
    for k in (5, 6, 350, 700):  # the forced entries (5), one past them, half, all
        count = torch.full((4,), k, device=DEVICE)
        with override(select_top=SelectTopConfig(method="program", interp_steps=interp_steps)), poisoned():
            got = kernels.select_top.triton(s, count, k, absolute=absolute, workspace=WORKSPACE)
        assert torch.equal(got, ref.select_top(s, count, k, absolute=absolute)), (k, interp_steps)


import triton  # noqa: E402  (after the interpreter switch above; pytest.importorskip has found it)
import triton.language as tl  # noqa: E402

ALL_BF16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # every pattern


def _bf16_keys(s, absolute):
    """The fp32 key path's keys of bf16 scores, from their bits: ``(fp32 bits, negatives flipped)
    >> 16``, ``|x|`` clearing the sign bit, -0.0 keyed as +0.0."""
    bits = s.view(torch.int16).to(torch.int32) << 16
    if absolute:
        bits = bits & 0x7FFFFFFF
    bits = torch.where(bits == -(2**31), 0, bits)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits) >> 16


@triton.jit
def _select_top_keys(s_ptr, out_ptr, n, n_out, ABS: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, select_kernel._keys(s_ptr, offs, n, ABS, BITS), mask=offs < n_out)


@here
@pytest.mark.parametrize("absolute", [False, True])
def test_select_top_bf16_keys_from_bits_equal_the_fp32_keys(absolute):
    """The keys `select_top._keys` makes from bf16 bits are those of the fp32 path (fp32 and fp16
    scores) shifted right by 16, for all 65,536 patterns (±0, ±inf, subnormals, NaNs of either sign
    and any payload), the fp32 path reading the same values widened by torch; both are -2^31 off
    the end, and order non-NaN scores as floats do (equal keys for equal scores)."""
    want = _bf16_keys(ALL_BF16, absolute)
    n = len(ALL_BF16)
    for bits in (True, False):
        s = ALL_BF16.view(torch.int16) if bits else ALL_BF16.float()  # torch widens NaN payloads and subnormals exactly
        out = torch.full((n + 16,), 7, dtype=torch.int32, device=DEVICE)
        _select_top_keys[(n // 1024 + 1,)](s.to(DEVICE), out, n, n + 16, ABS=absolute, BITS=bits, BLOCK=1024)
        out = out.cpu()
        assert bool((out[n:] == -(2**31)).all()), bits
        assert torch.equal(out[:n] if bits else out[:n] >> 16, want), bits
    x = ALL_BF16.float().abs() if absolute else ALL_BF16.float()
    x, order = x[~x.isnan()].sort()
    key = want[~ALL_BF16.isnan()][order]
    assert bool((key.diff() >= 0).all()) and torch.equal(key.diff() > 0, x.diff() > 0)


@here
def test_select_top_rows_of_bf16_patterns():
    """Rows drawn from every bf16 pattern select what the reference selects by each method: random
    non-NaN patterns; ±0, ±inf, the smallest and largest subnormals and normals, and ties;
    NaN rows. The reference ranks every NaN above +inf and takes no NaN (`reference.select_top`),
    while the keys rank NaNs by sign and payload (above +inf, or below -inf): NaN rows are checked
    against the reference run on the keys."""
    g = gen(5)
    finite = ALL_BF16[~ALL_BF16.isinf() & ~ALL_BF16.isnan()]
    special = torch.tensor([0x0000, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x8001, 0x007F, 0x807F, 0x0080, 0x8080,
                            0x7F7F, 0xFF7F], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)

    def pick(pool, n):
        return pool[torch.randint(len(pool), (n,), generator=g)]

    s = torch.stack([
        pick(finite, 96),
        pick(special, 96),  # every one of them, many times: ties
        torch.cat([special, -special, pick(special, 24), pick(finite, 48)])[torch.randperm(96, generator=g)],
    ]).to(DEVICE)
    nans = torch.cat([pick(ALL_BF16[ALL_BF16.isnan()], 32), pick(special, 32), pick(finite, 32)])
    nan = nans[torch.randperm(96, generator=g)][None].to(DEVICE)
    count = torch.tensor([1, 52, 95], device=DEVICE)  # 52 of the specials: among the ±0 (signed)
    # One program; histograms in chunks of 32; "auto" from rows of 96 entries (these rows by
    # histograms) and from 97 (these rows by one program).
    methods = (SelectTopConfig(method="program"), SelectTopConfig(method="histogram", hist_chunk=32),
               SelectTopConfig(method="auto", hist_min_n=96, hist_chunk=32),
               SelectTopConfig(method="auto", hist_min_n=97, hist_chunk=32))
    for cfg in methods:
        for absolute in (False, True):
            with override(select_top=cfg), poisoned():
                got = kernels.select_top.triton(s, count, 95, absolute, workspace=WORKSPACE)
                got_nan = kernels.select_top.triton(nan.expand(3, -1), count, 95, absolute, workspace=WORKSPACE)
            assert torch.equal(got, ref.select_top(s, count, 95, absolute)), (cfg, absolute)
            keys = _bf16_keys(nan.cpu(), absolute).float().expand(3, -1)
            assert torch.equal(got_nan.cpu(), ref.select_top(keys, count.cpu(), 95)), (cfg, absolute)


@here
@pytest.mark.parametrize("n", [129, 150, 257, 4100])
def test_select_top_row_with_a_tail_tile(n):
    """A row just over a power of two is held as a tile and a small tail (`select_top.tiles`):
    the tail's keys are counted and emitted after the tile's, ties ranked across both."""
    block, tail = select_op.tiles(n)
    assert 0 < tail < block and n <= block + tail
    g = gen(n)
    s = ((torch.randn(2, n, generator=g) * 2).round() / 2).to(DEVICE)  # ties across the boundary
    count = torch.tensor([n // 3, n - 1], device=DEVICE)
    with poisoned():
        got = kernels.select_top.triton(s, count, n, workspace=WORKSPACE)
    assert torch.equal(got, ref.select_top(s, count, n))


def test_select_top_reference_semantics():
    s = torch.tensor([[0.5, 2.0, -1.0, 2.0, 0.0, -torch.inf]])
    # the 3 largest: 2.0 (pos 1), 2.0 (pos 3), 0.5 (pos 0) -> ascending positions, then zeros
    assert ref.select_top(s, torch.tensor([3]), 5).tolist() == [[0, 1, 3, 0, 0]]
    # a tie at the boundary goes to the lower position; |x| with absolute
    assert ref.select_top(s, torch.tensor([1]), 2).tolist() == [[1, 0]]
    assert ref.select_top(torch.tensor([[-3.0, 1.0, 2.0]]), torch.tensor([2]), 2, absolute=True).tolist() == [[0, 2]]

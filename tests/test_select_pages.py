"""The fused selection (`kernels.select_pages`, `kernels.select_page_scores`,
`kernels.select_scores`) against the steps it replaces: the same Selection, entry for entry, so that
no token changes.

`select_scores` is checked against its reference (the masks, the bf16 ranking and `select_top`'s
reference) exactly. `select_pages` scores the pages itself: it is checked against the grouped bound's
own kernel followed by that reference, since the reference's bound sums in another order and may
round a page's bound to the other side of a bf16 step. The policies that use them (`Quest`,
`EntmaxKV(mode="topk")`, `SSA`'s candidates) are checked against their steps, on the reference path
and on the kernels' path. Without a GPU the kernels run in Triton's interpreter (see
`triton_mode` for the fresh-interpreter detour when triton was loaded compiled).
"""

from __future__ import annotations

import itertools

from triton_mode import MODE, examples, poisoned as poisoned_buffers, run_for_sm90, run_in_fresh_interpreter  # first: it may set TRITON_INTERPRET before triton loads

import torch  # noqa: E402

from contextlib import contextmanager  # noqa: E402
from unittest import mock  # noqa: E402

import pytest  # noqa: E402
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from policyzoo import kernels  # noqa: E402
from policyzoo.kernels import PageScoreConfig, SelectPagesConfig, route  # noqa: E402
from policyzoo.kernels import reference as ref  # noqa: E402
from policyzoo.kernels.config import override  # noqa: E402
from policyzoo.kernels.ops import select_pages as select_op  # noqa: E402
from policyzoo.kv import SSA, EntmaxKV, Quest  # noqa: E402

pytestmark = pytest.mark.skipif(not route.HAS_TRITON, reason="triton does not import here")
here = pytest.mark.skipif(MODE == "subprocess", reason="run by test_select_pages_in_fresh_interpreter")

DEVICE = torch.device("cuda" if MODE == "cuda" else "cpu")
WORKSPACE = kernels.Workspace(DEVICE) if MODE != "subprocess" else None
SETTINGS = settings(max_examples=examples(25), deadline=None, database=None)
# Rows from this length are chosen by a launch of their own: every row (0), rows longer than most
# drawn rows, and none of them (the default's 2,048).
FINISH_MIN_ROWS = st.sampled_from([0, 100, 2048])


@pytest.mark.skipif(MODE != "subprocess", reason="the kernels run in this process")
def test_select_pages_in_fresh_interpreter():
    run_in_fresh_interpreter(__file__)


def workspace_is_zero() -> bool:
    return all(int(b.abs().sum()) == 0 for b in WORKSPACE.buffers.values())


def poisoned():
    """Every buffer the kernel allocates starts as NaN (integer buffers as -7)."""
    from policyzoo.kernels.ops.select_pages import kernel

    return poisoned_buffers(kernel)


@contextmanager
def steps_only():
    """The fused kernels take no rows: the policies take the steps (the old path)."""
    with mock.patch.object(select_op, "MAX_ROW", 0):
        yield


def assert_same(got, want, what=""):
    assert torch.equal(got[1].cpu(), want[1].cpu()), f"{what}: counts {got[1].tolist()} != {want[1].tolist()}"
    assert torch.equal(got[0].cpu(), want[0].cpu()), f"{what}: indices {got[0].tolist()} != {want[0].tolist()}"


# ------------------------------------------------------------------------------ select_scores
@st.composite
def score_rows(draw):
    """``(scores, forced, count, k_max)`` on the kernel's device: ties (frequent after the bf16
    rounding), invalid (-inf) and unforced +inf entries, forced flags per row or per KV head, counts
    per row or per KV head (beyond k_max and the valid entries too)."""
    b, h_kv = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    n = draw(st.integers(1, 300))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scores = torch.randn(b, h_kv, n, generator=g) * draw(st.sampled_from([1e-3, 1.0, 1e3]))
    if draw(st.booleans()):
        scores = (scores * 4).round() / 4  # many equal scores, ±0 among them
    if draw(st.booleans()):
        scores = torch.where(torch.rand(b, h_kv, n, generator=g) < 0.3, -torch.inf, scores)
    if draw(st.booleans()):
        scores = torch.where(torch.rand(b, h_kv, n, generator=g) < 0.05, torch.inf, scores)
    per_head = draw(st.booleans())
    forced = torch.rand(b, h_kv, n, generator=g) if per_head else torch.rand(b, n, generator=g)
    forced = forced < draw(st.sampled_from([0.0, 0.05, 0.5]))
    k_max = draw(st.integers(0, n))
    count = torch.randint(0, k_max + 3, (b, h_kv) if draw(st.booleans()) else (b,), generator=g)
    return scores.to(DEVICE), forced.to(DEVICE), count.to(DEVICE), k_max


@here
@SETTINGS
@given(rows=score_rows(), block_n=st.sampled_from([16, 64, 512]), group=st.sampled_from([4, 32]),
       workspace=st.booleans(), finish_min_row=FINISH_MIN_ROWS)
def test_select_scores_matches_the_reference(rows, block_n, group, workspace, finish_min_row):
    """The same indices and counts as the steps' specification, over one or several programs per
    row, the choice made by the last scoring program or by a launch of its own; the workspace is zero
    again after each call."""
    scores, forced, count, k_max = rows
    want = ref.select_scores(scores.cpu(), forced.cpu(), count.cpu(), k_max)
    with override(select_pages=SelectPagesConfig(block_n=block_n, group=group, finish_min_row=finish_min_row)), poisoned():
        got = kernels.select_scores.triton(scores, forced, count, k_max, workspace=WORKSPACE if workspace else None)
    assert got[0].shape == (*scores.shape[:2], k_max) and got[0].dtype == torch.int32 and got[1].dtype == torch.int32
    assert_same(got, want)
    assert workspace_is_zero()


@here
def test_select_scores_rows_of_bf16_patterns():
    """Every bf16 value class in one row: both zeros, denormals, the largest finite values (which
    round to ±inf), infinities, forced entries among them, and a row of one value (one bin)."""
    vals = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3.39e38, -3.39e38, 1.0, -1.0, 1.00390625, 1.0078125, 2.0, -2.0,
                         torch.inf, -torch.inf, 5.0, 5.0, 5.0])
    scores = torch.stack([vals, torch.full_like(vals, 3.0)])[None].to(DEVICE)
    forced = torch.zeros(1, vals.numel(), dtype=torch.bool, device=DEVICE)
    forced[0, 9] = True
    for k_max, c, own in itertools.product((1, 4, 9, 17), (0, 1, 3, 8, 17), (0, 2048)):
        count = torch.tensor([c], device=DEVICE)
        with override(select_pages=SelectPagesConfig(block_n=16, group=4, finish_min_row=own)), poisoned():
            got = kernels.select_scores.triton(scores, forced, count, k_max, workspace=WORKSPACE)
        assert_same(got, ref.select_scores(scores.cpu(), forced.cpu(), count.cpu(), k_max), f"{k_max=} {c=} {own=}")
    assert workspace_is_zero()


@here
@SETTINGS
@given(repeats=st.lists(st.integers(0, 6), min_size=16, max_size=16), seed=st.integers(0, 2**31 - 1),
       data=st.data())
def test_select_scores_finds_the_threshold_within_one_bin(repeats, seed, data):
    """Every key of the row in one histogram bin: the 16 consecutive bf16 values from 1.0, each
    repeated 0-6 times in a shuffled row, and any count. The threshold is then found by the search
    within the bin alone (every low value of the key a threshold), ties kept by position."""
    vals = 1.0 + torch.arange(16) / 128  # consecutive bf16 values, one bin of the 4,096
    row = vals.repeat_interleave(torch.tensor(repeats))
    if row.numel() == 0:
        row = vals[:1]
    row = row[torch.randperm(row.numel(), generator=torch.Generator().manual_seed(seed))]
    scores = row[None, None].to(DEVICE)
    forced = torch.zeros(1, row.numel(), dtype=torch.bool, device=DEVICE)
    k_max = data.draw(st.integers(1, row.numel()))
    count = torch.tensor([data.draw(st.integers(0, k_max))], device=DEVICE)
    own = data.draw(FINISH_MIN_ROWS)
    with override(select_pages=SelectPagesConfig(block_n=16, group=4, finish_min_row=own)), poisoned():
        got = kernels.select_scores.triton(scores, forced, count, k_max, workspace=WORKSPACE)
    assert_same(got, ref.select_scores(scores.cpu(), forced.cpu(), count.cpu(), k_max))
    assert workspace_is_zero()


# ------------------------------------------------------------------------------- select_pages
@st.composite
def page_rows(draw):
    """The box selection's arguments: rows with left padding, a short or empty row, sinks and
    window, any of the count forms; head dims that take the bound's tl.dot or its loop."""
    b, h_kv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 4))
    d = draw(st.sampled_from([8, 32]))
    page = draw(st.sampled_from([4, 16]))
    n_pages = draw(st.integers(1, 80))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(b, h_kv * group, d, generator=g)
    lo = torch.randn(b, h_kv, n_pages, d, generator=g)
    hi = lo + torch.rand(b, h_kv, n_pages, d, generator=g) * 2
    length = draw(st.integers(1, n_pages * page))
    start = torch.tensor([draw(st.integers(0, length + 3)) for _ in range(b)])  # past length: an empty row
    sinks, window = draw(st.integers(0, 8)), draw(st.integers(0, 40))
    k_max = draw(st.integers(1, n_pages))
    kind = draw(st.sampled_from(["ratio", "pages", "row", "head"]))
    ratio = draw(st.sampled_from([0.05, 0.1, 0.3, 1.0])) if kind == "ratio" else 0.0
    pages = draw(st.integers(0, n_pages + 2)) if kind == "pages" else 0
    count = None
    if kind in ("row", "head"):
        count = torch.randint(0, k_max + 3, (b,) if kind == "row" else (b, h_kv), generator=g).to(DEVICE)
    scale = d**-0.5
    args = [t.to(dtype).to(DEVICE) for t in (q, lo, hi)] + [start.to(DEVICE), torch.tensor(length, device=DEVICE)]
    return args, scale, k_max, count, dict(page_size=page, sinks=sinks, window=window, ratio=ratio, pages=pages)


def steps_of(args, scale, k_max, count, opts):
    """`select_pages` as the steps: the grouped bound's kernel, then the reference's masks, counts,
    ranking and selection (as `kv.choose.choose_topk_steps` composes them)."""
    q, lo, hi, start, length = args
    scores = kernels.quest_page_bound_grouped.triton(q, lo, hi, scale, "max").cpu()
    first, last = ref.visible_pages(start.cpu(), length.cpu(), opts["page_size"], lo.shape[2])
    seen = first < last
    scores = scores.masked_fill(~seen[:, None, :], -torch.inf)
    forced = seen & ((first < start.cpu()[:, None] + opts["sinks"]) | (last > length.cpu() - max(opts["window"], 1)))
    if count is None:
        count = ref.page_count(seen.sum(-1), opts["ratio"], opts["pages"])
    return ref.select_scores(scores, forced, count.cpu(), k_max)


@here
@SETTINGS
@given(rows=page_rows(), block_p=st.sampled_from([16, 64]), group=st.sampled_from([8, 32]), finish_min_row=FINISH_MIN_ROWS)
@example(  # a keep ratio that lands on a whole count: 30 visible pages at 0.1 keep 3 (float64 rule, not fp32)
    rows=([torch.randn(1, 2, 32), torch.randn(1, 1, 30, 32), torch.randn(1, 1, 30, 32) + 3,
           torch.tensor([0]), torch.tensor(480)], 32**-0.5, 12, None,
          dict(page_size=16, sinks=0, window=0, ratio=0.1, pages=0)),
    block_p=16, group=8, finish_min_row=2048,
)
def test_select_pages_matches_the_steps(rows, block_p, group, finish_min_row):
    """The same pages and counts as the grouped bound's kernel followed by the steps' reference."""
    args, scale, k_max, count, opts = rows
    args = [a.to(DEVICE) for a in args]
    with override(page_score=PageScoreConfig(block_p=block_p)):
        want = steps_of(args, scale, k_max, count, opts)
        with override(select_pages=SelectPagesConfig(block_p=block_p, group=group, finish_min_row=finish_min_row)), poisoned():
            got = kernels.select_pages.triton(*args, scale, k_max, count, **opts, workspace=WORKSPACE)
    assert_same(got, want)
    assert workspace_is_zero()


# ------------------------------------------------------------------------- select_page_scores
@st.composite
def page_score_rows(draw):
    """`select_page_scores`' arguments: given page scores (ties, -inf), rows with left padding or
    empty, sinks and window, any count form; the entries the pages themselves or listed page ids
    (a second stage's candidates: ascending, -1 for empty entries, per KV head)."""
    b, h_kv = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    page = draw(st.sampled_from([4, 16]))
    n_pages = draw(st.integers(1, 120))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    length = draw(st.integers(1, n_pages * page))
    start = torch.tensor([draw(st.integers(0, length + 3)) for _ in range(b)])
    sinks, window = draw(st.integers(0, 8)), draw(st.integers(0, 40))
    listed = draw(st.booleans())
    n = draw(st.integers(1, n_pages)) if listed else n_pages
    scores = torch.randn(b, h_kv, n, generator=g)
    if draw(st.booleans()):
        scores = (scores * 2).round() / 2
    if draw(st.booleans()):
        scores = torch.where(torch.rand(b, h_kv, n, generator=g) < 0.2, -torch.inf, scores)
    ids = None
    if listed:
        ids = torch.sort(torch.rand(b, h_kv, n_pages, generator=g).argsort(-1)[..., :n], -1).values
        ids = torch.where(torch.rand(b, h_kv, n, generator=g) < 0.2, -1, ids).int()
    k_max = draw(st.integers(1, n))
    kinds = ["row", "head"] if listed else ["ratio", "pages", "row", "head"]
    kind = draw(st.sampled_from(kinds))
    ratio = draw(st.sampled_from([0.05, 0.1, 0.3, 1.0])) if kind == "ratio" else 0.0
    pages = draw(st.integers(0, n_pages + 2)) if kind == "pages" else 0
    count = None
    if kind in ("row", "head"):
        count = torch.randint(0, k_max + 3, (b,) if kind == "row" else (b, h_kv), generator=g)
    opts = dict(page_size=page, sinks=sinks, window=window, ratio=ratio, pages=pages, ids=ids)
    return scores, start, torch.tensor(length), k_max, count, opts


def to_device(opts):
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in opts.items()}


@here
@SETTINGS
@given(rows=page_score_rows(), block_n=st.sampled_from([16, 64, 512]), finish_min_row=FINISH_MIN_ROWS)
def test_select_page_scores_matches_the_reference(rows, block_n, finish_min_row):
    """The same positions and counts as its reference, over one or several programs per row and
    with the choice in the scoring launch or its own; the workspace is zero again after each call."""
    scores, start, length, k_max, count, opts = rows
    want = ref.select_page_scores(scores, start, length, k_max, count, **opts)
    dev = [t.to(DEVICE) for t in (scores, start, length)]
    with override(select_pages=SelectPagesConfig(block_n=block_n, group=4, finish_min_row=finish_min_row)), poisoned():
        got = kernels.select_page_scores.triton(*dev, k_max, None if count is None else count.to(DEVICE),
                                                **to_device(opts), workspace=WORKSPACE)
    assert got[0].shape == (*scores.shape[:2], k_max)
    assert_same(got, want)
    assert workspace_is_zero()


@here
@settings(max_examples=15, deadline=None, database=None)
@given(rows=page_score_rows())
def test_select_page_scores_reference_is_select_scores_on_the_page_flags(rows):
    """The reference is `select_scores` of the scores masked where a page holds no visible slot,
    with the pages of the sinks and the window forced (`forced_pages`' rule, written out here from
    the visible slots of each listed page)."""
    scores, start, length, k_max, count, opts = rows
    page, sinks, window, ids = opts["page_size"], opts["sinks"], max(opts["window"], 1), opts["ids"]
    b, h_kv, n = scores.shape
    ids = torch.arange(n).expand(b, h_kv, n) if ids is None else ids
    seen = torch.zeros(b, h_kv, n, dtype=torch.bool)
    forced = torch.zeros(b, h_kv, n, dtype=torch.bool)
    for r, h, j in itertools.product(range(b), range(h_kv), range(n)):
        p = int(ids[r, h, j])
        slots = [t for t in range(p * page, (p + 1) * page) if int(start[r]) <= t < int(length)] if p >= 0 else []
        seen[r, h, j] = bool(slots)
        forced[r, h, j] = any(t < int(start[r]) + sinks or t >= int(length) - window for t in slots)
    wanted = count
    if count is None:
        wanted = ref.page_count(seen[:, 0].sum(-1), opts["ratio"], opts["pages"])
    want = ref.select_scores(scores.masked_fill(~seen, -torch.inf), forced, wanted, k_max)
    assert_same(ref.select_page_scores(scores, start, length, k_max, count, **opts), want)


def test_select_page_scores_needs_a_count_for_listed_pages():
    """A keep ratio counts a row's pages, which a list of candidates does not hold: refused."""
    scores = torch.randn(1, 1, 4)
    ids = torch.tensor([[[0, 3, 5, -1]]])
    with pytest.raises(ValueError, match="needs a count"):
        ref.select_page_scores(scores, torch.tensor([0]), torch.tensor(100), 2, None, 16, 0, 0, 0.5, 0, ids)
    if route.HAS_TRITON and MODE != "subprocess":
        with pytest.raises(ValueError, match="needs a count"):
            kernels.select_page_scores.triton(scores.to(DEVICE), torch.tensor([0], device=DEVICE),
                                              torch.tensor(100, device=DEVICE), 2, None, 16, 0, 0, 0.5, 0,
                                              ids.to(DEVICE))


@here
def test_select_pages_reference_is_the_steps_on_the_reference_path():
    """The reference is the composition of the references: the same as `steps_of` with the grouped
    bound's reference (what the policies computed on CPU before)."""
    g = torch.Generator().manual_seed(4)
    q, lo = torch.randn(2, 4, 16, generator=g), torch.randn(2, 2, 20, 16, generator=g)
    hi, start, length = lo + 1, torch.tensor([0, 21]), torch.tensor(300)
    opts = dict(page_size=16, sinks=4, window=16, ratio=0.25, pages=0)
    got = ref.select_pages(q, lo, hi, start, length, 0.25, 8, None, **opts)
    with mock.patch.object(kernels.quest_page_bound_grouped, "triton", kernels.quest_page_bound_grouped.reference):
        want = steps_of([q, lo, hi, start, length], 0.25, 8, None, opts)
    assert_same(got, want)


@here
def test_select_ops_refuse_rows_longer_than_they_take():
    """The kernels hold a row in registers: longer rows are refused by the op, and the public
    functions send them to the reference; the policies take the steps (`kv.choose.fused_rows`)."""
    scores = torch.randn(1, 2, 40, device=DEVICE)
    forced = torch.zeros(1, 40, dtype=torch.bool, device=DEVICE)
    count = torch.tensor([5], device=DEVICE)
    with mock.patch.object(select_op, "MAX_ROW", 32):
        with pytest.raises(ValueError, match="at most 32 entries"):
            kernels.select_scores.triton(scores, forced, count, 8)
        with mock.patch.object(route, "use_triton", lambda t: True):
            assert_same(kernels.select_scores(scores, forced, count, 8), ref.select_scores(scores, forced, count, 8))
        assert not kernels.select_pages_takes(40) and kernels.select_pages_takes(32)


@here
def test_given_scores_take_the_fused_kernel_up_to_the_configured_row():
    """`choose_topk` sends rows of given scores to `select_scores` up to `MAX_SCORES_ROW` entries
    (16,384), and the choice is the same either way; the box selection's limit is the kernel's own row."""
    from policyzoo.kv.choose import choose_topk, fused_rows

    limit = select_op.MAX_SCORES_ROW
    assert fused_rows(limit) and not fused_rows(limit + 1) and kernels.select_pages_takes(8192)
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(1, 2, 300, generator=g).to(DEVICE)
    forced = torch.zeros(1, 300, dtype=torch.bool, device=DEVICE)
    forced[:, :3] = True
    count = torch.tensor([20], device=DEVICE)
    fused = choose_topk(scores, forced, 24, count)
    with mock.patch.object(select_op, "MAX_SCORES_ROW", 256):
        assert not fused_rows(300) and fused_rows(256)
        steps = choose_topk(scores, forced, 24, count)
    assert_same((fused.indices, fused.count), (steps.indices, steps.count))


@here
def test_select_ops_opcheck():
    """Schemas and fake (meta) implementations, with and without the workspace's histograms (which a
    launch leaves as it found them: zero, so not a mutation)."""
    checks = "test_schema", "test_faketensor"
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(2, 2, 50, generator=g).to(DEVICE)
    forced = (torch.rand(2, 50, generator=g) < 0.1).to(DEVICE)
    count = torch.tensor([4, 9], device=DEVICE)
    for hist in (None, WORKSPACE.select_histograms):
        torch.library.opcheck(torch.ops.policyzoo.select_scores.default, (scores, forced, count, 12, hist),
                              test_utils=checks)
    q, lo = torch.randn(2, 4, 16, generator=g).to(DEVICE), torch.randn(2, 2, 20, 16, generator=g).to(DEVICE)
    start, length = torch.tensor([0, 3], device=DEVICE), torch.tensor(300, device=DEVICE)
    ids = torch.arange(50, device=DEVICE).expand(2, 2, 50).int() - 1
    for cnt, ratio, listed in ((None, 0.3, None), (count, 0.0, None), (count, 0.0, ids)):
        torch.library.opcheck(torch.ops.policyzoo.select_page_scores.default,
                              (scores, start, length, 12, cnt, 16, 4, 16, ratio, 0, listed, WORKSPACE.select_histograms),
                              test_utils=checks)
    for cnt, ratio in ((None, 0.3), (count, 0.0)):
        torch.library.opcheck(torch.ops.policyzoo.select_pages.default,
                              (q, lo, lo + 1, start, length, 0.25, 6, cnt, 16, 4, 16, ratio, 0,
                               WORKSPACE.select_histograms), test_utils=checks)
    assert workspace_is_zero()


@here
def test_select_ops_trace_through_torch_compile(monkeypatch):
    """A compiled step calling both ops with a workspace traces without graph breaks and agrees."""
    monkeypatch.setenv("POLICYZOO_TRITON", "1")
    g = torch.Generator().manual_seed(3)
    q, lo = torch.randn(1, 4, 16, generator=g).to(DEVICE), torch.randn(1, 2, 30, 16, generator=g).to(DEVICE)
    start, length = torch.tensor([2], device=DEVICE), torch.tensor(470, device=DEVICE)

    def step(q, lo, start, length):
        idx, kept = kernels.select_pages(q, lo, lo + 1, start, length, 0.25, 8, None, 16, 4, 16, 0.2, 0,
                                         workspace=WORKSPACE)
        scores = idx.float() * -1.0
        return kernels.select_scores(scores, idx > 5, kept, 4, workspace=WORKSPACE)

    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, lo, start, length)
    assert_same(got, step(q, lo, start, length))
    assert workspace_is_zero()


_SM90_SELECT = """
from policyzoo.kernels.ops.select_pages import kernel as K
from policyzoo.kernels.ops.select_top import tiles
pointers = dict(s_ptr="*fp32", f_ptr="*u8", cnt_ptr="*i64", start_ptr="*i64", len_ptr="*i64", keys_ptr="*i16",
                ws_ptr="*i32", idx_ptr="*i32", kept_ptr="*i32", q_ptr="*bf16", mn_ptr="*bf16", mx_ptr="*bf16",
                scale="fp32", ratio_bits="i64")
block, tail = tiles(300)
rows = dict(GROUP=32, NB=K.HIST_BINS, LOW=K.LOW_BITS, ROW_BLOCK=block, ROW_TAIL=tail)
variants = [(K._select_scores_kernel, dict(FLAGS=f, COUNT=c, BLOCK=512, **rows), {"f_ptr": "*i32"} if f == 2 else {})
            for f, c in ((1, 2), (2, 1))]
variants.append((K._select_pages_kernel, dict(G=4, G_PAD=16, D=128, D_PAD=128, BLOCK_P=64, DOT=True, IEEE=False,
                                              COUNT=2, **rows), {}))
for fn, const, types in variants:
    assert compile_sm90(fn, const, {**pointers, **types}, num_warps=4).asm["cubin"]
print("compiled")
"""


def test_select_kernels_compile_for_sm90():
    """The interpreter runs code the compiler refuses: the selection kernels, for given scores with
    flags, page spans or listed page ids, and for the box's own bound, compile for an H100/H200
    (sm_90) with the toolchain Triton ships, no GPU needed."""
    assert "compiled" in run_for_sm90(_SM90_SELECT)


# ----------------------------------------------------------------------------- the policies
POLICIES = {
    "quest box": lambda page: Quest(0.3, page=page, sinks=2, window=8),
    "quest box tokens": lambda page: Quest(37, page=page, sinks=0, window=0),
    "quest box rescore": lambda page: Quest(0.25, page=page, rescore=2),
    "quest nominate": lambda page: Quest(0.2, page=page, bound="sketch", nominate=2),
    "quest sketch": lambda page: Quest(0.2, page=page, bound="sketch"),
    "quest sketch tokens": lambda page: Quest(37, page=page, bound="sketch", sinks=5, window=3),
    "quest sketch rescore": lambda page: Quest(0.25, page=page, bound="sketch", rescore=2),
    "quest sum": lambda page: Quest(0.3, page=page, aggregate="sum"),
    "entmax topk": lambda page: EntmaxKV(0.3, page=page, mode="topk"),
    "entmax topk sketch": lambda page: EntmaxKV(0.3, page=page, mode="topk", bound="sketch"),
    "entmax gaussian": lambda page: EntmaxKV(0.5, page=page),
    "ssa rescore": lambda page: SSA(0.2, 0.1, page=page, rescore=2, seed=3),
}


@here
@settings(max_examples=6, deadline=None, database=None)
@given(data=st.data(), name=st.sampled_from(sorted(POLICIES)), kernels_path=st.booleans())
def test_policies_choose_what_their_steps_choose(data, cases, name, kernels_path):
    """Each policy that takes the fused path selects exactly what it selected through the steps,
    on the reference path and on the kernels' path (POLICYZOO_TRITON=1), on the kernels' device."""
    case = data.draw(cases(page_sizes=(4, 16), max_prompt=40, sketch=(True,), device=DEVICE))
    policy = POLICIES[name](case.page)
    with pytest.MonkeyPatch.context() as mp:
        if kernels_path:
            mp.setenv("POLICYZOO_TRITON", "1")
        else:
            mp.delenv("POLICYZOO_TRITON", raising=False)
        policy.reset_random()
        with steps_only():
            want = policy.select(case.state(), case.q)
        policy.reset_random()
        got = policy.select(case.state(), case.q)
    assert torch.equal(got.count, want.count), name
    valid = want.entry_valid()
    assert torch.equal(got.indices[valid], want.indices[valid]), name
    if want.log_weight is not None:
        torch.testing.assert_close(got.log_weight, want.log_weight)

"""`kernels.community_choice` (CommunityKV's choice of communities) against its reference: the same
count, the same kept tokens (their order is not part of the contract), the forced tokens after them,
zeros after those, the same candidates, and a workspace left zero. Without a GPU the kernels run in
Triton's interpreter (`triton_mode`: in a fresh one when triton was loaded compiled)."""

from __future__ import annotations

from triton_mode import MODE, examples, poisoned, run_in_fresh_interpreter  # first: it may set TRITON_INTERPRET before triton loads

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from policyzoo import kernels  # noqa: E402
from policyzoo.kernels import CommunityChoiceConfig, route  # noqa: E402
from policyzoo.kernels import reference as ref  # noqa: E402
from policyzoo.kernels.config import override  # noqa: E402

pytestmark = pytest.mark.skipif(not route.HAS_TRITON, reason="triton does not import here")
here = pytest.mark.skipif(MODE == "subprocess", reason="run by test_community_choice_in_fresh_interpreter")

DEVICE = torch.device("cuda" if MODE == "cuda" else "cpu")
WORKSPACE = kernels.Workspace(DEVICE) if MODE != "subprocess" else None
SETTINGS = settings(max_examples=examples(40), deadline=None, database=None)


@pytest.mark.skipif(MODE != "subprocess", reason="the kernels run in this process")
def test_community_choice_in_fresh_interpreter():
    run_in_fresh_interpreter(__file__)


def kernel_buffers_poisoned():
    from policyzoo.kernels.ops.community_choice import kernel

    return poisoned(kernel)


@st.composite
def layouts(draw):
    """A layer's communities as `CommunityKV` lays them out, group mode: per row and KV head, its
    visible tokens (some of them, in any order) dealt to ``C`` communities (some empty), each range
    followed by spare slots; scores with ties and infinities; a budget and the forced tokens. With
    ``stale``, the ranges also hold slots past the length (a rewound cache's), which are not taken:
    then ``k_max`` covers every range, the reference's condition for seeing all of them."""
    b, heads = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    capacity = draw(st.integers(1, 160))
    length = draw(st.integers(1, capacity))
    starts = [draw(st.integers(0, length - 1)) for _ in range(b)]
    c = draw(st.integers(1, 70))
    spare = draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    stale = draw(st.booleans())
    gen = torch.Generator().manual_seed(seed)
    width = capacity + c * (spare + 1) + 1
    order = torch.full((b, heads, width), -3, dtype=torch.int32)  # unused entries: never read
    size = torch.zeros(b, heads, c, dtype=torch.long)
    room = torch.zeros(b, heads, c, dtype=torch.long)
    offset = torch.zeros(b, heads, c, dtype=torch.long)
    for r in range(b):
        for h in range(heads):
            slots = starts[r] + torch.randperm((capacity if stale else length) - starts[r], generator=gen)
            slots = slots[: draw(st.integers(0, len(slots)))]
            member = torch.randint(0, c, (len(slots),), generator=gen)
            if draw(st.booleans()):  # skewed: most tokens in one community
                member = torch.where(torch.rand(len(slots), generator=gen) < 0.7, 0, member)
            sizes = torch.bincount(member, minlength=c)
            ends = (sizes + spare).cumsum(0)
            offs = ends - sizes - spare
            for i in range(c):
                order[r, h, offs[i] : offs[i] + sizes[i]] = slots[member == i].int()
            # Room left: up to the spare slots, fewer where appends took some (ties for the roomiest).
            left = torch.randint(0, spare + 1, (c,), generator=gen)
            size[r, h], offset[r, h], room[r, h] = sizes, offs, torch.where(sizes > 0, sizes + left, 0)
    levels = draw(st.sampled_from([3, 20, 1000]))
    scores = torch.randint(-levels, levels + 1, (b, heads, c), generator=gen).float() / 4
    if draw(st.booleans()):
        scores = torch.where(torch.rand(b, heads, c, generator=gen) < 0.1, torch.inf, scores)
        scores = torch.where(torch.rand(b, heads, c, generator=gen) < 0.1, -torch.inf, scores)
    sinks, window = draw(st.integers(0, 5)), draw(st.integers(1, 6))
    start = torch.tensor(starts)
    n_valid = length - start
    n_forced = torch.clamp(n_valid, max=min(sinks, capacity) + min(window, capacity))
    k_max = draw(st.integers(capacity if stale else min(sinks + window, capacity), capacity + 4))
    free = torch.minimum(torch.randint(0, capacity + 1, (b,), generator=gen), k_max - n_forced).clamp(min=0)
    top = draw(st.integers(1, 10))
    return dict(scores=scores, size=size, room=room, offset=offset, order=order, start=start, length=torch.tensor(length),
                free=free, k_max=k_max, heads=heads, sinks=sinks, window=window, top=top, capacity=capacity)


def taken_and_rest(indices, count, free_kept):
    """Per row: the kept community tokens as a set, and the entries after them."""
    out = []
    for row, n, taken in zip(indices.reshape(-1, indices.shape[-1]).tolist(), count.reshape(-1).tolist(), free_kept):
        out.append((sorted(row[:taken]), row[taken:]))
    return out


@here
@SETTINGS
@given(case=layouts(), chunk=st.sampled_from([16, 64, 512]), width=st.sampled_from([1, 4, 8]))
def test_community_choice_matches_its_reference(case, chunk, width):
    args = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    want_idx, want_count, want_best, want_roomiest = ref.community_choice(**args)
    with override(community_choice=CommunityChoiceConfig(chunk=chunk, width=width)), kernel_buffers_poisoned():
        idx, count, best, roomiest = kernels.community_choice.triton(**args, workspace=WORKSPACE)
    assert torch.equal(count, want_count)
    assert torch.equal(best, want_best)
    assert torch.equal(roomiest, want_roomiest)
    n_forced = torch.clamp(case["length"] - case["start"], max=min(case["sinks"], case["capacity"]) + min(case["window"], case["capacity"]))
    taken = (want_count.cpu() - n_forced[:, None]).reshape(-1).tolist()
    assert taken_and_rest(idx.cpu(), count.cpu(), taken) == taken_and_rest(want_idx.cpu(), want_count.cpu(), taken)
    assert all(int(buf.abs().sum()) == 0 for buf in WORKSPACE.buffers.values())


@here
def test_community_choice_without_a_workspace_and_in_head_mode():
    """Without a workspace the op zeroes its own histograms; head mode (units of several query heads
    per KV head) goes to the reference."""
    gen = torch.Generator().manual_seed(0)
    b, heads, c, length = 1, 2, 5, 20
    order = torch.arange(length, dtype=torch.int32).repeat(b, heads * 2, 2)[..., : length + 1].contiguous()
    size = torch.tensor([4, 4, 4, 4, 4]).repeat(b, heads * 2, 1)
    room = torch.tensor([4, 5, 4, 6, 6]).repeat(b, heads * 2, 1)
    offset = torch.tensor([0, 4, 8, 12, 16]).repeat(b, heads * 2, 1)
    scores = torch.randn(b, heads * 2, c, generator=gen)
    args = dict(start=torch.tensor([0]), length=torch.tensor(length), free=torch.tensor([6]), k_max=12, heads=heads,
                sinks=1, window=2, top=3, capacity=length)
    head_mode = kernels.community_choice(scores.to(DEVICE), size.to(DEVICE), room.to(DEVICE), offset.to(DEVICE),
                                         order.to(DEVICE),
                                         **{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in args.items()})
    want = ref.community_choice(scores, size, room, offset, order, **args)
    assert all(torch.equal(x.cpu(), y) for x, y in zip(head_mode, want))
    assert want[3].flatten().tolist() == [3] * heads * 2  # the most room left, the lower id of a tie
    group = dict(scores=scores[:, :heads], size=size[:, :heads], room=room[:, :heads], offset=offset[:, :heads],
                 order=order[:, :heads].contiguous(), **args)
    dev = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in group.items()}
    idx, count, best, roomiest = kernels.community_choice.triton(**dev)
    want_idx, want_count, want_best, want_roomiest = ref.community_choice(**group)
    assert torch.equal(count.cpu(), want_count) and torch.equal(best.cpu(), want_best)
    assert torch.equal(roomiest.cpu(), want_roomiest)
    assert sorted(idx[0, 0, :6].tolist()) == sorted(want_idx[0, 0, :6].tolist())
    assert torch.equal(idx[..., 6:].cpu(), want_idx[..., 6:])


@here
def test_community_choice_op_schema_and_fake():
    """The custom op's schema, its fake (shapes for compiled steps), and a workspace it leaves zero
    (no mutation to declare)."""
    gen = torch.Generator().manual_seed(1)
    b, heads, c, length = 2, 2, 6, 24
    order = torch.randperm(length, generator=gen).int().repeat(b, heads, 2).contiguous()
    size = torch.tensor([4, 0, 5, 3, 2, 4]).repeat(b, heads, 1)
    room = torch.tensor([4, 0, 5, 3, 2, 6]).repeat(b, heads, 1)
    offset = torch.tensor([0, 4, 4, 9, 12, 14]).repeat(b, heads, 1)
    args = [torch.randn(b, heads, c, generator=gen), size, room, offset, order, torch.tensor([0, 3]), torch.tensor(length),
            torch.tensor([5, 7])]
    args = [a.to(DEVICE) for a in args] + [12, 1, 2, 4]
    checks = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.policyzoo.community_choice.default, tuple(args), test_utils=checks)
    torch.library.opcheck(torch.ops.policyzoo.community_choice.default, (*args, WORKSPACE.select_histograms),
                          test_utils=checks)

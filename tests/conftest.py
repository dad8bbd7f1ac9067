"""Shared strategies and helpers for the contract tests.

The central object is `Case`: a `PagedKVCache` filled exactly as the Decoder fills it (``reset``, one
``write_prefill`` per layer, then per decode step ``length += 1`` followed by one ``write`` per
layer), with random left padding, random keys/values, and a query. Slots that no row may see (left
padding, the unwritten tail, leftovers of a previous, longer sequence when the cache is reused) hold
large garbage values, so any leak of invisible slots into a summary, a score or an attention output
shows up as a large error.

Tests get the strategy through the session fixture ``cases`` and draw from it with ``st.data()``
(so the test files need not import this module)::

    @given(data=st.data())
    def test_something(data, cases):
        case = data.draw(cases(page_sizes=(4,)))
"""

from __future__ import annotations

import os

import torch

# Triton reads TRITON_INTERPRET when it is first imported (transformers and torch._dynamo import it):
# without a GPU, the kernel tests run the Triton kernels in its interpreter, so set it before anything.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite compiles many small graphs with Inductor's CPU backend, whose vectorised C++ doubles their
# compile time (a symbolic SSA step: 56 s cold against 30 s scalar). What the tests check (one graph,
# no recompiles, the eager tokens) does not depend on the loops' vector width, so Inductor is told
# that no vector ISA works and emits scalar loops (it keeps IEEE order within an op either way: no fp
# contraction). The environment variable reaches the tests' own processes (the two-rank tests) too,
# and spares each process the probe builds of the vector ISAs.
os.environ["TORCHINDUCTOR_VEC_ISA_OK"] = "0"
import torch._inductor.config  # noqa: E402

torch._inductor.config.cpp.vec_isa_ok = False

# Under pytest-xdist (`scripts/test` runs a worker per core and one more) each worker takes its share
# of the cores: two workers of two threads each on two cores would fight over them.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import math
from dataclasses import dataclass, field

import pytest
from hypothesis import strategies as st
from torch import Tensor

from policyzoo.cache import SKETCH, SUMMARIES, PagedKVCache
from policyzoo.eval.metrics import dropped_mass
from policyzoo.kernels import reference
from policyzoo.kv.base import KVState
from policyzoo.kv.dense import Dense
from policyzoo.selection import Selection

GARBAGE = 50.0  # offset of the values written into slots no row may see


@dataclass
class Case:
    """A filled cache, a query and the parameters that produced them."""

    params: dict
    cache: PagedKVCache
    q: Tensor  # [B, H, D]
    scale: float
    real_k: Tensor = field(repr=False)  # [B, H_kv, length, D]: what was written, padding included
    real_v: Tensor = field(repr=False)

    def __repr__(self) -> str:  # hypothesis prints this for a failing example
        return f"Case({self.params})"

    def _repr_pretty_(self, printer, cycle) -> None:  # hypothesis' pretty printer
        printer.text(repr(self))

    # shapes
    @property
    def b(self) -> int:
        return self.cache.batch

    @property
    def h_kv(self) -> int:
        return self.cache.num_kv_heads

    @property
    def h(self) -> int:
        return self.q.shape[1]

    @property
    def g(self) -> int:
        return self.h // self.h_kv

    @property
    def d(self) -> int:
        return self.cache.head_dim

    @property
    def page(self) -> int:
        return self.cache.page_size

    @property
    def length(self) -> int:
        return int(self.cache.length)

    @property
    def starts(self) -> list[int]:
        return [int(s) for s in self.cache.start]

    def state(self, layer: int = 0) -> KVState:
        return KVState(self.cache, layer, self.scale)

    # independent recomputations of visibility (plain Python, not the library's helpers)
    def visible_tokens(self, row: int) -> list[int]:
        return list(range(self.starts[row], self.length))

    def n_valid(self, row: int) -> int:
        return len(self.visible_tokens(row))

    def visible_pages(self, row: int) -> list[int]:
        return sorted({t // self.page for t in self.visible_tokens(row)})

    def token_valid(self) -> Tensor:
        """``bool[B, capacity]`` recomputed from the parameters."""
        m = torch.zeros(self.b, self.cache.capacity, dtype=torch.bool)
        for r in range(self.b):
            m[r, self.starts[r] : self.length] = True
        return m

    def forced_tokens(self, row: int, sinks: int, window: int) -> set[int]:
        vis = self.visible_tokens(row)
        return set(vis[:sinks]) | (set(vis[-window:]) if window > 0 else set())

    def forced_pages(self, row: int, sinks: int, window: int) -> set[int]:
        return {t // self.page for t in self.forced_tokens(row, sinks, max(window, 1))}


def selected(sel: Selection, row: int, head: int) -> list[int]:
    """The entries of ``sel`` within ``count`` for one (row, KV head), in order."""
    c = int(sel.count[row, head])
    return [int(i) for i in sel.indices[row, head, :c]]


def check_selection_shape(sel: Selection, case: Case) -> None:
    """Shapes, dtypes and count bounds that every selection must have."""
    assert sel.indices.dtype == torch.int32 and sel.count.dtype == torch.int32
    assert sel.indices.shape[:2] == (case.b, case.h_kv)
    assert sel.count.shape == (case.b, case.h_kv)
    assert bool((sel.count >= 0).all()) and bool((sel.count <= sel.k_max).all())
    if sel.log_weight is not None:
        assert sel.log_weight.shape == sel.indices.shape


def build_case(
    *,
    b: int,
    h_kv: int,
    g: int,
    d: int,
    page: int,
    prompt: int,
    steps: int,
    starts: list[int],
    seed: int,
    extra: int = 0,
    reuse: bool = False,
    sharp: float = 1.0,
    num_layers: int = 1,
    dtype: torch.dtype = torch.float32,
    sketch: bool = False,
    device: torch.device | str = "cpu",
) -> Case:
    """Fill a cache the way the Decoder does and draw a query.

    ``prompt`` tokens are prefilled (rows left-padded to ``starts``), then ``steps`` decode tokens
    are appended. ``extra`` spare slots are added to the capacity (a partial last page is then
    common). ``reuse`` first fills the cache with a longer garbage sequence, as when the Decoder
    reuses a cache across ``generate`` calls. ``sharp`` scales the query (peakier attention).
    ``sketch`` makes the cache keep the 4-bit key sketch beside the page summaries. ``device``: where
    the cache and the query live (the values are drawn on the CPU, so every device gets the same).
    """
    gen = torch.Generator().manual_seed(seed)
    total = prompt + steps
    capacity = total + extra
    summaries = SUMMARIES + ((SKETCH,) if sketch else ())
    cache = PagedKVCache(num_layers, b, h_kv, d, capacity, page_size=page, dtype=dtype, summaries=summaries,
                         device=device)

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    if reuse:
        cache.reset(torch.zeros(b, dtype=torch.long, device=device), cache.capacity)
        for layer in range(num_layers):
            junk = rand(b, h_kv, cache.capacity, d) + GARBAGE
            cache.write_prefill(layer, junk, junk)

    start = torch.tensor(starts, dtype=torch.long, device=device)
    k_all = rand(num_layers, b, h_kv, total, d)
    v_all = rand(num_layers, b, h_kv, total, d)
    # Left padding carries garbage (real models write pad-token keys there).
    pad = torch.arange(total, device=device)[None, :] < start[:, None]  # [B, total]
    pad = pad[None, :, None, :, None]
    k_all = torch.where(pad, k_all + GARBAGE, k_all)
    v_all = torch.where(pad, v_all - GARBAGE, v_all)

    cache.reset(start, prompt)
    for layer in range(num_layers):
        cache.write_prefill(layer, k_all[layer, :, :, :prompt], v_all[layer, :, :, :prompt])
    for t in range(prompt, total):
        cache.length += 1
        for layer in range(num_layers):
            cache.write(layer, k_all[layer, :, :, t : t + 1], v_all[layer, :, :, t : t + 1])

    q = (rand(b, h_kv * g, d) * sharp).to(dtype)
    params = dict(
        b=b, h_kv=h_kv, g=g, d=d, page=page, prompt=prompt, steps=steps, starts=starts,
        seed=seed, extra=extra, reuse=reuse, sharp=sharp, num_layers=num_layers, dtype=str(dtype), sketch=sketch,
    )  # fmt: skip
    return Case(params, cache, q, d**-0.5, real_k=k_all[0], real_v=v_all[0])


@st.composite
def _cases(
    draw,
    page_sizes: tuple[int, ...] = (1, 4, 16),
    max_prompt: int = 48,
    max_steps: int = 6,
    num_layers: int = 1,
    min_len: int = 1,
    min_extra: int = 0,
    dtypes: tuple[torch.dtype, ...] = (torch.float32,),
    sketch: tuple[bool, ...] = (False,),
    device: torch.device | str = "cpu",
) -> Case:
    b = draw(st.integers(1, 3))
    h_kv = draw(st.integers(1, 3))
    g = draw(st.integers(1, 4))
    d = draw(st.integers(8, 32))
    page = draw(st.sampled_from(page_sizes))
    prompt = draw(st.integers(1, max_prompt))
    steps = draw(st.integers(0, max_steps))
    if prompt + steps < min_len:
        prompt = min_len - steps
    # Left padding: at least one real prompt token per row (the Decoder's rows are never empty).
    starts = draw(st.lists(st.integers(0, prompt - 1), min_size=b, max_size=b))
    extra = draw(st.integers(min_extra, min_extra + 2 * page))
    reuse = draw(st.booleans())
    sharp = draw(st.sampled_from([0.5, 1.0, 3.0, 8.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    dtype = draw(st.sampled_from(dtypes))
    return build_case(
        b=b, h_kv=h_kv, g=g, d=d, page=page, prompt=prompt, steps=steps, starts=starts, seed=seed,
        extra=extra, reuse=reuse, sharp=sharp, num_layers=num_layers, dtype=dtype, sketch=draw(st.sampled_from(sketch)),
        device=device,
    )  # fmt: skip


@pytest.fixture(scope="session")
def cases():
    """The `Case` strategy factory: ``data.draw(cases(page_sizes=(4, 16), max_prompt=40))``."""
    return _cases


@pytest.fixture(scope="session")
def make_case():
    """`build_case`, for hand-made examples."""
    return build_case


# ------------------------------------------------------------------------------ policy contract
def dense_attention(case: Case) -> tuple[Tensor, Tensor]:
    """Dense attention through the reference kernel with a `Dense` selection."""
    sel = Dense().select(case.state(), case.q)
    c = case.cache
    return reference.decode_attention(case.q, c.keys[0], c.values[0], sel, c.start, c.length, case.scale)


def attend(case: Case, sel: Selection) -> tuple[Tensor, Tensor]:
    c = case.cache
    return reference.decode_attention(case.q, c.keys[0], c.values[0], sel, c.start, c.length, case.scale)


def _is_pages(sel: Selection, pages: bool | None) -> bool:
    # A page policy on a cache of 1-token pages has block 1: say ``pages=True`` for those.
    return sel.block > 1 if pages is None else pages


def check_entries(sel: Selection, case: Case, sinks: int, window: int, pages: bool | None = None) -> None:
    """In range, visible, unique within ``count``, and holding the forced entries.

    Token selections must hold the first ``sinks`` and last ``window`` visible tokens; page
    selections (``pages``, by default ``block > 1``) the pages holding them, and always the last page.
    """
    check_selection_shape(sel, case)
    c = case.cache
    pages = _is_pages(sel, pages)
    n = c.num_pages if pages else c.capacity
    for r in range(case.b):
        if not pages:
            visible, forced = set(case.visible_tokens(r)), case.forced_tokens(r, sinks, window)
        else:
            assert sel.block == c.page_size
            visible, forced = set(case.visible_pages(r)), case.forced_pages(r, sinks, window)
            assert (case.length - 1) // c.page_size in forced
        for hk in range(case.h_kv):
            got = selected(sel, r, hk)
            assert all(0 <= i < n for i in got), f"out of range: {got} (n={n})"
            assert set(got) <= visible, f"row {r} head {hk}: not visible {sorted(set(got) - visible)}"
            assert len(set(got)) == len(got), f"row {r} head {hk}: duplicates in {got}"
            assert forced <= set(got), f"row {r} head {hk}: forced {sorted(forced - set(got))} missing"


def check_budget_respected(
    sel: Selection, case: Case, budget: int | float, sinks: int, window: int, pages: bool | None = None
) -> None:
    """``count <= max(budget, forced)`` in the selection's units (tokens or pages), and the budget
    is used: ``count >= min(budget, visible)``. Int budgets are tokens (``ceil(budget / page)``
    pages for page selections); ratio budgets are ``ceil(ratio · n_valid)`` of the units."""
    page = sel.block
    for r in range(case.b):
        if not _is_pages(sel, pages):
            n_valid, n_forced = case.n_valid(r), len(case.forced_tokens(r, sinks, window))
        else:
            n_valid, n_forced = len(case.visible_pages(r)), len(case.forced_pages(r, sinks, window))
        if isinstance(budget, float):
            want = math.ceil(budget * n_valid - 1e-9)  # Budget's float-error epsilon
        else:
            want = -(-budget // page)
        for hk in range(case.h_kv):
            cnt = int(sel.count[r, hk])
            assert cnt <= max(want, n_forced), f"row {r}: count {cnt} > max({want}, {n_forced})"
            assert cnt >= min(want, n_valid), f"row {r}: count {cnt} < min({want}, {n_valid})"


def check_error_bound(sel: Selection, case: Case) -> None:
    """``‖o − ô‖ ≤ 2δ·max‖v‖`` per query head (renormalised softmax over the selection)."""
    c = case.cache
    o, _ = dense_attention(case)
    o_hat, _ = attend(case, sel)
    p = reference.dense_probs(case.q, c.keys[0], c.start, c.length, case.scale)
    tv = c.token_valid()
    delta = dropped_mass(p, sel, tv)  # [B, H]
    vnorm = c.values[0].float().norm(dim=-1).masked_fill(~tv[:, None, :], 0.0).amax(-1)  # [B, H_kv]
    vmax = vnorm.repeat_interleave(case.g, dim=1)  # [B, H]
    err = (o.float() - o_hat.float()).norm(dim=-1)
    bound = 2 * delta * vmax + 1e-4 * (1 + vmax)
    assert bool((delta >= 0).all()) and bool((delta <= 1).all())
    assert bool((err <= bound).all()), f"err {err} > bound {bound} (delta {delta})"


def check_reproduces_dense(sel: Selection, case: Case) -> None:
    o, lse = dense_attention(case)
    o_hat, lse_hat = attend(case, sel)
    torch.testing.assert_close(o_hat, o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse_hat, lse, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="session")
def contract():
    """The policy contract checks: ``check_entries``, ``check_budget``, ``check_error_bound``,
    ``check_reproduces_dense``, plus ``dense_attention`` and ``attend``."""

    class _Contract:
        check_entries = staticmethod(check_entries)
        check_budget = staticmethod(check_budget_respected)
        check_error_bound = staticmethod(check_error_bound)
        check_reproduces_dense = staticmethod(check_reproduces_dense)
        dense_attention = staticmethod(dense_attention)
        attend = staticmethod(attend)
        selected = staticmethod(selected)

    return _Contract


@pytest.fixture(scope="session")
def sel_utils():
    """Helpers on selections: ``selected(sel, row, head)`` and ``check_shape(sel, case)``."""

    class _Utils:
        selected = staticmethod(selected)
        check_shape = staticmethod(check_selection_shape)

    return _Utils


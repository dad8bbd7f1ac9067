"""`benchmarks.certificate`: every page-bound kind it compares is a valid upper bound."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.certificate import KINDS, drift_overshoot, overshoot


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 70), h_kv=st.integers(1, 2), g=st.integers(1, 3), d=st.integers(9, 16), seed=st.integers(0, 2**16),
       spread=st.floats(0.1, 10.0))
def test_every_bound_kind_is_at_or_above_the_best_key_of_its_page(n, h_kv, g, d, seed, spread):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(h_kv, n, d, generator=gen, dtype=torch.float64) * spread + torch.randn(h_kv, 1, d, generator=gen, dtype=torch.float64)
    q = torch.randn(h_kv * g, d, generator=gen, dtype=torch.float64)
    for name, (kind, page) in KINDS.items():
        over = overshoot(q, keys, 0.25, kind, page)
        assert over.shape == (h_kv, g, -(-n // page))
        assert bool((over >= -1e-9).all()), f"{name}: a bound below its page's best logit"


def test_a_box_around_one_key_is_exact():
    keys = torch.randn(1, 16, 8, dtype=torch.float64)
    keys[:] = keys[:, :1]  # every key of the page equal
    over = overshoot(torch.randn(2, 8, dtype=torch.float64), keys, 0.5, "box", 16)
    assert torch.allclose(over, torch.zeros_like(over), atol=1e-9)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 70), h_kv=st.integers(1, 2), g=st.integers(1, 3), d=st.integers(2, 16), seed=st.integers(0, 2**16),
       step=st.floats(0.0, 2.0))
def test_the_drift_bound_is_at_or_above_the_best_key_and_exact_without_drift(n, h_kv, g, d, seed, step):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(h_kv, n, d, generator=gen, dtype=torch.float64)
    q0 = torch.randn(h_kv * g, d, generator=gen, dtype=torch.float64)
    q = q0 + step * torch.randn(h_kv * g, d, generator=gen, dtype=torch.float64)
    over = drift_overshoot(q0, q, keys, 0.25)
    assert over.shape == (h_kv, g, -(-n // 16)) and bool((over >= -1e-9).all())
    assert torch.allclose(drift_overshoot(q0, q0, keys, 0.25), torch.zeros_like(over), atol=1e-9)

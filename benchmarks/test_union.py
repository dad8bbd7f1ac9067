"""`benchmarks.union`: the union fraction of kept inputs across a batch."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.union import kept_inputs, union_fractions, write_markdown
from policyzoo.proj import TopK


@settings(max_examples=30, deadline=None)
@given(p=st.floats(0.05, 0.95), seed=st.integers(0, 2**16))
def test_union_grows_with_the_batch_from_the_kept_fraction(p, seed):
    g = torch.Generator().manual_seed(seed)
    kept = torch.rand(16, 8, 512, generator=g) < p  # rows, positions, inputs
    fractions = [union_fractions(kept, b) for b in (1, 4, 16)]
    assert fractions[0] == kept.float().mean().item()
    assert fractions[0] <= fractions[1] <= fractions[2] <= 1.0
    # independent rows: 1 - (1 - p)^B, within sampling error
    assert abs(fractions[1] - (1 - (1 - p) ** 4)) < 0.05


def test_groups_are_measured_as_the_kernel_reads_them(tmp_path):
    from tests.tiny_models import tiny_model

    model = tiny_model("llama")
    ids = torch.randint(1, 128, (4, 12), generator=torch.Generator().manual_seed(0))
    kept = kept_inputs(model, ids, TopK(0.5), slice(4, 12))
    assert {k for k, _ in kept} == {"q|k|v", "o", "gate|up", "down"} and len(kept) == 4 * 2
    assert all(m.shape[:2] == (4, 8) and m.float().mean().item() == 0.5 for m in kept.values())
    rows = [{"proj": "topk:0.5", "group": "q|k|v", "batch": b, "union": 0.5} for b in (1, 4, 16)]
    write_markdown(tmp_path / "u.md", {"rows": 4, "tokens": 12, "positions": 8}, rows)
    assert "| `topk:0.5` | q\\|k\\|v | 0.500 | 0.500 | 0.500 |" in (tmp_path / "u.md").read_text()

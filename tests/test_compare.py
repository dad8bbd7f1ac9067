"""policyzoo.eval.compare and the Audit records: KL and agreement against dense, per step."""

from __future__ import annotations

import pytest
import torch
from tiny_models import padded_batch, tiny_model

from policyzoo import AttentionTopK, Decoder, TopK, Window
from policyzoo.eval import compare


def test_dense_compare_has_zero_kl_and_full_agreement():
    dec = Decoder(tiny_model("llama"))
    ids, mask = padded_batch(2, 20)
    audit = compare(dec, ids, 6, attention_mask=mask)
    assert len(audit.logits_kl) == 5
    assert audit.mean("logits_kl") == pytest.approx(0.0, abs=1e-6)
    assert audit.mean("top1_agree") == 1.0
    assert audit.mean("dropped_mass") == pytest.approx(0.0, abs=1e-6)


def test_sparse_compare_measures_a_positive_kl_that_grows_as_the_budget_shrinks():
    ids, mask = padded_batch(2, 96)
    kls = []
    for kv in (AttentionTopK(48, sinks=2, window=4), Window(sinks=2, window=4)):
        audit = compare(Decoder(tiny_model("llama"), kv=kv), ids, 5, attention_mask=mask)
        kls.append(audit.mean("logits_kl"))
        assert all((kl >= -1e-6).all() for kl in audit.logits_kl)
    assert 0.0 < kls[0] < kls[1]


def test_compare_leaves_the_decoder_usable_and_dense_history_intact():
    model = tiny_model("qwen3")
    ids, mask = padded_batch(1, 24)
    dec = Decoder(model, kv=Window(sinks=1, window=3), proj=TopK(0.5))
    audit = compare(dec, ids, 4, attention_mask=mask)
    assert audit.mean("proj_keep") == pytest.approx(0.5, abs=0.02)
    assert not dec.session.switch.sparse and dec.session.switch.recorder is None
    # The cache now holds the dense trajectory: generating again works and is deterministic.
    a = dec.generate(ids, 4, attention_mask=mask)
    b = dec.generate(ids, 4, attention_mask=mask)
    assert torch.equal(a, b)


@pytest.mark.parametrize("bad", [0, 1, -3, 2.0, True])
def test_compare_needs_at_least_one_decode_step(bad):
    dec = Decoder(tiny_model("llama"))
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 2"):
        compare(dec, torch.tensor([[1, 2, 3]]), bad)

"""Projection sparsifiers: exact TopK ratio, calibrated Threshold, decode-only application."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import padded_batch, tiny_model

from policyzoo import Decoder, Threshold, TopK
from policyzoo.kernels import sparse_linear
from policyzoo.proj.base import SparseLinear, kept_features, topk_mask


@settings(max_examples=50, deadline=None)
@given(d=st.integers(1, 300), keep=st.floats(0.01, 1.0), rows=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_topk_mask_keeps_exactly_the_largest_magnitudes(d, keep, rows, seed):
    x = torch.randn(rows, d, generator=torch.Generator().manual_seed(seed))
    mask = topk_mask(x, keep)
    k = kept_features(keep, d)
    assert (mask.sum(-1) == k).all()
    kept_min = x.abs().masked_fill(~mask, torch.inf).amin(-1)
    dropped_max = x.abs().masked_fill(mask, -torch.inf).amax(-1)
    assert (kept_min >= dropped_max).all()


def test_kept_features_is_the_ceiling_of_keep_times_d():
    assert kept_features(0.3, 10) == 3  # 0.3 * 10 is 3.0000000000000004 in floats
    assert kept_features(0.5, 7) == 4
    assert kept_features(1e-9, 7) == 1


@settings(max_examples=30, deadline=None)
@given(d_in=st.integers(1, 64), d_out=st.integers(1, 32), keep=st.floats(0.05, 1.0), seed=st.integers(0, 2**16))
def test_sparse_linear_equals_dense_linear_over_kept_columns(d_in, d_out, keep, seed):
    g = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(3, d_in, generator=g), torch.randn(d_out, d_in, generator=g), torch.randn(d_out, generator=g)
    mask = topk_mask(x, keep)
    expected = torch.stack([w[:, m] @ xi[m] + b for xi, m in zip(x, mask)])
    torch.testing.assert_close(sparse_linear(x, w, b, mask), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5])
def test_keep_ratio_outside_unit_interval_is_rejected(bad):
    with pytest.raises(ValueError, match="keep must be a keep ratio in \\(0, 1\\]"):
        TopK(bad)
    with pytest.raises(ValueError, match="keep must be a keep ratio"):
        Threshold(bad)


def test_bad_targets_and_types_are_rejected():
    with pytest.raises(ValueError, match="targets must be a non-empty subset"):
        TopK(0.5, targets=("q", "mlp"))
    with pytest.raises(TypeError, match="keep must be a float"):
        TopK("half")


def test_prefill_is_dense_and_only_targets_are_wrapped():
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    ids, mask = padded_batch(2, 16)
    dec = Decoder(model, proj=TopK(0.25, targets=("gate", "up", "down")))
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, SparseLinear) and not isinstance(layer.self_attn.q_proj, SparseLinear)
    seq, logits = dec.generate(ids, 3, attention_mask=mask, output_logits=True)
    dense_seq, dense_logits = Decoder(ref).generate(ids, 3, attention_mask=mask, output_logits=True)
    torch.testing.assert_close(logits[:, 0], dense_logits[:, 0])  # first token comes from the dense prefill
    assert not torch.allclose(logits[:, 1:], dense_logits[:, 1:])  # decode steps are sparsified


def test_keep_one_is_dense():
    model = tiny_model("qwen2")
    ids, mask = padded_batch(2, 12)
    dense = Decoder(copy.deepcopy(model)).generate(ids, 5, attention_mask=mask, output_logits=True)[1]
    full = Decoder(model, proj=TopK(1.0)).generate(ids, 5, attention_mask=mask, output_logits=True)[1]
    torch.testing.assert_close(full, dense)


def test_threshold_calibration_hits_the_keep_ratio_and_round_trips(tmp_path):
    model = tiny_model("llama")
    texts = [torch.randint(1, 128, (200,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    thr = Threshold(0.4).calibrate(model, texts)
    assert set(thr.thresholds) == {f"{i}.{t}" for i in range(2) for t in ("q", "k", "v", "o", "gate", "up", "down")}
    path = tmp_path / "thresholds.safetensors"
    thr.save(path)
    loaded = Threshold.load(path)
    assert loaded.keep == 0.4 and loaded.thresholds == pytest.approx(thr.thresholds)
    ids, mask = padded_batch(2, 32, seed=7)
    dec = Decoder(model, proj=loaded)
    dec.generate(ids, 8, attention_mask=mask, audit=True)
    # Calibrated on the same distribution, about 40% of inputs survive (per token it varies).
    assert dec.last_audit.mean("proj_keep") == pytest.approx(0.4, abs=0.1)


def test_threshold_without_calibration_is_a_clear_error(tmp_path):
    dec = Decoder(tiny_model("llama"), proj=Threshold(0.5))
    with pytest.raises(ValueError, match="no threshold for projection '0.q'"):
        dec.generate(torch.ones(1, 4, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="nothing to save"):
        Threshold(0.5).save(tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="texts are strings"):
        Threshold(0.5).calibrate(tiny_model("llama"), ["some text"])


@pytest.mark.parametrize("make", [lambda: TopK(0.3), lambda: Threshold(0.5, thresholds={"0.q": 0.7})], ids=["topk", "threshold"])
def test_kernel_path_project_equals_the_masked_reference(make):
    # `project` is what SparseLinear calls where the sparse GEMV kernel runs (input-major weights);
    # on CPU it dispatches to the reference, so this pins its semantics to keep_mask's.
    sparsifier = make()
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(4, 40, generator=g), torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
    expected = sparse_linear(x, w, b, sparsifier.keep_mask("0.q", x))
    torch.testing.assert_close(sparsifier.project("0.q", x, w.t().contiguous(), b), expected, atol=1e-5, rtol=1e-5)

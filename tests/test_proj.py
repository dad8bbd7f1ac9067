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
from policyzoo.proj.base import DenseDecodeLinear, SparseLinear, kept_features, topk_mask


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


def _decode_logits(model, ids, mask, proj, steps=4):
    dec = Decoder(model, proj=proj)
    _, logits = dec.generate(ids, steps, attention_mask=mask, output_logits=True)
    return dec, logits


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v carry biases
def test_shared_input_groups_decode_like_separate_projections(monkeypatch, family):
    # On the kernel path TopK groups q/k/v and gate/up: one selection and one GEMV per group must
    # give the logits of per-projection masked linears (the reference path).
    model = tiny_model(family)
    ids, mask = padded_batch(3, 12)
    _, expected = _decode_logits(copy.deepcopy(model), ids, mask, TopK(0.4))
    monkeypatch.setenv("POLICYZOO_TRITON", "1")
    dec, got = _decode_logits(model, ids, mask, TopK(0.4))
    attn, mlp = dec.model.model.layers[0].self_attn, dec.model.model.layers[0].mlp
    assert attn.q_proj.group is attn.k_proj.group is attn.v_proj.group is not None
    assert mlp.gate_proj.group is mlp.up_proj.group is not None and mlp.down_proj.group is None
    assert attn.q_proj.w_t.data_ptr() == attn.q_proj.group.w_t.data_ptr()  # views, not copies
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)


def test_shared_input_leaves_nothing_pending_and_recomputes_for_another_input(monkeypatch):
    monkeypatch.setenv("POLICYZOO_TRITON", "1")
    from policyzoo.proj.base import ProjectionSwitch

    model = tiny_model("llama")
    TopK(0.5).install(model, ProjectionSwitch(sparse=True))  # the wrappers alone, in a decode step
    attn = model.model.layers[0].self_attn
    group = attn.q_proj.group
    x, other = torch.randn(2, 1, model.config.hidden_size), torch.randn(2, 1, model.config.hidden_size)
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    assert group._input is None and group._outputs == ()  # every member took its output
    k_other = attn.k_proj(other)  # not the input q saw: computed afresh, not reused
    ref = TopK(0.5).project("0.k", other[:, 0], attn.k_proj.w_t.contiguous(), attn.k_proj.linear.bias)
    torch.testing.assert_close(k_other[:, 0], ref, atol=1e-5, rtol=1e-5)
    for y, name in ((q, "q"), (k, "k"), (v, "v")):
        lin = getattr(attn, f"{name}_proj")
        ref = TopK(0.5).project(f"0.{name}", x[:, 0], lin.w_t.contiguous(), lin.linear.bias)
        torch.testing.assert_close(y[:, 0], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make", [lambda: TopK(0.5), lambda: None], ids=["topk", "dense"])
def test_shared_input_groups_compile_into_one_graph(monkeypatch, make):
    # The group's hand-over between members is plain Python state: dynamo must trace it without a
    # graph break and leave it as it found it (no recompile from one step to the next). That is
    # Dynamo's work, so the graph goes through aot_eager (Inductor's sparse projections: the tests below).
    from torch._dynamo.utils import counters

    model = tiny_model("llama")
    ids, mask = padded_batch(2, 10)
    expected = Decoder(copy.deepcopy(model), proj=make()).generate(ids, 6, attention_mask=mask)  # the references
    monkeypatch.setenv("POLICYZOO_TRITON", "1")
    torch._dynamo.reset()
    counters.clear()
    dec = Decoder(model, proj=make()).compile(backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = dec.generate(ids, 6, attention_mask=mask)
    assert torch.equal(out, expected)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1


def test_dense_gemv_projections_compile_into_one_graph(monkeypatch):
    # The routed dense projections (`DenseGemvConfig.decode_rows`) are custom ops to dynamo: one
    # graph, no break, the eager tokens.
    from torch._dynamo.utils import counters

    from policyzoo.kernels import DenseGemvConfig
    from policyzoo.kernels.config import override

    monkeypatch.setenv("POLICYZOO_TRITON", "1")
    model = tiny_model("llama")
    ids, mask = padded_batch(2, 10)
    with override(dense_gemv=DenseGemvConfig(decode_rows=2)):
        expected = Decoder(copy.deepcopy(model)).generate(ids, 5, attention_mask=mask)
        torch._dynamo.reset()
        counters.clear()
        dec = Decoder(model, compile=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = dec.generate(ids, 5, attention_mask=mask)
    assert isinstance(model.model.layers[0].mlp.down_proj, DenseDecodeLinear)
    assert torch.equal(out, expected)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1


def test_threshold_compiles_into_one_graph_with_thresholds_made_at_install():
    """The thresholds are device tensors made when the Decoder installs the sparsifier: a compiled
    step that made them (as it did) loses them to the next CUDA-graph replay. Calibrating again
    later updates them in place, so the compiled step sees the new values without recompiling."""
    from torch._dynamo.utils import counters

    model = tiny_model("llama")
    ids, mask = padded_batch(2, 10)
    thresholds = {f"{i}.{t}": 0.3 + 0.1 * j for i in range(2) for j, t in enumerate(("q", "k", "v", "o", "gate", "up", "down"))}
    expected = Decoder(copy.deepcopy(model), proj=Threshold(0.5, thresholds=dict(thresholds))).generate(ids, 6, attention_mask=mask)
    proj = Threshold(0.5, thresholds=dict(thresholds))
    torch._dynamo.reset()
    counters.clear()
    dec = Decoder(model, proj=proj, compile=True)
    installed = proj.threshold("1.down", torch.device("cpu"))
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(dec.generate(ids, 6, attention_mask=mask), expected)
        texts = [torch.randint(1, 128, (40,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
        proj.calibrate(model, texts)  # new values, the same tensors
        assert proj.threshold("1.down", torch.device("cpu")) is installed
        assert float(installed) == pytest.approx(proj.thresholds["1.down"])
        recalibrated = dec.generate(ids, 6, attention_mask=mask)
    fresh = Decoder(copy.deepcopy(model), proj=Threshold(0.5, thresholds=dict(proj.thresholds))).generate(ids, 6, attention_mask=mask)
    assert torch.equal(recalibrated, fresh)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_dense_decoding_fuses_shared_inputs_on_the_kernel_path(monkeypatch, family):
    # Without a sparsifier, q/k/v and gate/up still run as one GEMM each on the kernel path, in
    # prefill and decode; the logits are the plain model's.
    model = tiny_model(family)
    ids, mask = padded_batch(3, 12)
    _, expected = _decode_logits(copy.deepcopy(model), ids, mask, None)
    monkeypatch.setenv("POLICYZOO_TRITON", "1")
    dec, got = _decode_logits(model, ids, mask, None)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert attn.q_proj.group is attn.v_proj.group is not None and attn.q_proj.sparsifier is None
    assert mlp.gate_proj.group is mlp.up_proj.group is not None and not isinstance(mlp.down_proj, SparseLinear)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("proj", [None, "threshold"])
def test_dense_decode_rows_go_through_the_dense_gemv_kernel_where_the_config_says(monkeypatch, proj):
    # `DenseGemvConfig.decode_rows`, in force when the Decoder is built: every dense projection of
    # that many rows or fewer (decode) runs the dense GEMV kernel, larger ones (prefill) cuBLAS; the
    # logits are the plain path's. o and down are wrapped only for it (they share no input).
    from policyzoo import kernels
    from policyzoo.kernels import DenseGemvConfig
    from policyzoo.kernels.config import override

    thresholds = {f"{i}.down": 0.3 for i in range(2)}
    make = (lambda: None) if proj is None else (lambda: Threshold(0.5, thresholds=dict(thresholds), targets=("down",)))
    model = tiny_model("llama")
    ids, mask = padded_batch(3, 12)
    monkeypatch.setenv("POLICYZOO_TRITON", "1")
    _, expected = _decode_logits(copy.deepcopy(model), ids, mask, make())
    rows = []
    for name in ("dense_gemv", "dense_gemv_t"):  # o and down in their own layout; the groups input-major
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda x, *a, real=real, **k: rows.append(x.numel() // x.shape[-1]) or real(x, *a, **k))
    with override(dense_gemv=DenseGemvConfig(decode_rows=4)):
        dec, got = _decode_logits(model, ids, mask, make())
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert isinstance(attn.o_proj, DenseDecodeLinear) and attn.o_proj.rows == 4
    assert attn.o_proj.linear.weight.is_contiguous()  # not moved to the input-major layout
    assert attn.q_proj.group.dense_rows == 4
    assert isinstance(mlp.down_proj, SparseLinear if proj else DenseDecodeLinear)
    assert isinstance(model.lm_head, DenseDecodeLinear)
    head = model.get_output_embeddings()  # reads as the linear it wraps
    assert head.weight is head.linear.weight and head.out_features == head.linear.out_features
    head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)  # tying writes through
    head.out_features = head.out_features
    assert head.weight is head.linear.weight and "weight" not in head._parameters
    per_step = 2 * (4 if proj is None else 3) + 1  # layers x (q|k|v, o, gate|up, down unless sparse), the LM head
    # The 3 decode steps' rows, and of the prompt only the LM head's (its last position: 3 rows).
    assert set(rows) == {3} and len(rows) == 3 * per_step + 1
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)
    dec.detach()  # the model's own linears come back
    assert type(attn.o_proj) is torch.nn.Linear and type(mlp.down_proj) is torch.nn.Linear
    assert type(model.lm_head) is torch.nn.Linear


def test_gated_dense_setting_uses_the_fused_gemm_and_threshold_keeps_its_own_selection(monkeypatch):
    monkeypatch.setenv("POLICYZOO_TRITON", "1")
    model = tiny_model("llama")
    ids, mask = padded_batch(2, 10)
    thresholds = {f"{i}.{t}": 0.3 + 0.1 * j for i in range(2) for j, t in enumerate(("q", "k", "v", "o", "gate", "up", "down"))}
    expected = Decoder(copy.deepcopy(model), proj=Threshold(0.5, thresholds=dict(thresholds)))
    monkeypatch.delenv("POLICYZOO_TRITON")
    ref_tokens = expected.generate(ids, 5, attention_mask=mask)  # reference path: per-projection masks
    monkeypatch.setenv("POLICYZOO_TRITON", "1")
    dec = Decoder(model, proj=Threshold(0.5, thresholds=dict(thresholds)))
    assert model.model.layers[0].self_attn.q_proj.group is not None  # grouped for its dense GEMM
    assert torch.equal(dec.generate(ids, 5, attention_mask=mask), ref_tokens)
    dense = Decoder(copy.deepcopy(model)).use("dense")
    assert torch.equal(dec.use("dense").generate(ids, 5, attention_mask=mask), dense.generate(ids, 5, attention_mask=mask))


def test_threshold_runs_each_shared_input_group_in_one_pass(monkeypatch):
    """On the kernel path q|k|v and gate|up each take one threshold GEMV, with per-column
    thresholds (each member its own), and decode like per-projection masks (the reference path)."""
    from policyzoo import kernels

    model = tiny_model("qwen2")  # q/k/v carry biases
    ids, mask = padded_batch(2, 10)
    thresholds = {f"{i}.{t}": 0.2 + 0.1 * j for i in range(2) for j, t in enumerate(("q", "k", "v", "o", "gate", "up", "down"))}
    expected = Decoder(copy.deepcopy(model), proj=Threshold(0.5, thresholds=dict(thresholds)))
    _, ref_logits = expected.generate(ids, 5, attention_mask=mask, output_logits=True)
    monkeypatch.setenv("POLICYZOO_TRITON", "1")
    calls = []
    real = kernels.sparse_gemv_threshold
    monkeypatch.setattr(kernels, "sparse_gemv_threshold", lambda x, t, *a, **k: calls.append(t.shape) or real(x, t, *a, **k))
    dec = Decoder(model, proj=Threshold(0.5, thresholds=dict(thresholds)))
    _, logits = dec.generate(ids, 5, attention_mask=mask, output_logits=True)
    torch.testing.assert_close(logits, ref_logits, atol=2e-4, rtol=2e-4)
    cfg = model.config
    qkv = cfg.hidden_size + 2 * cfg.num_key_value_heads * cfg.head_dim
    per_step = calls[: len(calls) // 4]  # one of the four decode steps
    assert sorted(per_step) == sorted([torch.Size([1, qkv]), torch.Size([]), torch.Size([1, 2 * cfg.intermediate_size]),
                                       torch.Size([])] * cfg.num_hidden_layers)


def test_threshold_groups_fall_back_to_one_gemv_per_member_when_columns_do_not_align(monkeypatch):
    """A group whose member sizes share no multiple of 16 (here 3-wide heads) cannot read one
    threshold per block of outputs: each member runs its own GEMV instead."""
    sizes = (24, 12, 12)
    assert Threshold(0.5).project_group(["0.q", "0.k", "0.v"], sizes, torch.randn(1, 8), torch.randn(8, 48), None) is None


@pytest.mark.parametrize("rows", [1, 3])
def test_fast_topk_keeps_about_keep_of_every_token_and_round_trips(tmp_path, rows):
    model = tiny_model("llama")
    texts = [torch.randint(1, 128, (200,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    fast = TopK(0.4, mode="fast").calibrate(model, texts)
    assert set(fast.ratios) == {f"{i}.{t}" for i in range(2) for t in ("q", "k", "v", "o", "gate", "up", "down")}
    assert fast.ratios["0.q"] == fast.ratios["0.k"]  # one input, one ratio
    path = fast.save(tmp_path / "fast.safetensors")
    loaded = TopK.load(path)
    assert loaded.mode == "fast" and loaded.keep == 0.4 and loaded.ratios == pytest.approx(fast.ratios)
    ids, mask = padded_batch(rows, 32, seed=7)
    dec = Decoder(model, proj=loaded)
    dec.generate(ids, 8, attention_mask=mask, audit=True)
    keeps = torch.cat([torch.cat(v) for v in dec.last_audit.proj_keep.values()])  # per projection call
    assert dec.last_audit.mean("proj_keep") == pytest.approx(0.4, abs=0.06)
    assert keeps.std() < 0.12  # close to keep on each call, not only on average
    with pytest.raises(ValueError, match="not a policyzoo fast-TopK file"):
        TopK.load(Threshold(0.4).calibrate(model, texts[:1]).save(tmp_path / "thr.safetensors"))
    with pytest.raises(ValueError, match="not a policyzoo Threshold file"):
        Threshold.load(path)


def test_fast_topk_errors_are_clear():
    with pytest.raises(ValueError, match="mode must be one of"):
        TopK(0.5, mode="quick")
    with pytest.raises(ValueError, match="mode='fast'"):
        TopK(0.5, ratios={"0.q": 1.0})
    with pytest.raises(ValueError, match="only TopK\\(mode='fast'\\) calibrates"):
        TopK(0.5).calibrate(tiny_model("llama"), [torch.ones(4, dtype=torch.long)])
    with pytest.raises(ValueError, match="no fast-TopK ratio for projection '0.q'"):
        Decoder(tiny_model("llama"), proj=TopK(0.5, mode="fast")).generate(torch.ones(1, 4, dtype=torch.long), 3)


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_topk_kernel_path_decodes_like_the_reference_at_batch_above_one(monkeypatch, mode):
    """At batch > 1 the kernels read each weight row once for the union of the rows' kept sets:
    the logits stay those of per-row masks."""
    model = tiny_model("llama")
    ids, mask = padded_batch(3, 12)
    ratios = {f"{i}.{t}": 0.6 for i in range(2) for t in ("q", "k", "v", "o", "gate", "up", "down")}
    make = (lambda: TopK(0.4)) if mode == "exact" else (lambda: TopK(0.4, mode="fast", ratios=dict(ratios)))
    _, expected = _decode_logits(copy.deepcopy(model), ids, mask, make())
    monkeypatch.setenv("POLICYZOO_TRITON", "1")
    _, got = _decode_logits(model, ids, mask, make())
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)


def test_fast_topk_compiles_into_one_graph_and_recalibrates_in_place():
    from torch._dynamo.utils import counters

    model = tiny_model("llama")
    ids, mask = padded_batch(2, 10)
    ratios = {f"{i}.{t}": 0.5 + 0.05 * j for i in range(2) for j, t in enumerate(("q", "k", "v", "o", "gate", "up", "down"))}
    expected = Decoder(copy.deepcopy(model), proj=TopK(0.5, mode="fast", ratios=dict(ratios))).generate(ids, 6, attention_mask=mask)
    proj = TopK(0.5, mode="fast", ratios=dict(ratios))
    torch._dynamo.reset()
    counters.clear()
    dec = Decoder(model, proj=proj, compile=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(dec.generate(ids, 6, attention_mask=mask), expected)
        texts = [torch.randint(1, 128, (40,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
        proj.calibrate(model, texts)  # new values, the same tensors: no recompile
        recalibrated = dec.generate(ids, 6, attention_mask=mask)
    fresh = Decoder(copy.deepcopy(model), proj=TopK(0.5, mode="fast", ratios=dict(proj.ratios))).generate(ids, 6, attention_mask=mask)
    assert torch.equal(recalibrated, fresh)
    assert counters["stats"]["unique_graphs"] == 1

"""Decoder contract: dense decoding reproduces the unwrapped model; full budgets reproduce dense;
the compiled step does not recompile; bad input is rejected with a clear error."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from tiny_models import FAMILIES, MORE_FAMILIES, RecordingStreamer, padded_batch, tiny_model

from policyzoo import AttentionTopK, Decoder, EntmaxKV, Quest, TopK, Window

NEW = 12


def hf_reference(model, ids, mask):
    """Greedy tokens of HF's own generate, and HF's full-forward logits at each new position."""
    seq = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    full_mask = torch.cat([mask, torch.ones(ids.shape[0], NEW, dtype=mask.dtype)], dim=1)
    positions = (full_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(seq, attention_mask=full_mask, position_ids=positions).logits
    t = ids.shape[1]
    return seq, logits[:, t - 1 : t - 1 + NEW]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch", [1, 3])
def test_dense_matches_unwrapped_model(family, batch):
    model = tiny_model(family)
    ids, mask = padded_batch(batch, 21)
    ref_seq, ref_logits = hf_reference(copy.deepcopy(model), ids, mask)
    seq, logits = Decoder(model).generate(ids, NEW, attention_mask=mask, output_logits=True)
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(logits, ref_logits, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_more_families_decode_as_the_model(family):
    """Gemma, Granite and OLMo-2 decode through the same attention hook: dense and a full budget
    give HF's own greedy tokens and logits, and a sparse setting of both branches runs and differs."""
    model = tiny_model(family)
    ids, mask = padded_batch(2, 21)
    ref_seq, ref_logits = hf_reference(copy.deepcopy(model), ids, mask)
    for kv in (None, Quest(1.0, page=4)):
        seq, logits = Decoder(copy.deepcopy(model), kv=kv).generate(ids, NEW, attention_mask=mask, output_logits=True)
        assert torch.equal(seq, ref_seq)
        torch.testing.assert_close(logits, ref_logits, atol=2e-4, rtol=1e-4)
    _, sparse = Decoder(model, kv=Quest(4, page=4, sinks=1, window=1), proj=TopK(0.3)).generate(
        ids, NEW, attention_mask=mask, output_logits=True)
    assert torch.isfinite(sparse).all() and not torch.allclose(sparse, ref_logits, atol=1e-3)


@pytest.mark.parametrize(
    "policy",
    [AttentionTopK(1.0), AttentionTopK(10_000, sinks=4, window=64), Quest(1.0, page=8), Quest(4096, page=16), Window(sinks=4, window=10_000)],
    ids=repr,
)
def test_full_budget_reproduces_dense(policy):
    model = tiny_model("qwen3")
    ids, mask = padded_batch(3, 29)
    dense_seq, dense_logits = Decoder(copy.deepcopy(model)).generate(ids, NEW, attention_mask=mask, output_logits=True)
    seq, logits = Decoder(model, kv=policy).generate(ids, NEW, attention_mask=mask, output_logits=True)
    assert torch.equal(seq, dense_seq)
    torch.testing.assert_close(logits, dense_logits, atol=1e-5, rtol=1e-5)


def test_sparse_policy_changes_output_and_audit_reports_it():
    model = tiny_model("llama")
    ids, mask = padded_batch(2, 64)
    dec = Decoder(model, kv=AttentionTopK(8, sinks=2, window=2), proj=TopK(0.5))
    dec.generate(ids, 6, attention_mask=mask, audit=True)
    audit = dec.last_audit
    assert 0.0 < audit.mean("dropped_mass") < 1.0
    assert audit.mean("output_error") > 0.0
    assert audit.mean("proj_keep") == pytest.approx(0.5, abs=0.02)
    assert audit.per_layer("dropped_mass").shape == (2, 5, 2, 2)  # layers, steps, batch, KV heads
    assert float(audit.per_layer("kv_keep").max()) <= 8 / 61 + 1e-6  # row 1 has 61 real prompt tokens


def test_rewrapping_the_same_model_drops_the_old_wrappers():
    from policyzoo.proj.base import SparseLinear

    model = tiny_model("llama")
    ids, mask = padded_batch(1, 16)
    Decoder(model, proj=TopK(0.25)).generate(ids, 5, attention_mask=mask)
    again = Decoder(model).generate(ids, 5, attention_mask=mask)
    assert not any(isinstance(m, SparseLinear) for m in model.modules())
    assert torch.equal(again, Decoder(copy.deepcopy(model)).generate(ids, 5, attention_mask=mask))


def test_caches_are_freed_when_replaced_not_when_collected():
    """A new Decoder on the same model frees the previous Decoder's cache, and a cache that must grow
    is freed before its successor is allocated: neither waits for the cycle collector (two 128K
    caches of an 8B model do not fit one GPU next to its weights)."""
    import gc
    import weakref

    model = tiny_model("llama")
    ids, mask = padded_batch(1, 16)
    first = Decoder(model, kv=Quest(0.5, page=4))
    first.generate(ids, 3, attention_mask=mask)
    small = weakref.ref(first.session.cache.keys[0])
    gc.disable()
    try:
        first.generate(ids, 40, attention_mask=mask)  # needs a larger cache
        assert small() is None
        grown = weakref.ref(first.session.cache.keys[0])
        Decoder(model).generate(ids, 3, attention_mask=mask)
        assert grown() is None and first.session.cache is None
    finally:
        gc.enable()


def test_wrapped_model_stays_a_plain_hf_model_outside_generate():
    model = tiny_model("qwen3")
    ref = copy.deepcopy(model)
    ids, mask = padded_batch(2, 14)
    dec = Decoder(model, kv=Quest(0.5, page=4), proj=TopK(0.5))
    dec.generate(ids, 3, attention_mask=mask)
    assert model.config._attn_implementation == ref.config._attn_implementation
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), ref.generate(ids, **kwargs))


def test_sampling_is_reproducible_with_a_generator_and_respects_top_p():
    model = tiny_model("mistral")
    ids, mask = padded_batch(2, 10)
    dec = Decoder(model)
    a = dec.generate(ids, 8, do_sample=True, temperature=0.8, top_p=0.9, generator=torch.Generator().manual_seed(1))
    b = dec.generate(ids, 8, do_sample=True, temperature=0.8, top_p=0.9, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    greedy = dec.generate(ids, 8)
    tiny_p = dec.generate(ids, 8, do_sample=True, top_p=1e-6, generator=torch.Generator().manual_seed(2))
    assert torch.equal(greedy, tiny_p)  # a vanishing nucleus keeps only the top token


def test_eos_stops_and_pads_finished_rows():
    model = tiny_model("llama")
    ids, mask = padded_batch(2, 12)
    dec = Decoder(model)
    free = dec.generate(ids, 6, attention_mask=mask)
    eos = int(free[0, 12 + 1])  # row 0's second new token
    out = dec.generate(ids, 6, attention_mask=mask, eos_token_id=eos, pad_token_id=0)
    row0 = out[0, 12:].tolist()
    assert eos in row0 and all(t == 0 for t in row0[row0.index(eos) + 1 :])


def test_streamer_receives_prompt_then_each_token():
    model = tiny_model("qwen2")
    ids, _ = padded_batch(1, 9)
    rec = RecordingStreamer()
    out = Decoder(model).generate(ids, 4, streamer=rec)
    assert rec.ended and torch.equal(rec.chunks[0], ids)
    assert torch.cat([c.reshape(-1) for c in rec.chunks[1:]]).tolist() == out[0, 9:].tolist()


def reference_loop(dec, ids, mask, new, eos, pad):
    """What `generate` must return: a plain synchronous loop over the session that checks the end
    after every token (the device-side stop and the delayed host reads must not change it)."""
    session = dec.session
    token = session.choose(session.prefill(ids, mask, capacity=ids.shape[1] + new)[:, -1].clone())
    finished = torch.isin(token, torch.tensor(eos))
    out = [token.clone()]
    while len(out) < new and not bool(finished.all()):
        session.step(out[-1])
        token = torch.where(finished, torch.tensor(pad), session.last_token.clone())
        finished |= torch.isin(token, torch.tensor(eos))
        out.append(token)
    return torch.cat([ids, torch.stack(out, 1)], 1)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_generate_stops_where_a_step_by_step_loop_stops_and_streams_nothing_after(family):
    """Rows end at different steps; generate stops once all have ended, pads the early ones, and
    its streamer gets exactly the returned tokens."""
    model = tiny_model(family)
    ids, mask = padded_batch(3, 15)
    dec = Decoder(model, kv=Quest(0.5, page=4))
    free = dec.generate(ids, 12, attention_mask=mask)
    # row 0 ends by its third token, row 1 by its fourth, row 2 by its sixth: all before the 12th
    eos = [int(free[0, 15 + 2]), int(free[1, 15 + 3]), int(free[2, 15 + 5])]
    rec = RecordingStreamer()
    out, logits = dec.generate(ids, 12, attention_mask=mask, eos_token_id=eos, pad_token_id=0, streamer=rec, output_logits=True)
    want = reference_loop(dec, ids, mask, 12, eos, 0)
    assert torch.equal(out, want) and out.shape[1] <= 15 + 6
    assert logits.shape[:2] == (3, out.shape[1] - 15)
    streamed = torch.stack([c.reshape(-1) for c in rec.chunks[1:]], 1)
    assert torch.equal(streamed, out[:, 15:])
    for row in out[:, 15:].tolist():
        ended = [i for i, t in enumerate(row) if t in eos]
        if ended:
            assert all(t == 0 for t in row[ended[0] + 1 :])  # nothing after a row's EOS but the pad id


@pytest.mark.parametrize("bound", ["box", "sketch"])
def test_decode_step_compiles_once_and_does_not_recompile(bound):
    """The same tokens as eager, one graph; with the key sketch the step also recodes a page per write."""
    torch._dynamo.reset()
    model = tiny_model("qwen3", layers=1)
    ids, mask = padded_batch(2, 17)
    eager = Decoder(copy.deepcopy(model), kv=Quest(0.5, page=4, bound=bound)).generate(ids, 22, attention_mask=mask)
    dec = Decoder(model, kv=Quest(0.5, page=4, bound=bound), compile=True)
    from torch._dynamo.utils import counters

    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = dec.generate(ids, 22, attention_mask=mask)  # 21 compiled steps
    assert torch.equal(out, eager)
    assert counters["stats"]["unique_graphs"] >= 1
    assert sum(counters["recompiles"].values()) == 0


def test_a_two_stage_policy_is_refused_a_dynamic_capacity_on_cuda():
    """Inductor's CUDA code for the second stage fails under a symbolic capacity (torch 2.11): a
    clear error at compile, not an internal one at the first step. The check runs before anything
    touches the device, so a CPU Decoder posing as a CUDA one shows it."""
    dec = Decoder(tiny_model("llama", layers=1), kv=Quest(0.25, page=4, rescore=2))
    dec.device = torch.device("cuda")
    with pytest.raises(ValueError, match="two-stage policy"):
        dec.compile(dynamic_capacity=True)
    dec.compile(dynamic_capacity=True, backend="eager")  # the failing code generation is Inductor's


def test_dynamic_capacity_reuses_the_compiled_step_for_larger_caches():
    """Three cache capacities, one compiled graph, the same tokens as eager (without
    ``dynamic_capacity`` each capacity compiles its own graph: two are enough to show it, and Dynamo
    decides that, so that half compiles through aot_eager)."""
    from torch._dynamo.utils import counters

    model = tiny_model("qwen3", layers=1)
    eager = Decoder(copy.deepcopy(model), kv=Quest(0.25, page=4))
    for dynamic, expected in ((True, [1, 1, 1]), (False, [1, 2])):
        torch._dynamo.reset()
        counters.clear()
        dec = Decoder(model, kv=Quest(0.25, page=4)).compile(dynamic_capacity=dynamic, backend="inductor" if dynamic else "aot_eager")
        graphs = []
        # Each prompt needs a larger cache; all are large enough that Quest's budget is past its
        # floor of sinks + window pages (a smaller cache is specialised on: one more graph).
        for n in (150, 250, 400)[: len(expected)]:
            ids, mask = padded_batch(1, n)
            out = dec.generate(ids, 4, attention_mask=mask)
            assert torch.equal(out, eager.generate(ids, 4, attention_mask=mask))
            graphs.append(counters["stats"]["unique_graphs"])
        assert graphs == expected


def test_dynamic_capacity_keeps_ssa_equal_to_eager_on_small_caches():
    """`SSA`'s sampled stratum on a cache of 6 pages: Inductor's full+scatter rewrite lost a sampled
    page on caches of up to 8 pages with symbolic sizes, so the dynamic build turns that rewrite off.
    (One capacity: each symbolic compile of SSA takes most of a minute on a CPU.)"""
    from policyzoo import SSA

    model = tiny_model("llama", layers=1)
    eager = Decoder(copy.deepcopy(model), kv=SSA(0.1, 0.1, page=4, window=4))
    torch._dynamo.reset()
    dec = Decoder(model, kv=SSA(0.1, 0.1, page=4, window=4)).compile(dynamic_capacity=True)
    ids, mask = padded_batch(2, 17)  # a cache of 24 slots
    assert torch.equal(dec.generate(ids, 6, attention_mask=mask), eager.generate(ids, 6, attention_mask=mask))


# ------------------------------------------------------------------------------------ errors
def test_unsupported_architecture_is_rejected():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="model: unsupported architecture 'gpt2'"):
        Decoder(model)


def test_wrong_argument_types_are_rejected():
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="kv must be a KVSelector"):
        Decoder(model, kv=TopK(0.5))
    with pytest.raises(TypeError, match="proj must be a ProjectionSparsifier"):
        Decoder(model, proj=Quest(0.5))
    with pytest.raises(TypeError, match="model must be"):
        Decoder("llama")


def test_offloaded_weights_refuse_proj_at_construction_and_decode_kv_only_like_the_model(tmp_path):
    """accelerate's offloading keeps a layer's weights on the meta device until its own forward:
    a projection sparsifier, which reads the weights itself, would compute on placeholders."""
    from accelerate import dispatch_model

    ids, mask = padded_batch(2, 24)
    want = Decoder(tiny_model("llama")).generate(ids, 6, attention_mask=mask)
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "disk", "model.norm": "cpu", "lm_head": "cpu"}  # fmt: skip
    model = dispatch_model(tiny_model("llama"), device_map=device_map, offload_dir=str(tmp_path), main_device="cpu")
    with pytest.raises(ValueError, match=r"proj= reads each projection's weight itself.*offloaded.*model\.layers\.1\."):
        Decoder(model, proj=TopK(0.5))
    assert torch.equal(Decoder(model, kv=Quest(1.0, page=4)).generate(ids, 6, attention_mask=mask), want)


def test_model_and_cache_placement_must_match():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="model is on cpu / torch.float32 but the cache is for cpu / torch.bfloat16"):
        Decoder(model, dtype=torch.bfloat16)
    dec = Decoder(model)
    model.to(torch.float64)
    with pytest.raises(ValueError, match="model is on cpu / torch.float64"):
        dec.generate(torch.ones(1, 4, dtype=torch.long), 2)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens"),
        ({"temperature": 0.0, "do_sample": True}, ValueError, "temperature"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"attention_mask": torch.tensor([[1, 1, 0, 1]])}, ValueError, "left-padded"),
        ({"attention_mask": torch.ones(2, 4, dtype=torch.long)}, ValueError, "attention_mask shape"),
        ({"eos_token_id": "x"}, TypeError, "eos_token_id must be an int or a list of ints"),
        ({"eos_token_id": [1, 2.5]}, TypeError, "eos_token_id must be an int or a list of ints"),
        ({"eos_token_id": 128}, ValueError, "eos_token_id: 128 is outside the vocabulary"),
        ({"pad_token_id": -1}, ValueError, "pad_token_id: -1 is outside the vocabulary"),
        ({"pad_token_id": "0"}, TypeError, "pad_token_id must be an int"),
    ],
)
def test_bad_generate_arguments(kwargs, error, match):
    dec = Decoder(tiny_model("llama"))
    args = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(error, match=match):
        dec.generate(torch.ones(1, 4, dtype=torch.long), **args)


def test_bad_input_ids():
    dec = Decoder(tiny_model("llama"))
    with pytest.raises(TypeError, match="input_ids"):
        dec.generate(torch.ones(1, 4), 2)
    with pytest.raises(ValueError, match="input_ids"):
        dec.generate(torch.ones(4, dtype=torch.long), 2)
    for bad in (128, -1):  # the tiny model has 128 tokens
        with pytest.raises(ValueError, match=f"input_ids must be token ids in 0..127, got {bad}"):
            dec.generate(torch.tensor([[1, bad, 2]]), 2)


def test_a_superseded_decoder_refuses_to_decode_and_says_why():
    """A second Decoder on the same model takes its hooks over; the first must not go on decoding
    with them (it would decode with the other's cache and wrappers, silently)."""
    model = tiny_model("llama")
    ids, mask = padded_batch(2, 9)
    first = Decoder(model, proj=TopK(0.5))
    first.generate(ids, 3, attention_mask=mask)
    second = Decoder(model, kv=Quest(0.5, page=4))
    for call in (lambda: first.generate(ids, 3, attention_mask=mask), lambda: first.generate(ids[:, -1:], 2), first.session.step):
        with pytest.raises(RuntimeError, match="a Decoder built later on the same model took it over"):
            call()
    assert second.generate(ids, 3, attention_mask=mask).shape == (2, 12)  # the newer one works


def test_hf_generate_with_the_policyzoo_attention_left_set_fails_clearly():
    model = tiny_model("llama")
    Decoder(model)
    model.config._attn_implementation = "policyzoo"
    with pytest.raises(RuntimeError, match="runs only inside a Decoder"):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False, pad_token_id=0)


def test_page_size_conflicts_with_policy():
    with pytest.raises(ValueError, match="page_size=16 conflicts with the policy's page=32"):
        Decoder(tiny_model("llama"), kv=Quest(0.5, page=32), page_size=16)
    assert Decoder(tiny_model("llama"), kv=Quest(0.5, page=32)).page_size == 32


def test_cache_keeps_only_the_summaries_the_policy_reads():
    """A dense decode keeps and refreshes no page summary; each policy gets what it lists in
    `KVSelector.summaries`, and a policy that lists nothing (one written before the attribute) gets
    all four. Outputs do not change: the full-budget test above already runs each policy."""
    from policyzoo import SSA, Certified, EntmaxKV
    from policyzoo.cache import SUMMARIES
    from policyzoo.kv.base import KVSelector

    class Legacy(Quest):  # a user's policy from before `summaries`: the base's default applies
        summaries = KVSelector.summaries

    minmax = ("page_min", "page_max")
    expected = [
        (None, ()), (Window(4, 8), ()), (AttentionTopK(0.5), ()), (Quest(0.5, page=4), minmax),
        (SSA(0.25, 0.25, page=4), minmax), (SSA(0.25, 0.25, proxy="exact"), ()),
        (EntmaxKV(0.5, page=4), SUMMARIES), (Certified(AttentionTopK(0.25)), minmax), (Legacy(0.5, page=4), SUMMARIES),
    ]
    model = tiny_model("llama")
    ids, mask = padded_batch(2, 20)
    for policy, kept in expected:
        dec = Decoder(model, kv=policy)
        dec.generate(ids, 3, attention_mask=mask, audit=policy is None)
        assert dec.session.cache.summaries == kept, policy


def test_dense_audit_records_no_certified_bound_without_summaries():
    model = tiny_model("llama")
    ids, mask = padded_batch(1, 20)
    dec = Decoder(model)
    dec.generate(ids, 3, attention_mask=mask, audit=True)
    assert dec.last_audit.mean("dropped_mass") == pytest.approx(0.0, abs=1e-6)
    assert not dec.last_audit.certified_bound


def test_a_request_longer_than_the_model_is_refused_before_any_work():
    model = tiny_model("llama")  # max_position_embeddings = 1024
    dec = Decoder(model)
    ids = torch.randint(1, 128, (1, 1000))
    with pytest.raises(ValueError, match=r"prompt \(1000\) \+ max_new_tokens \(30\) = 1030 tokens exceeds the model's max_position_embeddings \(1024\)"):
        dec.generate(ids, 30)
    assert dec.session.cache is None  # nothing was prefilled
    with pytest.raises(ValueError, match="capacity .* exceeds the model's max_position_embeddings"):
        dec.session.prefill(ids, capacity=1100)
    assert dec.generate(ids, 24).shape == (1, 1024)  # up to the limit itself


def test_greedy_decoding_ignores_temperature_and_top_p_as_hugging_face_does():
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 12))
    want = Decoder(model).generate(ids, 4)
    assert torch.equal(Decoder(model).generate(ids, 4, temperature=0.0, top_p=0.0), want)
    with pytest.raises(ValueError, match="temperature"):
        Decoder(model).generate(ids, 4, do_sample=True, temperature=0.0)


def test_an_entmax_policy_on_a_softmax_model_is_said_out_loud():
    model = tiny_model("llama")
    with pytest.warns(UserWarning, match="attend with 1.5-entmax"):
        Decoder(model, kv=EntmaxKV(0.5, page=4, attention="entmax"))
    model.config.attention_kind = "entmax"  # a model declared entmax: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Decoder(model, kv=EntmaxKV(0.5, page=4, attention="entmax"))

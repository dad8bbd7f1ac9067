"""`policyzoo.apply`: policies inside Hugging Face's own `generate` and `pipeline`."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import BUILTIN_POLICIES, FAMILIES, padded_batch, tiny_model
from transformers import StoppingCriteria, StoppingCriteriaList

import policyzoo
from policyzoo import Decoder, Quest, TopK, Window
from policyzoo.hf import PolicyzooCache

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


def hf_generate(model, ids, mask, n, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, **{**GREEDY, **kwargs})


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.mark.parametrize("name", sorted(BUILTIN_POLICIES))
def test_greedy_tokens_equal_decoder_generate_for_every_builtin_policy(llama, name):
    ids, mask = padded_batch(3, 15)
    want = Decoder(copy.deepcopy(llama), kv=BUILTIN_POLICIES[name]()).generate(ids, 7, attention_mask=mask, eos_token_id=[])
    with policyzoo.apply(llama, kv=BUILTIN_POLICIES[name]()):
        got = hf_generate(llama, ids, mask, 7)
    assert torch.equal(got, want), name


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_with_a_policy_and_a_sparsifier(family):
    model = tiny_model(family)
    ids, mask = padded_batch(2, 14)
    kv, proj = lambda: Quest(0.3, page=4, sinks=2, window=2), lambda: TopK(0.5)
    want = Decoder(copy.deepcopy(model), kv=kv(), proj=proj()).generate(ids, 6, attention_mask=mask, eos_token_id=[])
    with policyzoo.apply(model, kv=kv(), proj=proj()):
        got = hf_generate(model, ids, mask, 6)
    assert torch.equal(got, want)


def test_leaving_the_block_restores_the_model_exactly(llama):
    ids, mask = padded_batch(2, 12)
    before = hf_generate(llama, ids, mask, 5)
    state = {k: v.clone() for k, v in llama.state_dict().items()}
    modules = [(n, type(m)) for n, m in llama.named_modules()]
    config = (llama.config._attn_implementation, llama.generation_config.cache_implementation)
    with policyzoo.apply(llama, kv=Window(sinks=1, window=3), proj=TopK(0.5)):
        sparse = hf_generate(llama, ids, mask, 5)
    assert not torch.equal(sparse, before)  # the policy was in force inside the block
    assert [(n, type(m)) for n, m in llama.named_modules()] == modules
    after = llama.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())
    assert (llama.config._attn_implementation, llama.generation_config.cache_implementation) == config
    assert not llama._forward_pre_hooks and not llama._forward_hooks
    assert all(not block._forward_pre_hooks for block in llama.model.layers)
    assert torch.equal(hf_generate(llama, ids, mask, 5), before)


def test_streamers_and_stopping_criteria_are_generates_own(llama):
    class Collect:
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.clone())

        def end(self):
            self.ended = True

    class AfterThree(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 12 + 3, dtype=torch.bool)

    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    streamer = Collect()
    with policyzoo.apply(llama, kv=Quest(0.3, page=4, sinks=2, window=2)):
        out = llama.generate(ids, max_new_tokens=10, streamer=streamer, stopping_criteria=StoppingCriteriaList([AfterThree()]),
                             **GREEDY)
    assert out.shape[1] == 12 + 3 and streamer.ended
    assert torch.equal(torch.cat([c.reshape(1, -1) for c in streamer.chunks], dim=1), out)
    want = Decoder(copy.deepcopy(llama), kv=Quest(0.3, page=4, sinks=2, window=2)).generate(ids, 3, eos_token_id=[])
    assert torch.equal(out, want)


def test_the_yielded_decoder_drives_the_same_session_and_audits_hf_steps(llama):
    ids, mask = padded_batch(2, 12)
    with policyzoo.apply(llama, kv=Window(sinks=1, window=3)) as dec:
        with dec.session.audit() as audit:
            got = hf_generate(llama, ids, mask, 4)
        assert len(audit.dropped_mass[0]) == 3 and audit.mean("dropped_mass") > 0  # the decode steps after the prompt's
        assert torch.equal(dec.generate(ids, 4, attention_mask=mask, eos_token_id=[]), got)
    with pytest.raises(RuntimeError, match="no longer drives its model"):
        dec.generate(ids, 4, attention_mask=mask)


def test_sampling_runs_and_the_cache_is_sized_by_the_request(llama):
    ids, mask = padded_batch(2, 10)
    with policyzoo.apply(llama, kv=Quest(0.3, page=4)) as dec:
        out = llama.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=True, top_p=0.9, pad_token_id=0)
        assert out.shape == (2, 19)
        assert dec.session.cache.capacity >= 19 and dec.session.cache.capacity < 19 + 2 * 4  # max_length, whole pages and the slot
        cache = llama.generate(ids, attention_mask=mask, max_new_tokens=2, return_dict_in_generate=True, **GREEDY)
        assert isinstance(_cache_of(cache), PolicyzooCache) and _cache_of(cache).seen == 10 + 1


def _cache_of(output):
    return getattr(output, "cache", None) or getattr(output, "past_key_values", None)


def test_refusals_are_clear(llama):
    ids, mask = padded_batch(1, 10)
    with pytest.raises(ValueError, match="capacity must be"):
        with policyzoo.apply(llama, capacity=0):
            pass
    with policyzoo.apply(llama, kv=Quest(0.3, page=4)):
        with pytest.raises(ValueError, match="DynamicCache.*capacity="):
            hf_generate(llama, ids, mask, 3, cache_implementation="dynamic")
        with pytest.raises(RuntimeError, match="already inside a policyzoo.apply"):
            with policyzoo.apply(llama):
                pass
        with pytest.raises(ValueError, match="inputs_embeds"):
            llama(inputs_embeds=torch.zeros(1, 3, llama.config.hidden_size))
    with policyzoo.apply(llama, kv=Quest(0.3, page=4), capacity=16):  # a fixed capacity takes any cache
        assert hf_generate(llama, ids, mask, 3, cache_implementation="dynamic").shape == (1, 13)
        with pytest.raises(RuntimeError, match="the cache is full"):
            hf_generate(llama, ids, mask, 12, cache_implementation="dynamic")


@pytest.mark.slow
def test_a_text_generation_pipeline_decodes_with_the_policy():
    from transformers import pipeline

    from policyzoo.assets import load_model

    model, tok = load_model()
    pipe = pipeline("text-generation", model=model, tokenizer=tok, device=model.device)
    prompt = "The capital of France is"
    dense = pipe(prompt, max_new_tokens=8, do_sample=False)[0]["generated_text"]
    with policyzoo.apply(model, kv=Quest(1.0)) as dec:  # a full budget: the dense answer
        full = pipe(prompt, max_new_tokens=8, do_sample=False)[0]["generated_text"]
        assert dec.session.cache is not None and int(dec.session.cache.length) > 0  # the session decoded it
    assert full == dense and full.startswith(prompt)

"""The embedded SmolLM2-135M-Instruct on a real passkey prompt (about 1K tokens)."""

from __future__ import annotations

import pytest
import torch

from policyzoo import AttentionTopK, Decoder, TopK
from policyzoo.assets import check_answer, load_model, passkey_prompt

pytest.importorskip("gguf")
pytestmark = pytest.mark.slow

NEW_TOKENS = 7  # " 12345." is 7 tokens


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return load_model()


@pytest.fixture(scope="module")
def prompt(model_and_tokenizer):
    _, tok = model_and_tokenizer
    return passkey_prompt(tok, 1024, depth=0.5, seed=0)


@pytest.fixture(scope="module")
def dense_out(model_and_tokenizer, prompt):
    model, _ = model_and_tokenizer
    ids, _ = prompt
    return Decoder(model).generate(ids, NEW_TOKENS)


def answer_of(tok, out, ids):
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_model_is_eval_and_float(model_and_tokenizer):
    model, tok = model_and_tokenizer
    assert not model.training
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert tok.eos_token is not None


def test_dense_passkey(model_and_tokenizer, prompt, dense_out):
    _, tok = model_and_tokenizer
    ids, answer = prompt
    assert 980 <= ids.shape[1] <= 1024
    text = answer_of(tok, dense_out, ids)
    assert check_answer(text, answer), (text, answer)


def test_attention_topk_passkey(model_and_tokenizer, prompt):
    model, tok = model_and_tokenizer
    ids, answer = prompt
    dec = Decoder(model, kv=AttentionTopK(0.25))
    out = dec.generate(ids, NEW_TOKENS, audit=True)
    text = answer_of(tok, out, ids)
    assert check_answer(text, answer), (text, answer)
    audit = dec.last_audit
    assert abs(audit.mean("kv_keep") - 0.25) < 0.02
    assert 0.0 < audit.mean("dropped_mass") < 0.2


def test_rewrapping_the_same_model(model_and_tokenizer, prompt, dense_out):
    """A fresh Decoder over a model another Decoder (with projections) wrapped decodes like the first."""
    model, _ = model_and_tokenizer
    ids, _ = prompt
    Decoder(model, kv=AttentionTopK(0.25), proj=TopK(0.5)).generate(ids, 2)
    again = Decoder(model)
    assert torch.equal(again.generate(ids, NEW_TOKENS), dense_out)
    again.generate(ids[:, :64], 3, audit=True)
    assert abs(again.last_audit.mean("dropped_mass")) < 1e-4

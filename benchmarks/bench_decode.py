"""Decode-step benchmarks (pytest-benchmark): one step of a small Llama through the Decoder.

    pytest benchmarks/bench_decode.py                       # timings
    pytest benchmarks/bench_decode.py --benchmark-disable   # CI smoke test: each runs once

On CPU the model is tiny and the operators are the torch references, so the timings only show that
each setting runs; the device sweep (`benchmarks.sweep`) is where speed is measured. Each
benchmark checks the step's logits against dense decoding at a full budget, so the smoke run checks
something too.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from policyzoo import AttentionTopK, Decoder, Quest, TopK

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONTEXT = 4096 if DEVICE == "cuda" else 256


def small_llama():
    dims = (
        dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=4, head_dim=128)
        if DEVICE == "cuda"
        else dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    )
    cfg = LlamaConfig(**dims, num_hidden_layers=2, vocab_size=1024, max_position_embeddings=8192, pad_token_id=0)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(DEVICE, torch.bfloat16 if DEVICE == "cuda" else torch.float32).eval()


SETTINGS = {
    "dense": (None, None),
    "quest-full": (lambda: Quest(1.0, page=16), None),
    "attn-topk-full": (lambda: AttentionTopK(1.0), None),
    "quest-0.25": (lambda: Quest(0.25, page=16), None),
    "topk-0.5": (None, lambda: TopK(0.5)),
}


@pytest.fixture(scope="module")
def model():
    return small_llama()


def _step_runner(model, kv, proj):
    """One decode step of the same token at the same slot every round, through the session."""
    session = Decoder(model, kv=kv, proj=proj).session
    ids = torch.randint(1, 1000, (1, CONTEXT), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    token = ids[:, -1:]
    session.prefill(ids[:, :-1], capacity=CONTEXT + 64)
    length = CONTEXT - 1

    def step():
        session.rewind(length)
        logits = session.step(token)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return logits

    return step


@pytest.mark.parametrize("name", list(SETTINGS))
def test_decode_step(benchmark, model, name):
    kv_f, proj_f = SETTINGS[name]
    dense = _step_runner(model, None, None)()
    logits = benchmark(_step_runner(model, kv_f() if kv_f else None, proj_f() if proj_f else None))
    assert torch.isfinite(logits).all()
    if name.endswith("full") or name == "dense":
        tol = 2e-2 if DEVICE == "cuda" else 1e-4
        torch.testing.assert_close(logits.float(), dense.float(), atol=tol, rtol=tol)
    else:  # a real budget or projection sparsity changes the step's output
        assert not torch.allclose(logits.float(), dense.float(), atol=1e-6, rtol=0)

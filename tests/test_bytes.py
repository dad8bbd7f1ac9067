"""The byte account against hand-computed values and the ByteCross paper's Table 1."""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig

from policyzoo.bytes import ByteAccount, selection_overhead


def test_llama_8b_by_hand():
    a = ByteAccount.from_config("llama-3.1-8b")
    # q and o: 4096·4096 each; k and v: 4096·1024 each; gate, up, down: 4096·14336 each.
    assert a.proj == 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 == 218_103_808
    assert a.kv_per_token == 2048
    # Dense at 32K: 32 layers of (P + 2048·32768) elements plus LM head and norms, 2 bytes each.
    expected = (32 * (218_103_808 + 2048 * 32768) + 128256 * 4096 + 65 * 4096) * 2
    assert a.step_bytes(32768) == expected
    assert a.floor_ms(32768, 4.27e12) == pytest.approx(4.52, abs=0.01)  # the Llama-3.1-8B byte floor at 32K on an H200 (4.52 ms)


def test_smollm2_by_hand_and_from_hf_config():
    a = ByteAccount.from_config("smollm2-135m")
    assert a.proj == 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True)
    assert ByteAccount.from_config(cfg) == a


@pytest.mark.parametrize(
    ("name", "full", "ff"),
    [("qwen3-8b", 65.7, 51.4), ("llama-3.1-8b", 74.3, 60.0), ("mistral-7b", 74.3, 60.0), ("llama-3.1-70b", 291.4, 240.0)],
)
def test_crossover_matches_bytecross_table_1(name, full, ff):
    a = ByteAccount.from_config(name)
    assert a.crossover(0.5, 0.3) / 1024 == pytest.approx(full, abs=0.05)
    assert a.crossover(0.5, 0.3, ff_only=True) / 1024 == pytest.approx(ff, abs=0.05)


def test_bound_and_crossover_are_consistent():
    a = ByteAccount.from_config("llama-3.1-8b")
    n = a.crossover(0.5, 0.3)
    # At the crossover both branches save the same bytes, so their bounds are equal.
    assert a.bound(int(n), r_p=0.5) == pytest.approx(a.bound(int(n), r_kv=0.3), rel=1e-4)
    assert a.bound(4096) == 1.0
    assert a.bound(131072, r_kv=0.1) > a.bound(4096, r_kv=0.1) > 1.0


def test_general_projection_shapes(tmp_path):
    # heads × head_dim need not equal the hidden size (Qwen3 and Gemma-style configs).
    cfg = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 2, "num_attention_heads": 16,
           "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    a = ByteAccount.from_config(tmp_path)
    assert a.attn_proj == 2 * 1024 * 16 * 128 + 2 * 1024 * 8 * 128


def test_batched_projection_needs_the_union_keep():
    a = ByteAccount.from_config("llama-3.1-8b")
    with pytest.raises(ValueError, match="union_keep"):
        a.crossover(0.5, 0.3, batch=4)
    assert a.crossover(0.5, 0.3, batch=4, union_keep=0.92) / 1024 == pytest.approx(74.3 * 0.08 / 0.5 / 4, rel=1e-3)


@pytest.mark.parametrize("bad", [0.0, 1.5, -1])
def test_bad_ratios_are_rejected(bad):
    with pytest.raises(ValueError, match="r_p must be a keep ratio"):
        ByteAccount.from_config("qwen3-8b").step_bytes(1024, r_p=bad)


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ValueError, match="neither a built-in name"):
        ByteAccount.from_config("gpt-17")


def test_union_keep_is_checked_and_never_shrinks_a_dense_projection():
    a = ByteAccount.from_config("llama-3.1-8b")
    assert a.step_bytes(4096, r_p=1.0, batch=4, union_keep=0.5) == a.step_bytes(4096, batch=4)
    with pytest.raises(ValueError, match="union_keep .* cannot be below r_p"):
        a.step_bytes(4096, r_p=0.5, batch=4, union_keep=0.3)


def test_selection_bytes_of_page_and_two_stage_policies():
    """A page policy reads its pages' min and max (1/page of a token's KV elements); a second stage
    reads the candidates' keys (half their elements); both lower the bound."""
    acct = ByteAccount.from_config("llama-3.1-8b")
    n = 131072
    assert selection_overhead(16) == 1 / 16
    assert selection_overhead(16, rescore=3, r_kv=0.1) == pytest.approx(1 / 16 + 0.15)
    assert selection_overhead(None, rescore=10, r_kv=0.1) == 0.5  # every key scored exactly
    assert selection_overhead(16, sketch=True) == pytest.approx(1 / 16 + 1 / 8)  # 4-bit codes of every key
    # two levels: the codes of the box's candidates only, 4 times a tenth of the tokens
    assert selection_overhead(16, r_kv=0.1, sketch=True, nominate=4) == pytest.approx(1 / 16 + 0.4 / 8)
    assert selection_overhead(16, r_kv=0.5, sketch=True, nominate=4) == pytest.approx(1 / 16 + 1 / 8)
    plain = acct.bound(n, r_kv=0.1)
    quest = acct.bound(n, r_kv=0.1, r_select=selection_overhead(16))
    two = acct.bound(n, r_kv=0.1, r_select=selection_overhead(16, rescore=3, r_kv=0.1))
    assert plain > quest > two > 1
    extra = acct.step_bytes(n, r_kv=0.1, r_select=0.25) - acct.step_bytes(n, r_kv=0.1)
    assert extra == pytest.approx(acct.layers * acct.kv_per_token * n * 0.25 * acct.element_size)
    with pytest.raises(ValueError, match="r_select"):
        acct.step_bytes(n, r_select=-0.1)


@pytest.mark.parametrize("shape", ["llama-3.1-8b", "llama-3.1-70b"])
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_a_ranks_share_splits_all_but_the_replicated_head(shape, world):
    """Per rank: the projections and the KV cache split ``world`` ways; the LM head and norms are read
    whole by every rank."""
    whole = ByteAccount.from_config(shape)
    rank = whole.per_rank(world)
    fixed = whole.fixed * whole.element_size
    for n, r_kv in ((4096, 1.0), (32768, 0.1)):
        assert rank.step_bytes(n, r_kv=r_kv) == pytest.approx((whole.step_bytes(n, r_kv=r_kv) - fixed) / world + fixed)
    assert whole.per_rank(1) == whole


def test_a_ranks_share_needs_whole_heads():
    with pytest.raises(ValueError, match="does not split over 3 ranks"):
        ByteAccount.from_config("llama-3.1-8b").per_rank(3)
    with pytest.raises(ValueError, match="positive int"):
        ByteAccount.from_config("llama-3.1-8b").per_rank(0)

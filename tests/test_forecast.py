"""Contract of `policyzoo.kv.Forecast` (SparDA's learned next-layer block selector): its scores are
the mean-key scores of the windows max-pooled per block, its selection holds the forced blocks and
the best others within the budget, each layer's blocks are predicted one layer ahead from the hidden
state entering the layer below, the page means it keeps stay equal to a recomputation, and it
decodes compiled with one graph."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import padded_batch, tiny_model

from policyzoo import Decoder
from policyzoo.kv import Forecast, ForecastHeads, KVState
from policyzoo.kv.forecast import MAX_SHARE, block_scores, default_rank, page_means, parameter_share, rotate
from policyzoo.spec import parse_kv

SETTINGS = settings(max_examples=40, deadline=None)
SMALL = dict(block=8, kernel=8, stride=4, sinks=2, window=2)  # the paper's geometry, scaled down


def policy_on(case, budget, block_pages, kernel_pages, sinks, window, seed=0):
    """A Forecast for ``case``'s one-layer cache, its page means made, and a hidden state."""
    page = case.page
    heads = ForecastHeads(1, 12, case.h_kv, case.d, rank=4)
    policy = Forecast(budget, heads=heads, block=block_pages * page, kernel=kernel_pages * page, stride=page, sinks=sinks, window=window)
    state = case.state()
    policy.prefill(state, case.q[:, :, None], None, None)
    hidden = torch.randn(case.b, 12, generator=torch.Generator().manual_seed(seed))
    return policy, state, hidden


def brute_block_scores(case, f, kernel_pages, block_pages):
    """Per (row, KV head, block): the best score of a window overlapping the block, the window's
    score being ``scale · f · mean(its visible keys)``; plain loops over the cache."""
    page, length = case.page, case.length
    n_pages = case.cache.num_pages
    n_blocks = -(-n_pages // block_pages)
    keys = case.cache.keys[0].double()
    out = torch.full((case.b, case.h_kv, n_blocks), -math.inf, dtype=torch.double)
    for r in range(case.b):
        vis = range(case.starts[r], length)
        for hk in range(case.h_kv):
            for j in range(n_pages):
                toks = [t for t in range(j * page, (j + kernel_pages) * page) if t in vis]
                if not toks:
                    continue
                score = case.scale * float(f[r, hk].detach().double() @ keys[r, hk, toks].mean(0))
                for blk in range(n_blocks):
                    lo, hi = blk * block_pages, (blk + 1) * block_pages
                    if j < hi and j + kernel_pages > lo:
                        out[r, hk, blk] = max(out[r, hk, blk], score)
    return out


geometry = st.tuples(st.integers(1, 3), st.integers(1, 3))  # (block, kernel) in pages


@SETTINGS
@given(data=st.data(), geom=geometry)
def test_block_scores_are_the_best_overlapping_window_mean_key_score(data, cases, geom):
    case = data.draw(cases(page_sizes=(1, 2, 4), max_prompt=40))
    block_pages, kernel_pages = geom
    policy, state, hidden = policy_on(case, 0.5, block_pages, kernel_pages, 0, 0)
    got = policy.scores(state, 0, hidden, None).double()
    # the head without its input norm: a positive factor per row, which changes no ranking
    heads = policy.predictor
    f = (hidden @ heads.down[0] @ heads.up[0]).view(case.b, case.h_kv, case.d)
    norm = torch.rsqrt(hidden.pow(2).mean(-1) + 1e-6)
    torch.testing.assert_close(heads(hidden, 0), f * norm[:, None, None])
    want = brute_block_scores(case, f, kernel_pages, block_pages)
    assert torch.equal(got == -math.inf, want == -math.inf)
    finite = want > -math.inf
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-4)


@SETTINGS
@given(
    data=st.data(), geom=geometry, sinks=st.integers(0, 10), window=st.integers(0, 12),
    budget=st.one_of(st.floats(0.01, 1.0), st.integers(1, 40)),
)  # fmt: skip
def test_the_selection_holds_the_forced_blocks_and_the_best_others_within_the_budget(data, cases, contract, geom, sinks, window, budget):
    case = data.draw(cases(page_sizes=(1, 2, 4), max_prompt=40))
    block_pages, kernel_pages = geom
    policy, state, hidden = policy_on(case, budget, block_pages, kernel_pages, sinks, window)
    sel = policy.choose(state, 0, hidden, None)
    assert sel.block == policy.block and sel.log_weight is None
    contract.check_error_bound(sel, case)  # what the kernel attends to: the blocks' visible tokens
    scores = policy.scores(state, 0, hidden, None)
    block = policy.block
    for r in range(case.b):
        vis = case.visible_tokens(r)
        visible_blocks = sorted({t // block for t in vis})
        forced = {t // block for t in case.forced_tokens(r, sinks, max(window, 1))}
        want = math.ceil(budget * len(visible_blocks) - 1e-9) if isinstance(budget, float) else -(-budget // block)
        for hk in range(case.h_kv):
            kept = contract.selected(sel, r, hk)
            assert kept == sorted(set(kept)), "blocks unique and ascending"
            assert set(kept) <= set(visible_blocks) and forced <= set(kept)
            assert min(want, len(visible_blocks)) <= len(kept) <= max(want, len(forced))
            # the best: no dropped block outscores a kept unforced one (up to bf16 ranking precision)
            s = scores[r, hk].double()
            dropped = [s[x] for x in visible_blocks if x not in kept]
            for x in set(kept) - forced:
                assert all(s[x] >= d - 1e-2 * abs(d) - 1e-6 for d in dropped)


def test_rotate_is_the_models_rotary_embedding():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = tiny_model("llama")
    x = torch.randn(3, 2, 16)
    pos = torch.tensor([[0], [5], [17]])
    cos, sin = model.model.rotary_emb(x, pos)  # [B, 1, D]
    want, _ = apply_rotary_pos_emb(x[:, :, None], x[:, :, None], cos, sin)
    torch.testing.assert_close(rotate(x, (cos[:, 0], sin[:, 0])), want[:, :, 0])
    # a partial rotary embedding rotates the first channels only
    got = rotate(x, (cos[:, 0, :8], sin[:, 0, :8]))
    torch.testing.assert_close(got[..., 8:], x[..., 8:])
    assert rotate(x, None) is x


def test_untrained_heads_are_the_models_grouped_query_projections():
    """At full rank, head i of `from_model` maps a hidden state to the sum of layer i's query heads
    of each GQA group (before RoPE), input norm included."""
    model = tiny_model("llama", layers=3)
    heads = ForecastHeads.from_model(model, rank=64)
    h = torch.randn(5, 64)
    for i, layer in enumerate(model.model.layers):
        with torch.no_grad():
            q = layer.self_attn.q_proj(layer.input_layernorm(h)).view(5, 2, 2, 16).sum(2)
        torch.testing.assert_close(heads(h, i), q, rtol=1e-4, atol=1e-4)


def test_default_rank_keeps_the_heads_under_half_a_percent_of_the_model():
    import transformers

    for cfg, rank in (
        (dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True), 16),
        (dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256), 128),
    ):  # fmt: skip
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
            heads = ForecastHeads(cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_key_value_heads"], cfg["hidden_size"] // cfg["num_attention_heads"], default_rank(model))
        assert default_rank(model) == rank
        assert parameter_share(heads, model) <= MAX_SHARE < 0.005


def test_full_budget_decodes_as_dense():
    model = tiny_model("llama", layers=3)
    ids, mask = padded_batch(2, 70)
    dense = Decoder(model).generate(ids, 8, attention_mask=mask)
    full = Decoder(model, kv=Forecast(1.0, rank=4, **SMALL)).generate(ids, 8, attention_mask=mask)
    assert torch.equal(full, dense)


class RecordingForecast(Forecast):
    """Forecast that writes down which layer's blocks it scored, from what hidden state."""

    def scores(self, state, layer, hidden, rotary):
        self.calls.append((layer, hidden.detach().clone()))
        return super().scores(state, layer, hidden, rotary)


def test_each_layer_is_chosen_one_layer_ahead_from_the_hidden_state_below():
    model = tiny_model("llama", layers=3)
    ids, mask = padded_batch(2, 50)
    # every block: the hidden states are dense, as HF's own forward computes them
    policy = RecordingForecast(1.0, rank=8, **SMALL)
    policy.calls = []
    out = Decoder(model, kv=policy).generate(ids, 4, attention_mask=mask)
    # per step: head 0 and head 1 at layer 0, head 2 at layer 1, nothing at layer 2 (the last)
    assert [c[0] for c in policy.calls] == [0, 1, 2] * 3
    seq_mask = torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], 1)
    with torch.no_grad():
        hf = model(out[:, :-1], attention_mask=seq_mask, position_ids=(seq_mask.cumsum(1) - 1).clamp(min=0), output_hidden_states=True)
    for i, (head, hidden) in enumerate(policy.calls):
        step = i // 3
        below = max(head - 1, 0)  # head i reads the hidden state entering layer i - 1 (head 0: layer 0)
        torch.testing.assert_close(hidden, hf.hidden_states[below][:, ids.shape[1] + step], atol=1e-4, rtol=1e-4)


@settings(max_examples=25, deadline=None)
@given(pages=st.integers(1, 9), page=st.sampled_from([1, 4]), chunk=st.integers(1, 10), seed=st.integers(0, 2**16))
def test_page_means_are_the_mean_visible_key_in_chunks_of_any_size(pages, page, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 3, pages * page, 5, generator=g).bfloat16()
    valid = torch.rand(2, pages * page, generator=g) < 0.6
    got = page_means(keys, valid, page, chunk_pages=chunk)
    for b in range(2):
        for p in range(pages):
            seen = valid[b, p * page : (p + 1) * page]
            k = keys[b, :, p * page : (p + 1) * page].float()[:, seen]
            want = k.mean(1) if seen.any() else torch.zeros(3, 5)
            torch.testing.assert_close(got[b, :, p], want, rtol=1e-6, atol=1e-6)


def test_the_page_means_stay_equal_to_a_recomputation():
    model = tiny_model("qwen3", layers=2)
    ids, mask = padded_batch(3, 37)
    dec = Decoder(model, kv=Forecast(0.4, rank=4, **SMALL))
    dec.generate(ids, 11, attention_mask=mask)
    cache = dec.session.cache
    means = dec.session.contexts.request.means
    for layer in range(2):
        want = page_means(cache.keys[layer], cache.token_valid(), 4)
        torch.testing.assert_close(means[layer].float(), want, rtol=1e-5, atol=1e-5)


def test_compiled_steps_replay_one_graph_and_match_eager():
    from torch._dynamo.utils import counters

    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch(2, 45)
    eager = Decoder(copy.deepcopy(model), kv=Forecast(0.3, rank=4, **SMALL)).generate(ids, 50, attention_mask=mask)
    dense = Decoder(copy.deepcopy(model)).generate(ids, 50, attention_mask=mask)
    assert not torch.equal(eager, dense)  # the selection matters: the test has power
    torch._dynamo.reset()
    counters.clear()
    dec = Decoder(model, kv=Forecast(0.3, rank=4, **SMALL), compile=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        first = dec.generate(ids, 50, attention_mask=mask)
        second = dec.generate(ids, 50, attention_mask=mask)
    assert torch.equal(first, eager) and torch.equal(second, eager)
    assert counters["stats"]["unique_graphs"] == 1 and sum(counters["recompiles"].values()) == 0


class RescoreRecorder(Forecast):
    """Forecast that writes down, per layer and step, the blocks it was handed, its query, the cache's
    keys and visibility, and the selection it returned."""

    def select(self, state, q):
        ahead = state.request_for(self).next if state.layer else None
        sel = super().select(state, q)
        c = state.cache
        self.seen.append((ahead, sel, q.clone(), state.keys.clone(), int(c.length), c.start.clone(), state.scale))
        return sel


def test_rescore_keeps_the_budgets_best_blocks_among_the_nominated_ones():
    """With ``rescore=r`` the forecast nominates ``r`` times the budget's blocks one layer ahead and
    the layer keeps the budget's blocks among them: blocks (not tokens), inside the nominated ones,
    the sink's and the step's own kept, and no dropped candidate with a better exact logit (the
    group's max over its visible keys) than a kept unforced one."""
    model = tiny_model("llama", layers=3)
    ids, mask = padded_batch(2, 60)
    policy = RescoreRecorder(0.25, rank=4, rescore=2, **SMALL)
    policy.seen = []
    Decoder(model, kv=policy).generate(ids, 4, attention_mask=mask)
    assert policy.two_stage
    checked = narrowed = 0
    for ahead, sel, q, keys, length, start, scale in policy.seen:
        assert sel.block == 8
        if ahead is None:
            continue
        h_kv = keys.shape[1]
        g = q.shape[1] // h_kv
        for r in range(2):
            s0 = int(start[r])
            for hk in range(h_kv):
                kept = set(sel.indices[r, hk, : int(sel.count[r, hk])].tolist())
                nominated = set(ahead.indices[r, hk, : int(ahead.count[r, hk])].tolist())
                assert kept <= nominated and {(length - 1) // 8, s0 // 8} <= kept
                visible_blocks = len({t // 8 for t in range(s0, length)})
                forced_all = {t // 8 for t in range(s0, length) if t < s0 + SMALL["sinks"] or t >= length - SMALL["window"]}
                assert len(kept) <= max(math.ceil(0.25 * visible_blocks), len(forced_all))
                narrowed += len(nominated) > len(kept)

                def best(block):
                    pos = [t for t in range(block * 8, block * 8 + 8) if s0 <= t < length]
                    return float((q[r, hk * g : (hk + 1) * g].float() @ keys[r, hk, pos].float().T).max() * scale)

                forced = {x for x in kept if x * 8 < s0 + SMALL["sinks"] or x * 8 + 8 > length - SMALL["window"]}
                dropped = [best(x) for x in nominated - kept]
                for x in kept - forced:
                    assert all(best(x) >= d - 1e-2 * abs(d) - 1e-5 for d in dropped)
                checked += 1
    assert checked and narrowed  # the layer chose among more blocks than it kept


def test_rescore_compiles_into_one_graph_and_matches_eager():
    from torch._dynamo.utils import counters

    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch(2, 45)
    eager = Decoder(copy.deepcopy(model), kv=Forecast(0.3, rank=4, rescore=2, **SMALL)).generate(ids, 12, attention_mask=mask)
    torch._dynamo.reset()
    counters.clear()
    dec = Decoder(model, kv=Forecast(0.3, rank=4, rescore=2, **SMALL), compile=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(dec.generate(ids, 12, attention_mask=mask), eager)
    assert counters["stats"]["unique_graphs"] == 1


def test_heads_save_and_load_through_the_file_and_the_spec(tmp_path):
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch(2, 40)
    trained = Forecast(0.3, rank=4, **SMALL)
    dec = Decoder(model, kv=trained)
    with torch.no_grad():
        trained.predictor.up.mul_(-1.5)  # not the init: the file must carry these weights
    want = dec.generate(ids, 6, attention_mask=mask)
    path = trained.save(tmp_path / "heads.safetensors")
    for policy in (
        Forecast(0.3, heads=path, **SMALL),
        Forecast.load(path),
        parse_kv(f"forecast:0.3,heads={path},block=8,kernel=8,stride=4,sinks=2,window=2"),
        parse_kv(f"forecast:path={path}"),
    ):
        assert policy.budget == 0.3 and policy.block == 8
        assert torch.equal(Decoder(model, kv=policy).generate(ids, 6, attention_mask=mask), want)


def test_bad_arguments_name_themselves(tmp_path):
    with pytest.raises(ValueError, match="kernel"):
        Forecast(0.1, kernel=24, stride=16)
    with pytest.raises(ValueError, match="block"):
        Forecast(0.1, block=40, stride=16)
    with pytest.raises(TypeError, match="heads"):
        Forecast(0.1, heads=3)
    with pytest.raises(ValueError, match="rank"):
        Forecast(0.1, rank=0)
    with pytest.raises(ValueError, match="rescore"):
        Forecast(0.1, rescore=0.5)
    with pytest.raises(FileNotFoundError):
        Forecast(0.1, heads=tmp_path / "missing.safetensors")
    other = Forecast(0.1, rank=4, **SMALL)
    Decoder(tiny_model("llama", layers=3), kv=other)
    with pytest.raises(ValueError, match="heads are for"):
        Decoder(tiny_model("llama", layers=2), kv=Forecast(0.1, heads=other.predictor, **SMALL))
    with pytest.raises(ValueError, match="page_size"):
        Decoder(tiny_model("llama"), kv=Forecast(0.1, rank=4, **SMALL), page_size=8).generate(torch.ones(1, 20, dtype=torch.long), 2)


def test_select_outside_a_decoder_says_what_it_needs(make_case):
    case = make_case(b=1, h_kv=1, g=2, d=8, page=4, prompt=20, steps=0, starts=[0], seed=0)
    policy, state, _ = policy_on(case, 0.5, 2, 2, 0, 0)
    with pytest.raises(RuntimeError, match="hidden state"):
        policy.select(state, case.q)
    with pytest.raises(RuntimeError, match="heads"):
        Forecast(0.1).prefill(KVState(case.cache, 0, 1.0), case.q[:, :, None], None, None)


def test_block_scores_of_empty_windows_are_minus_inf():
    scores = torch.tensor([[[1.0, 2.0, 5.0, 0.0]]])
    counts = torch.tensor([[4, 4, 0, 0]])
    out = block_scores(scores, counts, 2, 2)
    # windows: (1·4+2·4)/8 = 1.5, (2·4)/4 = 2, empty, empty; block 0 sees windows 0..1, block 1 window 1..3
    assert out.tolist() == [[[2.0, 2.0]]]
    assert block_scores(scores, torch.zeros(1, 4, dtype=torch.long), 2, 2).eq(-math.inf).all()


def test_untrained_heads_read_the_query_projection_through_a_decoders_wrapper(monkeypatch):
    """A model another Decoder wrapped (its q/k/v fused on the kernel path) gives the same heads."""
    model = tiny_model("llama")
    before = ForecastHeads.from_model(model, rank=8)
    monkeypatch.setenv("POLICYZOO_TRITON", "1")  # the kernel path wraps the projections
    Decoder(model)
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "SparseLinear"
    after = ForecastHeads.from_model(model, rank=8)
    assert torch.equal(before.down, after.down) and torch.equal(before.up, after.up)


def test_a_rank_beyond_the_model_is_refused_when_the_decoder_takes_the_policy():
    from tiny_models import tiny_model

    from policyzoo import Decoder

    with pytest.raises(ValueError, match=r"Forecast\(rank=1000\): the rank can be at most .* = 32"):
        Decoder(tiny_model("llama"), kv=Forecast(0.5, rank=1000))  # hidden 64, H_kv·D = 2·16

"""`DecodeSession` contract: the one owner of decode state. Its prefill and steps reproduce the
unwrapped model; every way to start a sequence batch leaves the same cache; a compiled session
steps like an eager one; misuse fails with a clear error."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tiny_models import BUILTIN_POLICIES, padded_batch, tiny_model

from policyzoo import SSA, AttentionTopK, Certified, CommunityKV, Decoder, EntmaxKV, Forecast, PrHS, Quest, Window
from policyzoo.eval.audit import Audit
from policyzoo.synthetic import fill_random
from policyzoo.timing import time_step


def hf_logits(model, seq, mask):
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(seq, attention_mask=mask, position_ids=positions).logits


def test_prefill_and_steps_reproduce_the_unwrapped_model():
    model = tiny_model("qwen2")
    ids, mask = padded_batch(3, 14)
    session = Decoder(model).session
    logits = session.prefill(ids, mask, capacity=20, keep_logits=3)
    want = hf_logits(model, ids, mask)
    torch.testing.assert_close(logits, want[:, -3:], atol=1e-4, rtol=1e-4)
    seq, full = ids, mask
    token = session.choose(logits[:, -1])
    for _ in range(4):
        seq = torch.cat([seq, token[:, None]], 1)
        full = torch.cat([full, torch.ones_like(full[:, :1])], 1)
        step_logits = session.step()  # feeds the token the session chose
        torch.testing.assert_close(step_logits, hf_logits(model, seq, full)[:, -1], atol=1e-4, rtol=1e-4)
        assert torch.equal(session.last_token, step_logits.argmax(-1))
        token = session.last_token
    assert int(session.cache.length) == session.prompt_slot(14) + 18 and int(session.contexts.index) == 4


def test_a_step_given_tokens_feeds_them_instead_of_its_choice():
    model = tiny_model("llama")
    ids, mask = padded_batch(2, 9)
    session = Decoder(model).session
    session.choose(session.prefill(ids, mask, capacity=12)[:, -1])
    forced = torch.tensor([5, 6])
    logits = session.step(forced)
    seq = torch.cat([ids, forced[:, None]], 1)
    full = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
    torch.testing.assert_close(logits, hf_logits(model, seq, full)[:, -1], atol=1e-4, rtol=1e-4)


def test_load_prefix_leaves_the_cache_a_prefill_leaves():
    model = tiny_model("llama")
    ids, mask = padded_batch(2, 13)
    a = Decoder(copy.deepcopy(model), kv=Quest(0.5, page=4)).session
    a.prefill(ids, mask, capacity=20)
    first = a.prompt_slot(13)  # the prompt ends on a page boundary: 3 empty slots, then its 13
    assert first == 3 and int(a.cache.length) == 16
    prompt = slice(first, first + 13)
    prefix = [(a.cache.keys[l][:, :, prompt].clone(), a.cache.values[l][:, :, prompt].clone()) for l in range(2)]
    b = Decoder(model, kv=Quest(0.5, page=4)).session
    b.load_prefix(prefix, (mask == 0).sum(1), capacity=20)
    for name in ("keys", "values", "page_min", "page_max"):
        for layer in range(2):
            assert torch.equal(getattr(a.cache, name)[layer], getattr(b.cache, name)[layer]), name
    assert torch.equal(a.cache.start, b.cache.start) and int(a.cache.length) == int(b.cache.length) == 16
    tokens = torch.tensor([3, 4])
    torch.testing.assert_close(a.step(tokens), b.step(tokens))


def test_load_prefix_refuses_a_policy_that_needs_its_own_prefill():
    from policyzoo import SSA

    session = Decoder(tiny_model("llama"), kv=SSA(0.2, 0.1, page=4)).session  # SSA builds its RNG in prefill
    assert session.needs_own_prefill()
    with pytest.raises(ValueError, match="own prefill"):
        session.load_prefix([(torch.zeros(1, 2, 4, 16), torch.zeros(1, 2, 4, 16))] * 2, torch.zeros(1, dtype=torch.long), capacity=8)


def test_fill_random_gives_an_exact_capacity_and_consistent_summaries():
    session = Decoder(tiny_model("llama"), kv=Quest(0.5, page=4)).session
    fill_random(session, 30, batch=2, capacity=50, generator=torch.Generator().manual_seed(0))
    cache = session.cache
    assert cache.capacity == 52 and int(cache.length) == 30 and cache.batch == 2  # whole pages
    page_min = cache.page_min[1].clone()
    cache.summarise(1, slice(0, cache.num_pages))
    assert torch.equal(cache.page_min[1], page_min)
    fill_random(session, 20, batch=2, capacity=60)  # another exact capacity: another cache
    assert session.cache.capacity == 60 and session.cache is not cache
    with pytest.raises(ValueError, match="must hold the 20 filled tokens"):
        fill_random(session, 20, capacity=10)


def test_fill_random_feeds_random_tokens_and_feed_sets_the_next_input():
    """A random state's first step decodes random token ids, not token 0 (a padding id whose
    embedding may be zero: an activation sparsifier would then keep nothing, and the greedy choice
    of a zero state is token 0 again); `feed` sets the next input as ``step(tokens)`` does."""
    model = tiny_model("llama")
    model.get_input_embeddings().weight.data[0] = 0  # token 0 as a zero padding embedding
    session = Decoder(model).session
    fill_random(session, 16, batch=3, capacity=32, generator=torch.Generator().manual_seed(1))
    first = session.step().clone()
    session.rewind(16)
    zero = torch.zeros(3, dtype=torch.long)
    session.feed(zero)
    padded = session.step().clone()
    assert not torch.allclose(first, padded)
    session.rewind(16)
    torch.testing.assert_close(session.step(zero), padded)
    with pytest.raises(ValueError, match="3 token ids"):
        session.feed(torch.zeros(2, dtype=torch.long))


def test_rewind_and_time_step_time_the_same_context_again():
    session = Decoder(tiny_model("llama")).session
    fill_random(session, 16, capacity=32)
    ms = time_step(session, calls=4, reps=2, warmup=1)
    assert ms > 0 and int(session.cache.length) == 20  # the last rep started again from 16
    session.rewind(16)
    assert int(session.cache.length) == 16
    with pytest.raises(ValueError, match="no room for 40 steps"):
        time_step(session, calls=40)


def test_time_step_without_rewind_takes_consecutive_steps():
    session = Decoder(tiny_model("llama")).session
    fill_random(session, 16, capacity=32)
    assert time_step(session, calls=4, reps=2, warmup=1, rewind=False) > 0
    assert int(session.cache.length) == 16 + 1 + 4 * 2  # warm-up, then every rep after the last
    with pytest.raises(ValueError, match="no room for 9 steps"):
        time_step(session, calls=4, reps=2, warmup=1, rewind=False)


def test_audit_records_steps_in_its_block_only_and_restores_the_previous_recorder():
    model = tiny_model("llama")
    ids, mask = padded_batch(1, 20)
    session = Decoder(model, kv=Window(sinks=1, window=4)).session
    session.choose(session.prefill(ids, mask, capacity=26)[:, -1])
    with session.audit() as audit:
        session.step()
        session.step()
    session.step()
    assert isinstance(audit, Audit) and len(audit.dropped_mass[0]) == 2 and session.switch.recorder is None
    assert audit.mean("dropped_mass") > 0  # a window of 5 tokens drops mass


def test_redo_dense_rewrites_the_slot_with_the_dense_pass():
    model = tiny_model("llama")
    ids, mask = padded_batch(2, 18)
    sparse = Decoder(copy.deepcopy(model), kv=Window(sinks=1, window=2)).session
    dense = Decoder(model).session
    token = torch.tensor([7, 8])
    for s in (sparse, dense):
        s.prefill(ids, mask, capacity=20)
    want = dense.step(token)
    sparse.step(token)
    torch.testing.assert_close(sparse.redo_dense(token), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sparse.cache.keys[1], dense.cache.keys[1])  # the dense pass's keys replaced the sparse ones


def test_settings_and_misuse_fail_clearly():
    session = Decoder(tiny_model("llama"), kv=Quest(0.5, page=4)).session
    assert session.available_settings() == ("dense", "kv") and session.setting == "kv"
    with pytest.raises(ValueError, match="setting must be one of dense, kv"):
        session.use("proj")
    with pytest.raises(RuntimeError, match="call prefill"):
        session.step()
    with pytest.raises(ValueError, match="batch must be a positive int"):
        session.reserve(0, 8)
    with pytest.raises(ValueError, match="cuda_graphs=True needs a model on a CUDA device"):
        session.compile(cuda_graphs=True)


def test_a_larger_request_replaces_the_cache_and_frees_the_old_one_at_once():
    session = Decoder(tiny_model("llama")).session
    small = session.reserve(1, 16)
    assert session.reserve(1, 10) is small  # it fits
    keys = weakref.ref(small.keys[0])
    del small
    session.reserve(1, 64)
    assert keys() is None


def test_a_compiled_session_steps_like_an_eager_one_without_recompiling():
    from torch._dynamo.utils import counters

    model = tiny_model("mistral", layers=1)
    ids, mask = padded_batch(2, 11)
    eager = Decoder(copy.deepcopy(model), kv=Quest(0.5, page=4)).session
    torch._dynamo.reset()
    counters.clear()
    dec = Decoder(model, kv=Quest(0.5, page=4), compile=True)
    compiled = dec.session
    for s in (eager, compiled):
        s.choose(s.prefill(ids, mask, capacity=20)[:, -1])
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(6):
            torch.testing.assert_close(compiled.step(), eager.step(), atol=1e-5, rtol=1e-5)
            assert torch.equal(compiled.last_token, eager.last_token)
    assert compiled.compiled and counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("kv", [None, Quest(0.5, page=4, window=4)], ids=["dense", "quest"])
def test_a_long_prompt_prefilled_in_chunks_leaves_what_one_forward_leaves(monkeypatch, kv):
    from policyzoo import session as session_mod

    model = tiny_model("qwen3")
    ids = torch.randint(1, 128, (2, 45), generator=torch.Generator().manual_seed(0))
    whole = Decoder(copy.deepcopy(model), kv=copy.deepcopy(kv)).session
    want = whole.prefill(ids, capacity=60, keep_logits=3)
    monkeypatch.setattr(session_mod, "PREFILL_TOKENS", 2 * 16)  # chunks of 16 positions for 2 rows
    chunked = Decoder(model, kv=kv).session
    assert chunked._prefill_chunk(2, 45, 3, padded=False) == 16
    assert chunked._prefill_chunk(2, 45, 3, padded=True) == 45  # padding: one forward
    got = chunked.prefill(ids, capacity=60, keep_logits=3)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    names = ("keys", "values") + (("page_min", "page_max") if kv is not None else ())
    for name in names:
        for layer in range(2):
            torch.testing.assert_close(getattr(chunked.cache, name)[layer], getattr(whole.cache, name)[layer], atol=1e-5, rtol=1e-5)
    assert int(chunked.cache.length) == chunked.prompt_slot(45) + 45
    token = torch.tensor([3, 4])
    torch.testing.assert_close(chunked.step(token), whole.step(token), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_thousands_of_compiled_steps_keep_memory_flat_and_never_recompile():
    """A long generation must not grow: no tensor or Python object kept per step, no recompiles
    (Quest, CPU). 3,000 measured steps: a leak of 0.5 KB a step (one small tensor) shows in the
    resident memory, one object a step in the object count."""
    import gc

    from torch._dynamo.utils import counters

    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    model = tiny_model("llama", layers=1)
    model.config.max_position_embeddings = 8192  # rotary positions are computed per step: any length runs
    torch._dynamo.reset()
    counters.clear()
    dec = Decoder(model, kv=Quest(0.1, page=16, window=16), compile=True)
    session = dec.session
    ids = torch.randint(1, 128, (1, 64), generator=torch.Generator().manual_seed(0))
    session.choose(session.prefill(ids, capacity=64 + 6_000)[:, -1])
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3_000):  # compile and settle the allocator
            session.step()
        gc.collect()
        objects = len(gc.get_objects())  # counted before the memory is read: the list of them is megabytes
        before = rss_mb()
        for _ in range(3_000):
            session.step()
        gc.collect()
        grown = rss_mb() - before
        more = len(gc.get_objects()) - objects
    assert int(session.cache.length) == 64 + 6_000 and int(session.contexts.index) == 6_000
    assert counters["stats"]["unique_graphs"] == 1
    assert grown < 1.5, f"resident memory grew by {grown:.1f} MB over 3,000 steps"
    assert more < 300, f"{more} more Python objects after 3,000 steps"




def test_the_policy_list_covers_every_registered_policy():
    from policyzoo.spec import KV_POLICIES

    names = {"dense", "window", "attn-topk", "quest", "ssa", "entmax-kv", "prhs", "certified", "forecast", "community-kv"}
    assert set(KV_POLICIES) == names, "a new policy must join BUILTIN_POLICIES (and the batch-invariance test)"


@pytest.mark.parametrize("name", list(BUILTIN_POLICIES))
@settings(max_examples=6, deadline=None)
@given(lengths=st.lists(st.integers(3, 40), min_size=2, max_size=3), seed=st.integers(0, 2**16))
@example(lengths=[19, 14], seed=48)  # CommunityKV's join candidates once followed the batch's table width
@example(lengths=[5, 25, 18], seed=23678)  # an fp32 near-tie: SSA's sketch choice flipped at batch 3
def test_a_row_decodes_the_same_in_a_padded_batch_as_alone(name, lengths, seed):
    """A row's tokens do not depend on its batchmates: page policies included, whatever the left
    padding (the prompt ends on a page boundary, `DecodeSession.prompt_slot`; SSA's uniforms are
    named by head and place in the row).

    In float64: a matrix product of 3 rows rounds differently from one of 1, and in float32 that
    noise (about 1e-7) can flip a discrete choice that is a near-tie, which says nothing about
    the batch."""
    model = tiny_model("llama").double()
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(1, 128, (n,), generator=g) for n in lengths]
    t = max(lengths)
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, t - len(row) :], mask[i, t - len(row) :] = row, 1
    batch = Decoder(model, kv=BUILTIN_POLICIES[name]()).generate(ids, 6, attention_mask=mask)
    for i, row in enumerate(rows):
        alone = Decoder(model, kv=BUILTIN_POLICIES[name]()).generate(row[None], 6)
        assert torch.equal(batch[i, t:], alone[0, len(row) :]), f"row {i} ({len(row)} tokens) differs from itself alone"


@pytest.mark.parametrize("name", [n for n in BUILTIN_POLICIES if n != "dense"])
def test_a_layers_predicted_selection_is_the_one_it_makes(name):
    """`KVSelector.predicts_layer` / `next_layer_selection`, the contract an offloaded layer's prefetch
    relies on: where a policy predicts layer l+1, layer l hands over exactly the entries layer l+1 then
    attends to; elsewhere it hands over nothing."""
    policy = BUILTIN_POLICIES[name]()
    made, ahead = {}, {}
    select = policy.select

    def recording_select(state, q):
        sel = select(state, q)
        key = (int(state.context.index), state.layer)
        made[key] = sel
        if state.layer + 1 == state.cache.num_layers:
            return sel
        nxt = policy.next_layer_selection(state, sel)
        assert (nxt is not None) == policy.predicts_layer(state.layer + 1)
        if nxt is not None:
            ahead[key[0], state.layer + 1] = nxt
        return sel

    policy.select = recording_select
    ids, mask = padded_batch(2, 30, seed=4)
    Decoder(tiny_model("llama"), kv=policy).generate(ids, 5, attention_mask=mask)
    assert not policy.predicts_layer(0)
    for key, nxt in ahead.items():
        sel = made[key]
        assert nxt.block == sel.block and torch.equal(nxt.count, sel.count)
        keep = torch.arange(sel.k_max) < sel.count[..., None]
        assert torch.equal(nxt.indices[keep], sel.indices[keep])
    if name in ("forecast", "prhs"):  # the two that predict (PrHS: its second layer shares the first's)
        assert ahead


def test_bad_session_arguments_name_themselves():
    session = Decoder(tiny_model("llama")).session
    ids = torch.randint(1, 128, (2, 5))
    for kwargs, match in (({"capacity": "x"}, "capacity"), ({"capacity": 0}, "capacity"), ({"keep_logits": 1.5}, "keep_logits"),
                          ({"keep_logits": 6}, "keep_logits")):  # fmt: skip
        with pytest.raises((ValueError, TypeError), match=match):
            session.prefill(ids, **kwargs)
    with pytest.raises(ValueError, match="input_ids"):
        session.prefill(torch.ones(0, 3, dtype=torch.long))
    logits = session.prefill(ids, capacity=12)
    with pytest.raises(ValueError, match="logits"):
        session.choose(None)
    with pytest.raises(ValueError, match="tokens"):
        session.step([1, 2])
    with pytest.raises(ValueError, match="tokens"):
        session.step(torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="eos_token_id"):
        session.sample(eos_token_id="x")
    session.sample(eos_token_id=3)  # one id, or a list of them
    session.choose(logits[:, -1])
    assert session.step().shape == (2, 128)


def test_recorded_graphs_are_dropped_when_a_request_remakes_the_policys_tensors():
    """A CUDA graph reads the store's tensors where they were when it was recorded: a request whose
    policy made new ones (CommunityKV remakes its layout) drops the graphs; one that keeps them
    (a policy with no store) keeps them."""
    from policyzoo.compiled import policy_state_layout

    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch(2, 30)
    for policy, kept in ((CommunityKV(0.3, sinks=2, window=2), False), (Quest(0.3, page=4), True)):
        session = Decoder(copy.deepcopy(model), kv=policy).compile(backend="eager").session
        session.choose(session.prefill(ids, mask, capacity=40)[:, -1])
        session.step()
        before = policy_state_layout(session.backends, session.contexts)
        for entry in session.compiled_steps._steps.values():
            entry.graph = ("recorded", None)  # as a CUDA capture leaves it
        session.prefill(ids, mask, capacity=40)
        assert (policy_state_layout(session.backends, session.contexts) == before) == kept
        assert (session.compiled_steps.graphs == 1) == kept


def test_a_capacity_under_the_prompt_or_a_full_cache_is_a_clear_error():
    session = Decoder(tiny_model("llama")).session
    ids = torch.randint(1, 128, (1, 20))
    with pytest.raises(ValueError, match=r"capacity \(10\) must hold the prompt's 20 tokens"):
        session.prefill(ids, capacity=10)
    session.choose(session.prefill(ids, capacity=21)[:, -1])  # room for 21 - 20 + page slack
    room = session.cache.capacity - int(session.cache.length)
    for _ in range(room):
        session.step()
    with pytest.raises(RuntimeError, match="the cache is full"):
        session.step()
    session.rewind(int(session.cache.length) - 1)
    session.step()  # a rewound cache has room again


def test_a_decoder_taking_the_model_over_retires_the_previous_session():
    """Its cache, graphs and compiled steps go when the new Decoder is built, not when the cycle
    collector finds them."""
    model = tiny_model("llama")
    old = Decoder(model, kv=Quest(0.5, page=4)).compile(backend="eager")
    old.generate(torch.randint(1, 128, (1, 12)), 3)
    assert old.session.cache is not None and old.session.compiled
    Decoder(model)
    assert old.session.cache is None and not old.session.compiled
    with pytest.raises(RuntimeError, match="no longer drives its model"):
        old.generate(torch.randint(1, 128, (1, 12)), 3)

"""Contract tests of `policyzoo.offload`: some layers' keys and values in pinned host memory.

What offload promises: `Offload` names the layers clearly or refuses with the argument named; the
cache puts exactly those layers' keys and values in host memory and keeps their summaries on the
device; decoding with offload gives exactly the tokens of decoding without (eager and compiled), since
the kernels read the same values where they lie; the byte account counts what crosses the host link.
On CUDA (the device machine) the offloaded tensors are CUDA tensors over pinned host memory that take
no device memory; on a CPU device they are plain tensors (a CPU cache is in host memory already).

A page cache (`Offload(cache=...)`, `PageCache`) changes where pages are read, never what: every
selected entry's slot holds the page's current values, a page is kept only once it can no longer
change, a repeated selection is served from the device without fetching, and a rewind forgets the
pages it makes stale. A prefetch (the next layer's predicted selection, staged ahead) changes when
pages cross the link, never what the lookup reads: a right prediction is found at the lookup, a
wrong one costs fetches only, and each page is counted once as looked up.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import Tensor
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import padded_batch, tiny_model

from policyzoo import Decoder, Offload, PagedKVCache, Quest
from policyzoo.kv import Forecast, PrHS
from policyzoo.bytes import ByteAccount
from policyzoo.offload import PageCache, host_tensor
from policyzoo.selection import Selection

CUDA = torch.cuda.is_available()


@functools.cache
def llama(layers: int = 3):
    return tiny_model("llama", layers=layers)


FORECAST = dict(block=16, kernel=16, stride=4, sinks=4, window=4)  # Forecast's geometry at the tiny model's scale


# ------------------------------------------------------------------------------------ Offload
@given(layers=st.integers(1, 12), total=st.integers(1, 12))
def test_an_int_offloads_the_last_layers(layers, total):
    if layers > total:
        with pytest.raises(ValueError, match="layers"):
            Offload(layers).host_layers(total)
    else:
        assert Offload(layers).host_layers(total) == frozenset(range(total - layers, total))


def test_a_tuple_names_the_layers_and_is_kept_sorted():
    assert Offload((3, 1)).layers == (1, 3)
    assert Offload((3, 1)).host_layers(4) == frozenset({1, 3})
    with pytest.raises(ValueError, match="layer 3"):
        Offload((3,)).host_layers(3)


@pytest.mark.parametrize("layers, exc", [(0, ValueError), (-2, ValueError), (True, TypeError), ((), TypeError),
                                         ((1, 1), ValueError), ((-1,), ValueError), ((1.5,), TypeError), ("2", TypeError),
                                         (None, TypeError)])
def test_bad_layers_are_refused_by_name(layers, exc):
    with pytest.raises(exc, match="layers|layer indices"):
        Offload(layers)


def test_prefetch_off_fetches_at_the_lookup_only(monkeypatch):
    monkeypatch.setattr(PageCache, "prefetch", lambda *a, **kw: pytest.fail("prefetched with prefetch=False"))
    ids, mask = padded_batch(2, 150, seed=1)
    want = Decoder(llama(), kv=Forecast(0.3, **FORECAST)).generate(ids, 6, attention_mask=mask)
    dec = Decoder(llama(), kv=Forecast(0.3, **FORECAST), offload=Offload(2, cache=0.7, prefetch=False))
    assert torch.equal(dec.generate(ids, 6, attention_mask=mask), want)
    with pytest.raises(TypeError, match="prefetch"):
        Offload(2, prefetch=1)


@pytest.mark.parametrize("cache", [-0.1, 1.5, True, "0.1", None])
def test_a_bad_page_cache_share_is_refused_by_name(cache):
    with pytest.raises(ValueError, match="cache"):
        Offload(2, cache=cache)


@given(share=st.floats(0.0, 1.0), pages=st.integers(1, 10_000))
def test_the_page_cache_takes_its_share_of_the_pages_rounded_up(share, pages):
    slots = Offload(1, cache=share).cache_slots(pages)
    assert slots == 0 if share == 0 else slots - 1 < pages * share <= slots


def test_decoder_refuses_what_is_not_an_offload():
    with pytest.raises(TypeError, match="offload"):
        Decoder(llama(), offload=2)


# ------------------------------------------------------------------------------------ the cache
def test_the_cache_puts_the_named_layers_in_host_memory_and_keeps_their_summaries():
    device = "cuda" if CUDA else "cpu"
    cache = PagedKVCache(3, 1, 2, 16, 64, page_size=16, dtype=torch.float32, device=device, host_layers={2})
    assert cache.host_layers == frozenset({2})
    for layer in range(3):
        assert cache.keys[layer].device.type == cache.values[layer].device.type == torch.device(device).type
        assert cache.page_min[layer].shape == (1, 2, 4, 16)
    with pytest.raises(ValueError, match="host_layers"):
        PagedKVCache(3, 1, 2, 16, 64, host_layers={3})


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), layers=st.sampled_from([1, 2, (0,), (0, 2)]), kv=st.sampled_from(["quest", "dense"]),
       cache=st.sampled_from([0.0, 0.7]))
def test_offloaded_decoding_gives_the_tokens_of_decoding_without(seed, layers, kv, cache):
    ids, mask = padded_batch(2, 37, seed=seed)
    make = (lambda: Quest(0.3, page=4, sinks=2, window=4)) if kv == "quest" else (lambda: None)
    want = Decoder(llama(), kv=make()).generate(ids, 12, attention_mask=mask)
    dec = Decoder(llama(), kv=make(), offload=Offload(layers, cache=cache))
    got = dec.generate(ids, 12, attention_mask=mask)
    assert torch.equal(got, want)
    assert dec.session.cache.host_layers == Offload(layers).host_layers(3)
    hits, lookups, _ = dec.session.cache.page_cache_counts()
    if cache and kv == "quest":  # later steps find the pages earlier ones fetched; a dense pass reads in place
        assert 0 < hits < lookups
    else:
        assert hits == lookups == 0


@pytest.mark.parametrize("cache", [0.0, 0.7])
def test_offloaded_compiled_decoding_gives_the_eager_tokens(cache):
    ids, mask = padded_batch(2, 45, seed=3)
    want = Decoder(llama(), kv=Quest(0.3, page=4, sinks=2, window=4)).generate(ids, 10, attention_mask=mask)
    dec = Decoder(llama(), kv=Quest(0.3, page=4, sinks=2, window=4), offload=Offload(1, cache=cache)).compile()
    assert torch.equal(dec.generate(ids, 10, attention_mask=mask), want)
    assert (dec.session.cache.page_cache_counts()[0] > 0) == bool(cache)  # the compiled step used the page cache


@pytest.mark.parametrize("kv", ["forecast", "prhs"])
def test_a_policy_that_predicts_the_next_layer_has_its_pages_fetched_ahead(kv, monkeypatch):
    """`Forecast` (layer l's head chooses layer l+1's blocks) and `PrHS` sharing a selection between
    layers: the offloaded layers' pages are prefetched by the layer below at every step, the tokens are
    those of decoding without offload, and the lookups find all but the growing pages."""
    ids, mask = padded_batch(2, 150, seed=1)
    if kv == "forecast":
        make, predicted = (lambda: Forecast(0.3, **FORECAST)), {1, 2}
    else:
        make, predicted = (lambda: PrHS(Quest(0.3, page=4, sinks=2, window=4), layer=(0, 1, 1))), {2}
    want = Decoder(llama(), kv=make()).generate(ids, 12, attention_mask=mask)
    calls = []
    prefetch = PageCache.prefetch
    monkeypatch.setattr(PageCache, "prefetch", lambda self, *a, **kw: calls.append(self) or prefetch(self, *a, **kw))
    dec = Decoder(llama(), kv=make(), offload=Offload(2, cache=0.7))
    assert torch.equal(dec.generate(ids, 12, attention_mask=mask), want)
    cache = dec.session.cache
    steps = 11  # the first token comes from the prefill
    assert [id(c) for c in calls] == [id(cache.page_cache(layer)) for _ in range(steps) for layer in sorted(predicted)]
    growing = steps * 2 * llama().config.num_key_value_heads  # one page per step, row and head
    for layer in predicted:
        pc = cache.page_cache(layer)
        assert int(pc.lookups) - int(pc.hits) <= growing < int(pc.lookups)
        assert 0 < pc.hit_rate() < 1  # the link still carries the prefetched pages


def test_a_compiled_step_prefetches_as_the_eager_one():
    """The prefetch and its wait are custom ops that mutate the page cache: the compile keeps both
    (AOTAutograd's functionalization is where a mutation could be dropped; ``aot_eager`` keeps the
    test short, and the CUDA run of the sweep compiles them with Inductor under a CUDA graph)."""
    ids, mask = padded_batch(2, 150, seed=1)
    eager = Decoder(llama(), kv=Forecast(0.3, **FORECAST), offload=Offload(2, cache=0.7))
    want = eager.generate(ids, 12, attention_mask=mask)
    counts = eager.session.cache.page_cache_counts()
    dec = Decoder(llama(), kv=Forecast(0.3, **FORECAST), offload=Offload(2, cache=0.7)).compile(backend="aot_eager")
    assert torch.equal(dec.generate(ids, 12, attention_mask=mask), want)
    assert dec.session.cache.page_cache_counts() == counts  # the prefetches ran in the compiled step


def test_a_selection_wider_than_the_page_cache_is_refused_with_the_share_it_needs():
    ids, mask = padded_batch(1, 45, seed=1)
    dec = Decoder(llama(), kv=Quest(0.5, page=4, sinks=2, window=4), offload=Offload(1, cache=0.1))
    with pytest.raises(ValueError, match=r"Offload\(cache=\.\.\.\)"):
        dec.generate(ids, 2, attention_mask=mask)


# ------------------------------------------------------------------------------------ page cache
PAGE, PAGES = 4, 12


def host_layer(seed: int, b: int = 2, h: int = 2, d: int = 8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, PAGES * PAGE, d, generator=g), torch.randn(b, h, PAGES * PAGE, d, generator=g)


def random_selection(draw, b: int, h: int, k_max: int) -> Selection:
    """Distinct pages per (row, head), ``count`` of them real and the rest garbage."""
    rows = [draw(st.permutations(range(PAGES)))[:k_max] for _ in range(b * h)]
    count = torch.tensor([draw(st.integers(0, k_max)) for _ in range(b * h)], dtype=torch.int32).view(b, h)
    idx = torch.tensor(rows, dtype=torch.int32).view(b, h, k_max)
    garbage = torch.full_like(idx, 10**6)
    return Selection(torch.where(torch.arange(k_max) < count[..., None], idx, garbage), count, block=PAGE)


def slot_rows(pc: PageCache, slots: Tensor, b: int, h: int, e: int) -> slice:
    first = int(slots[b, h, e]) * pc.page_size
    return slice(first, first + pc.page_size)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), slots=st.integers(5, 12), steps=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_every_staged_entry_reads_its_page_and_the_maps_stay_inverse(data, slots, steps, seed):
    b, h, k_max = 2, 2, 5
    keys, values = host_layer(seed)
    pc = PageCache(b, h, keys.shape[-1], PAGES, slots, PAGE, keys.dtype, "cpu")
    hits = lookups = 0
    length = data.draw(st.integers(1, PAGES * PAGE))
    for _ in range(steps):
        length = min(PAGES * PAGE, length + data.draw(st.integers(0, 2 * PAGE)))  # a sequence only grows
        sel = random_selection(data.draw, b, h, k_max)
        mapped_before = pc.page_slot.clone()
        got = pc.stage(sel, keys, values, torch.tensor(length))
        for i, j, e in sel.entry_valid().nonzero().tolist():
            page = int(sel.indices[i, j, e])
            if page * PAGE >= length:  # no token there yet: nothing to read, nothing looked up
                continue
            rows = slot_rows(pc, got, i, j, e)
            assert torch.equal(pc.keys[i, j, rows], keys[i, j, page * PAGE : (page + 1) * PAGE])
            assert torch.equal(pc.values[i, j, rows], values[i, j, page * PAGE : (page + 1) * PAGE])
            hits += int(mapped_before[i, j, page] >= 0)
            lookups += 1
        for i in range(b):
            for j in range(h):
                kept = (pc.page_slot[i, j, :PAGES] >= 0).nonzero().flatten().tolist()
                for page in kept:  # a kept page can no longer change: complete before this step's token
                    assert (page + 1) * PAGE <= length - 1
                    assert int(pc.slot_page[i, j, int(pc.page_slot[i, j, page])]) == page
                assert len(kept) <= slots
    assert (int(pc.hits), int(pc.lookups)) == (hits, lookups)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**16), right=st.booleans())
def test_a_prefetch_is_found_at_the_lookup_and_never_changes_what_it_reads(data, seed, right):
    """A prefetch stages the complete pages of a selection (a growing page would be stale); the lookup
    after a prefetch of the same selection finds them all on the device; after a wrong prediction it
    reads the right pages all the same. Lookups count the lookup's pages once; the
    link's share (`hit_rate`) counts every page fetched, ahead or not."""
    b, h, k_max = 2, 2, 5
    keys, values = host_layer(seed)
    pc = PageCache(b, h, keys.shape[-1], PAGES, 2 * k_max, PAGE, keys.dtype, "cpu")
    length = torch.tensor(data.draw(st.integers(1, PAGES * PAGE)))
    predicted = random_selection(data.draw, b, h, k_max)
    sel = predicted if right else random_selection(data.draw, b, h, k_max)
    pc.prefetch(predicted, keys, values, length)
    ready = predicted.entry_valid() & ((predicted.indices.long() + 1) * PAGE <= length - 1)  # complete pages only
    assert int(pc.lookups) == 0 and int(pc.fetched) == int(ready.sum())
    fetched_ahead = int(pc.fetched)
    pc.wait_for_prefetch(keys)
    got = pc.stage(sel, keys, values, length)
    looked = sel.entry_valid() & (sel.indices * PAGE < length)
    for i, j, e in looked.nonzero().tolist():
        page = int(sel.indices[i, j, e])
        rows = slot_rows(pc, got, i, j, e)
        assert torch.equal(pc.keys[i, j, rows], keys[i, j, page * PAGE : (page + 1) * PAGE])
        assert torch.equal(pc.values[i, j, rows], values[i, j, page * PAGE : (page + 1) * PAGE])
    complete = looked & ((sel.indices.long() + 1) * PAGE <= length - 1)
    assert int(pc.lookups) == int(looked.sum())
    if right:  # only the growing page is fetched again
        assert int(pc.hits) == int(complete.sum())
        assert int(pc.fetched) - fetched_ahead == int((looked & ~complete).sum())
    if int(pc.lookups):
        assert pc.hit_rate() == 1 - int(pc.fetched) / int(pc.lookups)


def test_a_repeated_selection_of_complete_pages_is_served_from_the_device():
    keys, values = host_layer(0)
    pc = PageCache(2, 2, keys.shape[-1], PAGES, 6, PAGE, keys.dtype, "cpu")
    sel = Selection(torch.tensor([0, 3, 5], dtype=torch.int32).expand(2, 2, 3).contiguous(), torch.full((2, 2), 3, dtype=torch.int32), block=PAGE)
    length = torch.tensor(PAGES * PAGE)
    first = pc.stage(sel, keys, values, length)
    slots = slice(0, pc.slots * PAGE)  # the scratch slot after them takes the fetch list's padding
    copied = pc.keys[:, :, slots].clone()
    keys.add_(1.0)  # a fetch now would bring other values in
    again = pc.stage(sel, keys, values, length)
    assert torch.equal(again, first) and torch.equal(pc.keys[:, :, slots], copied)
    assert (int(pc.hits), int(pc.lookups)) == (12, 24) and pc.hit_rate() == 0.5


def test_the_growing_page_is_fetched_again_at_every_step():
    keys, values = host_layer(1)
    pc = PageCache(2, 2, keys.shape[-1], PAGES, 6, PAGE, keys.dtype, "cpu")
    sel = Selection(torch.tensor([2], dtype=torch.int32).expand(2, 2, 1).contiguous(), torch.ones(2, 2, dtype=torch.int32), block=PAGE)
    for length in (2 * PAGE + 1, 3 * PAGE):  # page 2 holds the newest token: it still grows
        slots = pc.stage(sel, keys, values, torch.tensor(length))
        keys[:, :, length - 1] += 1.0  # the step's token, written again (as a redone step would)
        assert int(pc.hits) == 0
    pc.stage(sel, keys, values, torch.tensor(3 * PAGE + 1))  # complete before this step's token: kept now
    slots = pc.stage(sel, keys, values, torch.tensor(3 * PAGE + 2))
    assert int(pc.hits) == 4
    assert torch.equal(pc.keys[0, 0, slot_rows(pc, slots, 0, 0, 0)], keys[0, 0, 2 * PAGE : 3 * PAGE])


def test_a_rewind_forgets_the_pages_it_makes_stale_and_keeps_the_rest():
    cache = PagedKVCache(1, 1, 1, 8, PAGES * PAGE, page_size=PAGE, host_layers={0}, cache_slots=PAGES)
    keys, values = cache.keys[0], cache.values[0]
    keys.normal_()
    pc = cache.page_cache(0)
    sel = Selection(torch.arange(PAGES, dtype=torch.int32).view(1, 1, PAGES), torch.full((1, 1), PAGES, dtype=torch.int32), block=PAGE)
    cache.length.fill_(PAGES * PAGE)
    pc.stage(sel, keys, values, cache.length)
    assert (pc.page_slot[0, 0, :PAGES] >= 0).sum() == PAGES - 1  # every page complete but the last
    cache.rewind(5 * PAGE + 1)  # slots from 5·PAGE + 1 on will be written again: page 5 on is stale
    assert (pc.page_slot[0, 0, :5] >= 0).all() and (pc.page_slot[0, 0, 5:] == -1).all()
    assert int((pc.slot_page[0, 0, :PAGES] < PAGES).sum()) == 5
    with pytest.raises(ValueError, match="length"):
        cache.rewind(PAGES * PAGE + 1)


def test_a_new_request_clears_the_page_caches():
    cache = PagedKVCache(2, 1, 1, 8, PAGES * PAGE, page_size=PAGE, host_layers={1}, cache_slots=3)
    assert set(cache.page_caches) == {1} and cache.page_cache(0) is None
    pc = cache.page_cache(1)
    pc.page_slot.fill_(0)
    pc.hits.fill_(3)
    cache.reset(torch.zeros(1, dtype=torch.long), 5)
    assert (pc.page_slot == -1).all() and int(pc.hits) == 0 and math.isnan(cache.page_cache_hit_rate())


# ------------------------------------------------------------------------------------ host memory
def test_host_tensor_off_cuda_is_a_plain_zero_tensor():
    t = host_tensor((2, 3), torch.bfloat16, torch.device("cpu"))
    assert t.dtype == torch.bfloat16 and t.device.type == "cpu" and not t.any()


@pytest.mark.skipif(not CUDA, reason="pinned host memory read in place by a GPU: the device machine runs it")
def test_host_tensor_on_cuda_is_a_cuda_tensor_over_pinned_memory():
    before = torch.cuda.memory_allocated()
    t = host_tensor((4, 1 << 20), torch.bfloat16, torch.device("cuda"))  # 8 MiB
    assert t.device.type == "cuda" and t.dtype == torch.bfloat16 and not t.any()
    assert torch.cuda.memory_allocated() - before < 1 << 20  # none of it on the device
    t.fill_(2.0)
    import gc

    gc.collect()  # the pinned buffer must live as long as the tensor
    assert float(t.float().sum()) == 2.0 * t.numel()


# ------------------------------------------------------------------------------------ bytes
def test_the_byte_account_counts_the_offloaded_layers_selected_kv_over_the_link():
    acct = ByteAccount.from_config(llama().config, dtype=torch.bfloat16)
    n, keep = 4096, 0.1
    per_layer = acct.kv_per_token * n * keep * acct.element_size
    assert acct.host_bytes(n, keep, host_layers=2) == pytest.approx(2 * per_layer)
    assert acct.host_bytes(n, keep, host_layers=0) == 0
    gpu, link = 4e12, 5e10
    floor = acct.offload_floor_ms(n, gpu, link, 2, r_kv=keep)
    total = acct.step_bytes(n, r_kv=keep)
    assert floor == pytest.approx(((total - 2 * per_layer) / gpu + 2 * per_layer / link) * 1e3)
    assert floor > acct.floor_ms(n, gpu, r_kv=keep)  # the link is slower than the device's memory
    with pytest.raises(ValueError, match="host_layers"):
        acct.host_bytes(n, keep, host_layers=acct.layers + 1)
    with pytest.raises(ValueError, match="bandwidth"):
        acct.offload_floor_ms(n, gpu, 0.0, 1)


def test_the_prefetch_ops_declare_what_they_mutate():
    """``policyzoo::prefetch_pages`` and ``policyzoo::wait_for_prefetch`` (`kernels.ops.prefetch`):
    schemas and fakes, with and without a workspace's stream (none off CUDA: staged inline)."""
    from policyzoo import kernels

    keys, values = host_layer(3)
    pc = PageCache(2, 2, keys.shape[-1], PAGES, 8, PAGE, keys.dtype, "cpu")
    sel = Selection(torch.tensor([[[0, 2], [1, 3]], [[4, 0], [2, 1]]], dtype=torch.int32),
                    torch.tensor([[2, 1], [1, 2]], dtype=torch.int32), block=PAGE)
    length = torch.tensor(PAGES * PAGE)
    checks = ("test_schema", "test_faketensor")
    stream = kernels.Workspace("cpu").prefetch_stream_ids or ()
    torch.library.opcheck(torch.ops.policyzoo.prefetch_pages.default,
                          (sel.indices, sel.count, keys, values, length, *pc._state(), PAGE, stream), test_utils=checks)
    torch.library.opcheck(torch.ops.policyzoo.wait_for_prefetch.default, (pc.page_slot, keys, stream), test_utils=checks)

"""Contract tests of `policyzoo.offload`: some layers' keys and values in pinned host memory.

What offload promises: `Offload` names the layers clearly or refuses with the argument named; the
cache puts exactly those layers' keys and values in host memory and keeps their summaries on the
device; decoding with offload gives exactly the tokens of decoding without (eager and compiled), since
the kernels read the same values where they lie; the byte account counts what crosses the host link.
On CUDA (the device machine) the offloaded tensors are CUDA tensors over pinned host memory that take
no device memory; on a CPU device they are plain tensors (a CPU cache is in host memory already).
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import padded_batch, tiny_model

from policyzoo import Decoder, Offload, PagedKVCache, Quest
from policyzoo.bytes import ByteAccount
from policyzoo.offload import host_tensor

CUDA = torch.cuda.is_available()


@functools.cache
def llama(layers: int = 3):
    return tiny_model("llama", layers=layers)


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
@given(seed=st.integers(0, 2**16), layers=st.sampled_from([1, 2, (0,), (0, 2)]), kv=st.sampled_from(["quest", "dense"]))
def test_offloaded_decoding_gives_the_tokens_of_decoding_without(seed, layers, kv):
    ids, mask = padded_batch(2, 37, seed=seed)
    make = (lambda: Quest(0.3, page=4, sinks=2, window=4)) if kv == "quest" else (lambda: None)
    want = Decoder(llama(), kv=make()).generate(ids, 8, attention_mask=mask)
    dec = Decoder(llama(), kv=make(), offload=Offload(layers))
    got = dec.generate(ids, 8, attention_mask=mask)
    assert torch.equal(got, want)
    assert dec.session.cache.host_layers == Offload(layers).host_layers(3)


def test_offloaded_compiled_decoding_gives_the_eager_tokens():
    ids, mask = padded_batch(2, 29, seed=3)
    want = Decoder(llama(), kv=Quest(0.3, page=4, sinks=2, window=4)).generate(ids, 6, attention_mask=mask)
    dec = Decoder(llama(), kv=Quest(0.3, page=4, sinks=2, window=4), offload=Offload(1)).compile()
    assert torch.equal(dec.generate(ids, 6, attention_mask=mask), want)


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

"""Models with sliding-window layers (issue 41): Mistral's window on every layer, Qwen2's windows from
``max_window_layers`` on, Gemma-2/3's local layers interleaved with global ones. Window layers keep a
ring of their window (O(window) per row) and attend to it exactly as the model does; the KV policy
runs on the full layers only; dense decoding equals the unwrapped model beyond the window."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from tiny_models import hybrid_model, padded_batch
from torch._dynamo.utils import counters

import policyzoo
from policyzoo import Decoder, EntmaxKV, Forecast, Offload, PrHS, Quest
from policyzoo import _compat
from policyzoo.bytes import ByteAccount
from policyzoo.cache import ring_slots
from policyzoo.kv.dense import Dense

WINDOW = 8
NEW = 12
FAMILIES = ("mistral", "qwen2", "qwen3", "gemma3", "gemma2")
# Each family's kinds of layer in the tiny models below (None: full attention).
KINDS = {
    "mistral": (WINDOW, WINDOW, WINDOW),
    "qwen2": (None, WINDOW, WINDOW),
    "qwen3": (None, WINDOW, WINDOW),
    "gemma3": (WINDOW, None, WINDOW),
    "gemma2": (WINDOW, None, WINDOW),
}


def hf_reference(model, ids, mask, new: int = NEW):
    """HF's own greedy tokens, and its full-forward logits at each new position."""
    seq = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
    full_mask = torch.cat([mask, torch.ones(ids.shape[0], new, dtype=mask.dtype)], dim=1)
    positions = (full_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(seq, attention_mask=full_mask, position_ids=positions).logits
    t = ids.shape[1]
    return seq, logits[:, t - 1 : t - 1 + new]


class Probe(Dense):
    """Dense attention that records the layers the session asks it about."""

    def __init__(self) -> None:
        super().__init__()
        self.prefilled: set[int] = set()
        self.selected: set[int] = set()
        self.finished: set[int] = set()

    def prefill(self, state, q, k, v):
        self.prefilled.add(state.layer)
        super().prefill(state, q, k, v)

    def finish_prefill(self, states):
        self.finished |= {state.layer for state in states}
        super().finish_prefill(states)

    def select(self, state, q):
        self.selected.add(state.layer)
        return super().select(state, q)


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_kinds_come_from_the_config(family):
    assert _compat.layer_windows(hybrid_model(family).config) == KINDS[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_dense_beyond_the_window_matches_the_unwrapped_model(family):
    model = hybrid_model(family)
    ids, mask = padded_batch(2, 21)  # row 1 left-padded; 21 + 12 tokens against a window of 8
    ref_seq, ref_logits = hf_reference(copy.deepcopy(model), ids, mask)
    dec = Decoder(model, page_size=4)
    seq, logits = dec.generate(ids, NEW, attention_mask=mask, output_logits=True)
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(logits, ref_logits, atol=2e-4, rtol=1e-4)
    cache = dec.session.cache
    assert cache.windows == {layer: WINDOW for layer, w in enumerate(KINDS[family]) if w is not None}


def test_the_reference_sees_the_window():
    """The comparison above is sharp: the same model without its window decodes differently."""
    model = hybrid_model("gemma3")
    wide = copy.deepcopy(model)
    wide.config.sliding_window = 4096
    ids, mask = padded_batch(2, 21)
    _, windowed = Decoder(model).generate(ids, 4, attention_mask=mask, output_logits=True)
    _, whole = hf_reference(wide, ids, mask, new=4)
    assert (windowed - whole).abs().max() > 1e-2


def test_chunked_prefill_reads_the_window_across_chunks(monkeypatch):
    model = hybrid_model("gemma3")
    ids = padded_batch(1, 37)[0]
    want = Decoder(copy.deepcopy(model), page_size=4).generate(ids, 6, output_logits=True)
    monkeypatch.setattr(policyzoo.session, "PREFILL_TOKENS", 4)  # chunks of 4 prompt tokens, half a window
    got = Decoder(model, page_size=4).generate(ids, 6, output_logits=True)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_the_policy_runs_on_the_full_layers_only(family):
    model = hybrid_model(family)
    probe = Probe()
    ids, mask = padded_batch(2, 21)
    dec = Decoder(model, kv=probe, page_size=4)
    dec.generate(ids, 5, attention_mask=mask, audit=True)
    full = {layer for layer, w in enumerate(KINDS[family]) if w is None}
    assert probe.selected == full and probe.finished == full
    assert dec.last_audit.per_layer("kv_keep").shape[0] == len(full)  # the audit records the policy's layers


def test_short_contexts_run_the_policy_on_every_layer():
    """A window that covers the whole cache never binds: the layer is a full one, as before."""
    probe = Probe()
    dec = Decoder(hybrid_model("gemma3", window=64), kv=probe, page_size=4)
    dec.generate(padded_batch(1, 20)[0], 4)
    assert dec.session.cache.windows == {} and probe.selected == {0, 1, 2}


def test_a_full_budget_policy_reproduces_dense_and_a_sparse_one_differs():
    model = hybrid_model("gemma3")
    ids, mask = padded_batch(2, 40)
    dense = Decoder(copy.deepcopy(model), page_size=4).generate(ids, NEW, attention_mask=mask, output_logits=True)
    full = Decoder(copy.deepcopy(model), kv=Quest(1.0, page=4)).generate(ids, NEW, attention_mask=mask, output_logits=True)
    assert torch.equal(full[0], dense[0])
    torch.testing.assert_close(full[1], dense[1], atol=1e-5, rtol=1e-5)
    sparse = Decoder(model, kv=Quest(4, page=4, sinks=0, window=0)).generate(ids, NEW, attention_mask=mask, output_logits=True)
    assert (sparse[1] - dense[1]).abs().max() > 1e-3


def test_window_layers_keep_a_ring_of_their_window_and_no_summaries():
    dec = Decoder(hybrid_model("gemma3"), kv=Quest(0.3, page=4, bound="sketch"))
    ids, mask = padded_batch(2, 300)
    dec.generate(ids, 4, attention_mask=mask)
    cache = dec.session.cache
    ring = ring_slots(WINDOW, 4)
    assert ring == 12 and cache.capacity >= 304
    for layer in (0, 2):
        assert cache.keys[layer].shape == cache.values[layer].shape == (2, 2, ring, 16)
        assert all(getattr(cache, name)[layer] is None for name in cache.summaries)
    assert cache.keys[1].shape[2] == cache.capacity and cache.page_min[1].shape[2] == cache.num_pages
    assert all(t.shape[2] in (ring, cache.capacity, cache.num_pages) for t in cache.tensors() if t.dim() == 4)


@pytest.mark.parametrize("regional, backend", [(True, "aot_eager"), (False, "eager")])
def test_compiled_steps_equal_eager(regional, backend):
    """Regional compilation compiles one layer per kind (two graphs), the whole step one graph."""
    model = hybrid_model("gemma3")
    ids, mask = padded_batch(2, 21)
    eager = Decoder(copy.deepcopy(model), kv=Quest(0.5, page=4)).generate(ids, 6, attention_mask=mask)
    torch._dynamo.reset()
    counters.clear()
    dec = Decoder(model, kv=Quest(0.5, page=4)).compile(backend=backend, regional=regional)
    assert dec.session.compiled_steps.regional == regional
    assert torch.equal(dec.generate(ids, 6, attention_mask=mask), eager)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(dec.generate(ids, 6, attention_mask=mask), eager)  # the same cache: no recompile
    assert counters["stats"]["unique_graphs"] == (2 if regional else 1)


@pytest.mark.filterwarnings("ignore:every layer of the model is a sliding-window layer")
@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma3"])
def test_apply_inside_hf_generate_equals_decoder_generate(family):
    model = hybrid_model(family)
    ids, mask = padded_batch(2, 21)
    kv = lambda: Quest(0.5, page=4, sinks=2, window=2)  # noqa: E731
    want = Decoder(copy.deepcopy(model), kv=kv()).generate(ids, 8, attention_mask=mask, eos_token_id=[])
    with policyzoo.apply(model, kv=kv()) as dec:
        got = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        windows = dec.session.cache.windows
    assert torch.equal(got, want)
    assert set(windows) == {layer for layer, w in enumerate(KINDS[family]) if w is not None}


def test_a_prefix_loaded_elsewhere_keeps_its_window_and_rewinds_within_the_ring():
    """`load_prefix` (the benchmarks' fill) keeps each window layer's last ring slots; a step then
    decodes; a rewind within the ring's slack works, one beyond it is refused."""
    dec = Decoder(hybrid_model("gemma3"), page_size=4)
    session = dec.session
    g = torch.Generator().manual_seed(0)
    prefix = [tuple(torch.randn(1, 2, 30, 16, generator=g) for _ in range(2)) for _ in range(3)]
    session.load_prefix(prefix, torch.zeros(1, dtype=torch.long), capacity=40)
    cache, ring = session.cache, ring_slots(WINDOW, 4)
    base = session.prompt_slot(30)
    for slot in range(base + 30 - ring, base + 30):
        torch.testing.assert_close(cache.keys[0][:, :, slot % ring], prefix[0][0][:, :, slot - base])
    session.sample()
    session.step(torch.tensor([5]))
    session.rewind(int(cache.length) - 1)
    with pytest.raises(ValueError, match="cannot rewind"):
        session.rewind(int(cache.length) - ring)


def test_window_decode_through_the_triton_kernel(monkeypatch):
    """The decode kernel's ``slots`` path (the ring) under Triton's interpreter equals the reference."""
    model = hybrid_model("gemma3")
    ids, mask = padded_batch(2, 21)
    want = Decoder(copy.deepcopy(model), page_size=4).generate(ids, 4, attention_mask=mask, output_logits=True)
    monkeypatch.setenv("POLICYZOO_TRITON", "1")
    got = Decoder(model, page_size=4).generate(ids, 4, attention_mask=mask, output_logits=True)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-4)


def test_every_layer_a_window_warns_that_the_policy_runs_on_none():
    dec = Decoder(hybrid_model("mistral"), kv=Quest(0.5, page=4))
    with pytest.warns(UserWarning, match="runs on none"):
        dec.generate(padded_batch(1, 20)[0], 4)


# ------------------------------------------------------------------------------ refused
def test_an_unsupported_family_names_itself_and_the_supported_ones():
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    with pytest.raises(ValueError, match=r"unsupported architecture 'gpt2'; policyzoo supports .*gemma2, gemma3_text"):
        Decoder(transformers.GPT2LMHeadModel(config))


def test_gemma2_with_logit_softcapping_is_refused():
    model = hybrid_model("gemma2")
    model.config.attn_logit_softcapping = 50.0
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0 is not supported"):
        Decoder(model)


def test_unknown_layer_kinds_are_refused():
    config = {"model_type": "qwen3", "num_hidden_layers": 2, "layer_types": ["full_attention", "chunked_attention"]}
    with pytest.raises(ValueError, match=r"layer types \['chunked_attention'\] are not supported"):
        _compat.layer_windows(config)


def test_a_window_the_backend_does_not_apply_is_refused():
    """Should policyzoo's layer kinds ever disagree with what the model's attention passes, the
    attention function refuses rather than decode differently."""
    dec = Decoder(hybrid_model("gemma3"))
    dec.session.layer_windows = (None, None, WINDOW)  # pretend layer 0 were a full layer
    with pytest.raises(RuntimeError, match="layer 0: the model attends with sliding_window=8"):
        dec.generate(padded_batch(1, 21)[0], 2)


def test_policies_a_mixed_model_cannot_serve_are_refused():
    model = hybrid_model("gemma3")
    with pytest.raises(ValueError, match=r"reads the step context \['below'\]"):
        Decoder(model, kv=PrHS(Quest(0.3, page=4), layer=(0, 0, 0)))
    with pytest.raises(ValueError, match=r"reads the step context \['rotary'\]"):
        Decoder(model, kv=Forecast(0.3, block=8, kernel=8, stride=4, rank=4))
    with pytest.raises(ValueError, match="sliding-window layers, which attend with softmax"):
        Decoder(model, kv=EntmaxKV(0.3, page=4, attention="entmax"))
    with pytest.raises(ValueError, match=r"layers \[2\] are sliding-window layers"):
        Decoder(model, offload=Offload(layers=1)).generate(padded_batch(1, 21)[0], 2)


# ------------------------------------------------------------------------------ bytes
def test_the_byte_account_counts_window_layers_at_their_window():
    acct = ByteAccount.from_config(hybrid_model("gemma3").config, dtype=torch.float32)
    assert (acct.window, acct.window_layers) == (WINDOW, 2)
    full = ByteAccount.from_config({**hybrid_model("gemma3").config.to_dict(), "layer_types": ["full_attention"] * 3})
    assert full.window_layers == 0
    n, kv, e = 1000, acct.kv_per_token, acct.element_size
    dense = acct.step_bytes(n)
    assert dense == (3 * acct.proj + kv * (n + 2 * WINDOW) + acct.fixed) * e
    assert acct.step_bytes(n, r_kv=0.25) == (3 * acct.proj + kv * (n * 0.25 + 2 * WINDOW) + acct.fixed) * e
    # Within the window every layer is a full one: the policy runs on all of them.
    assert acct.step_bytes(WINDOW, r_kv=0.5) == (3 * acct.proj + 3 * kv * WINDOW * 0.5 + acct.fixed) * e
    # Only the full layer saves KV bytes beyond the window, so the crossover is three times later.
    base = ByteAccount.from_config({**hybrid_model("gemma3").config.to_dict(), "layer_types": ["full_attention"] * 3},
                                   dtype=torch.float32)
    assert acct.crossover(0.5, 0.2) == pytest.approx(3 * base.crossover(0.5, 0.2))
    every = ByteAccount.from_config(hybrid_model("mistral").config)
    assert every.window_layers == 3 and every.crossover(0.5, 0.2) == float("inf")


def test_builtin_hybrid_accounts_and_the_report():
    from policyzoo.bytes import format_report, report

    gemma = ByteAccount.from_config("gemma-3-1b")
    assert (gemma.window, gemma.window_layers, gemma.layers) == (512, 22, 26)
    rep = report(gemma, 0.5, 0.1, [1024, 32768])
    assert (rep["window"], rep["window_layers"]) == (512, 22)
    assert "sliding-window layers: 22 of 26" in format_report(rep)
    plain = report(ByteAccount.from_config("llama-3.1-8b"), 0.5, 0.1, [1024])
    assert plain["window_layers"] == 0 and "sliding-window" not in format_report(plain)

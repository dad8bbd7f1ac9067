"""Attention routing: a model whose KV policy says ``attention="entmax"`` attends with 1.5-entmax in
prefill, decode, the dense setting, the dense reference pass of `compare` and the audit; softmax
policies are unaffected. The oracle is the ``entmax`` package's ``entmax15``."""

from __future__ import annotations

import copy

import pytest
import torch
from entmax import entmax15
from tiny_models import padded_batch, tiny_model
from transformers import AttentionInterface

from policyzoo import Decoder, EntmaxKV, Quest
from policyzoo._compat import attn_implementation
from policyzoo.attention import prefill_attention_entmax15, prefill_mask
from policyzoo.eval import compare
from policyzoo.eval.audit import Audit

NEW = 8
ORACLE = "policyzoo_test_entmax15"


def full_entmax(page: int = 4) -> EntmaxKV:
    """Every page selected (topk mode at a full budget), so sparse entmax is dense entmax."""
    return EntmaxKV(budget=1.0, mode="topk", attention="entmax", page=page)


def entmax_oracle(start: torch.Tensor):
    """An HF attention function: eager 1.5-entmax (the package's) over a left-padded batch."""

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        b, h, t, d = query.shape
        g = h // key.shape[1]
        k = key.double().repeat_interleave(g, dim=1)
        v = value.double().repeat_interleave(g, dim=1)
        z = torch.einsum("bhtd,bhsd->bhts", query.double(), k) * scaling
        z = z.masked_fill(~prefill_mask(start, t)[:, None], -torch.inf)
        out = torch.einsum("bhts,bhsd->bhtd", entmax15(z, dim=-1), v)
        return out.to(query.dtype).transpose(1, 2), None

    return attend


def oracle_logits(model, seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Full-forward logits of ``seq`` under entmax attention, at the positions that chose the new tokens."""
    start = (mask == 0).sum(1)
    AttentionInterface.register(ORACLE, entmax_oracle(start))
    positions = (torch.arange(seq.shape[1])[None, :] - start[:, None]).clamp(min=0)
    with torch.no_grad(), attn_implementation(model, ORACLE):
        logits = model(seq, position_ids=positions, use_cache=False).logits
    t = mask.shape[1]
    return logits[:, t - 1 : t - 1 + NEW]


def test_entmax_policy_decodes_like_an_entmax_model():
    """Prefill and every decode step attend with 1.5-entmax over the whole visible context."""
    model = tiny_model("llama")
    ids, mask = padded_batch(3, 27)
    seq, logits = Decoder(model, kv=full_entmax()).generate(ids, NEW, attention_mask=mask, output_logits=True)
    ref = oracle_logits(copy.deepcopy(model), seq, mask)
    torch.testing.assert_close(logits, ref, atol=2e-4, rtol=1e-4)
    assert torch.equal(seq[:, ids.shape[1] :], ref.argmax(-1))


def test_oracle_tells_entmax_from_softmax():
    """The entmax oracle is not met by softmax decoding (the test above has power)."""
    model = tiny_model("llama")
    ids, mask = padded_batch(3, 27)
    seq, logits = Decoder(model).generate(ids, NEW, attention_mask=mask, output_logits=True)
    ref = oracle_logits(copy.deepcopy(model), seq, mask)
    assert float((logits - ref).abs().max()) > 1e-2


def test_dense_setting_of_an_entmax_decoder_attends_with_entmax():
    """`Decoder.use("dense")` swaps in the Dense stand-in, not softmax: the model's attention stays."""
    model = tiny_model("llama")
    ids, mask = padded_batch(2, 21)
    dec = Decoder(model, kv=EntmaxKV(budget=4, attention="entmax", page=4)).use("dense")
    assert dec.session.attention == "entmax"
    seq, logits = dec.generate(ids, NEW, attention_mask=mask, output_logits=True)
    torch.testing.assert_close(logits, oracle_logits(copy.deepcopy(model), seq, mask), atol=2e-4, rtol=1e-4)


def test_compare_reference_pass_of_an_entmax_policy_is_dense_entmax():
    """The dense pass of `compare` is dense entmax: a full-budget entmax policy matches it exactly."""
    dec = Decoder(tiny_model("llama"), kv=full_entmax())
    ids, mask = padded_batch(2, 21)
    audit = compare(dec, ids, NEW, attention_mask=mask)
    assert max(float(kl.abs().max()) for kl in audit.logits_kl) < 1e-6
    assert all(bool(a.all()) for a in audit.top1_agree)


def test_softmax_policy_is_unaffected():
    """An EntmaxKV with softmax attention and every page is dense softmax decoding."""
    model = tiny_model("llama")
    ids, mask = padded_batch(3, 27)
    policy = EntmaxKV(budget=1.0, mode="topk", attention="softmax", page=4)
    dense_seq, dense_logits = Decoder(copy.deepcopy(model)).generate(ids, NEW, attention_mask=mask, output_logits=True)
    seq, logits = Decoder(model, kv=policy).generate(ids, NEW, attention_mask=mask, output_logits=True)
    assert torch.equal(seq, dense_seq)
    torch.testing.assert_close(logits, dense_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [512, 5])
def test_entmax_prefill_matches_the_package(rows):
    """Causal, left-padded, GQA 1.5-entmax prefill, in one block of query rows or several."""
    g = torch.Generator().manual_seed(0)
    b, h, h_kv, t, d = 3, 6, 2, 17, 8
    q = torch.randn(b, h, t, d, generator=g) * 3
    k, v = torch.randn(b, h_kv, t, d, generator=g), torch.randn(b, h_kv, t, d, generator=g)
    start = torch.tensor([0, 4, 16])
    out = prefill_attention_entmax15(q, k, v, start, d**-0.5, rows=rows)
    z = torch.einsum("bhtd,bhsd->bhts", q.double(), k.double().repeat_interleave(3, dim=1)) * d**-0.5
    pos = torch.arange(t)
    seen = (pos[None, :] <= pos[:, None]) & (pos[None, None, :] >= start[:, None, None])
    seen |= torch.eye(t, dtype=torch.bool)  # a padding query row sees only itself
    p = entmax15(z.masked_fill(~seen[:, None], -torch.inf), dim=-1)
    ref = torch.einsum("bhts,bhsd->bhtd", p, v.double().repeat_interleave(3, dim=1)).float()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_audit_of_a_full_budget_entmax_policy_drops_no_mass():
    dec = Decoder(tiny_model("llama"), kv=full_entmax())
    ids, mask = padded_batch(2, 21)
    dec.generate(ids, NEW, attention_mask=mask, audit=True)
    audit = dec.last_audit
    assert float(audit.per_layer("dropped_mass").max()) < 1e-5
    assert float(audit.per_layer("output_error").max()) < 1e-4


def test_audit_measures_entmax_policies_against_dense_entmax(make_case):
    """Dropped mass is the dense entmax mass outside the selection, output error against dense entmax."""
    case = make_case(b=2, h_kv=2, g=3, d=16, page=4, prompt=40, steps=3, starts=[0, 7], seed=5, sharp=3.0)
    c, state = case.cache, case.state()
    sel = Quest(budget=8, page=4, sinks=0, window=4).select(state, case.q)
    from policyzoo import kernels

    out, _ = kernels.decode_attention_entmax15(case.q, c.keys[0], c.values[0], sel, c.start, c.length, case.scale)
    audit = Audit()
    audit.record_attention(0, case.q, c, sel, out, case.scale, attention="entmax")

    qg = case.q.double().view(case.b, case.h_kv, case.g, case.d)
    z = torch.einsum("bkgd,bknd->bkgn", qg, c.keys[0].double()) * case.scale
    p = entmax15(z.masked_fill(~case.token_valid()[:, None, None, :], -torch.inf), dim=-1)
    keep = sel.token_mask(c.capacity)[:, :, None, :]
    delta = (p * ~keep).sum(-1).mean(-1)  # group mean, as recorded
    o = torch.einsum("bkgn,bknd->bkgd", p, c.values[0].double()).reshape(case.b, case.h_kv, -1)
    err = (o - out.double().reshape(case.b, case.h_kv, -1)).norm(dim=-1) / o.norm(dim=-1)
    assert float(delta.max()) > 1e-3  # the selection drops some entmax mass: the check has power
    torch.testing.assert_close(audit.dropped_mass[0][0].double(), delta, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(audit.output_error[0][0].double(), err, atol=1e-5, rtol=1e-4)
    assert not audit.certified_bound  # a softmax bound: not recorded for entmax attention


def test_entmax_dispatcher_routes_to_the_kernels_entmax_mode(monkeypatch):
    """With Triton in use, `kernels.decode_attention_entmax15` is the decode op in ``mode="entmax15"``."""
    from policyzoo import kernels
    from policyzoo.kernels.ops import decode_attention as attention_op

    calls = []
    monkeypatch.setattr(kernels.route, "use_triton", lambda t: True)
    monkeypatch.setattr(attention_op, "_attend", lambda *a: calls.append(a[-2:]) or ("out", "tau"))
    assert kernels.decode_attention_entmax15(torch.zeros(1, 1, 4), None, None, None, None, None, 1.0) == ("out", "tau")
    assert calls == [("entmax15", None)]  # mode and slots

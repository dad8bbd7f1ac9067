"""Greedy tokens of the page policies whose choice moved into `select_page_scores`, on a 2-layer toy model of the 8B structure (CPU), a left-padded batch of 2, 16 new tokens: a hash per policy. Run from the root of this tree and of the previous one (`git archive 33108fe`), with and without `POLICYZOO_TRITON=1 TRITON_INTERPRET=1`:

    PYTHONPATH=$PWD python benchmarks/results/2026-12-06-offline-run35/tok_check.py
"""
import hashlib, torch
from benchmarks import common
from policyzoo import Decoder
from policyzoo.kv import Quest, EntmaxKV
model = common.random_model("llama-3.1-8b", 2, tiny=True, device="cpu")
g = torch.Generator().manual_seed(1)
ids = torch.randint(1, 100, (2, 333), generator=g)
mask = torch.ones_like(ids); mask[1, :17] = 0  # a left-padded row
for name, kv in [("sketch", Quest(0.1, bound="sketch")), ("sketch tokens", Quest(100, bound="sketch", sinks=3, window=5)),
                 ("nominate", Quest(0.1, bound="sketch", nominate=4)), ("sum", Quest(0.2, aggregate="sum")),
                 ("sketch rescore", Quest(0.15, bound="sketch", rescore=2)), ("entmax topk sketch", EntmaxKV(0.2, mode="topk", bound="sketch")),
                 ("box", Quest(0.1))]:
    out = Decoder(model, kv=kv).generate(ids, 16, attention_mask=mask)
    print(f"{name:<20} {hashlib.sha1(out.numpy().tobytes()).hexdigest()[:12]}")

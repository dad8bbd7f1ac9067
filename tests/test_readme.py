"""The user documentation's code runs as written: the README's Quickstart, the decode loop of
docs/session.md, and the policies of docs/adding-a-policy.md, which behave as a policy must."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from tiny_models import padded_batch, tiny_model

from policyzoo import Decoder

ROOT = Path(__file__).resolve().parents[1]


def _readme_policy():
    text = ROOT.joinpath("docs", "adding-a-policy.md").read_text()
    block = re.search(r"# Adding a KV policy.*?```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(block, namespace)
    return namespace["KeyNormTopK"]


def test_readme_policy_runs_and_respects_its_budget():
    KeyNormTopK = _readme_policy()
    ids, mask = padded_batch(2, 40)
    dec = Decoder(tiny_model("llama"), kv=KeyNormTopK(budget=12, sinks=2, window=4))
    dec.generate(ids, 4, attention_mask=mask, audit=True)
    kept = dec.last_audit.per_layer("kv_keep")  # fraction of the visible context
    assert float(kept.max()) <= 12 / 37 + 1e-6 and float(kept.min()) > 0
    assert 0 < dec.last_audit.mean("dropped_mass") < 1
    assert dec.session.cache.summaries == ()  # it reads keys only, and says so: no page summary kept
    full = Decoder(tiny_model("llama"), kv=KeyNormTopK(budget=1000, sinks=2, window=4))
    assert torch.equal(full.generate(ids, 4, attention_mask=mask), Decoder(tiny_model("llama")).generate(ids, 4, attention_mask=mask))


def test_readme_policy_decodes_compiled_like_eager_where_its_scores_tie():
    """Qwen3 normalises its keys, so every key norm is the same number up to rounding; compiled and
    eager round differently, and only a ranking that treats them as ties (lowest position first,
    `kv.choose.choose_topk`) keeps the same tokens in both."""
    import copy

    KeyNormTopK = _readme_policy()
    model = tiny_model("qwen3")
    ids, mask = padded_batch(2, 60)
    eager = Decoder(copy.deepcopy(model), kv=KeyNormTopK(16, sinks=2, window=4)).generate(ids, 20, attention_mask=mask)
    compiled = Decoder(model, kv=KeyNormTopK(16, sinks=2, window=4), compile=True).generate(ids, 20, attention_mask=mask)
    assert torch.equal(eager, compiled)


def _block(after: str, doc: str = "README.md") -> str:
    """The first python block after `after` in `doc` (a path from the repository root)."""
    text = ROOT.joinpath(doc).read_text()
    return re.search(re.escape(after) + r".*?```python\n(.*?)```", text, re.S).group(1)


@pytest.mark.slow
def test_readme_session_loop_runs_as_written():
    """As written, on the embedded model: nothing defined beforehand."""
    pytest.importorskip("gguf")
    namespace: dict = {}
    exec(_block("## The decode session", "docs/session.md"), namespace)
    dec, ids = namespace["dec"], namespace["ids"]
    t = ids.shape[1]
    assert int(dec.session.cache.length) == dec.session.prompt_slot(t) + t + 32 and 0 <= namespace["audit"].mean("dropped_mass") < 1


def test_readme_step_context_example_runs_compiled_like_eager():
    import copy

    namespace: dict = {}
    exec(_block("**Beyond one layer at one step.**", "docs/adding-a-policy.md"), namespace)
    Sticky = namespace["Sticky"]
    model = tiny_model("llama")
    ids, mask = padded_batch(2, 40)
    eager = Decoder(copy.deepcopy(model), kv=Sticky(0.3, page=4, window=4)).generate(ids, 6, attention_mask=mask)
    compiled = Decoder(model, kv=Sticky(0.3, page=4, window=4), compile=True).generate(ids, 6, attention_mask=mask)
    assert torch.equal(eager, compiled)


@pytest.mark.slow
def test_readme_quickstart_runs_as_written(capsys):
    pytest.importorskip("gguf")
    namespace: dict = {}
    exec(_block("## Quickstart"), namespace)
    printed = capsys.readouterr().out
    assert "| expected " + namespace["answer"] in printed and "mean dropped mass" in printed

"""policyzoo.eval.harness: teacher-forced perplexity, audit aggregation, top-k recall and `policyzoo eval`."""

from __future__ import annotations

import contextlib
import io
import json
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

pytest.importorskip("datasets")

from tiny_models import tiny_model

from policyzoo import AttentionTopK, Window, assets, cli
from policyzoo.eval import harness
from policyzoo.eval.audit import Audit
from policyzoo.kv.base import KVState
from policyzoo.selection import Selection


def _ppl_record(length: int = 80, span: int = 12, seed: int = 0, vocab: int = 128) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (length,), generator=g).tolist()
    return {"task": "ppl", "input_ids": ids, "answer": "", "length": length, "span": span}


def _hf_span_nll(model, ids: list[int], span: int) -> float:
    """Mean NLL of the last ``span`` tokens under the plain HF model (one dense forward)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x).logits[0].float()
    return float(torch.nn.functional.cross_entropy(logits[-span - 1 : -1], x[0, -span:]))


def test_teacher_forced_dense_perplexity_equals_the_plain_model():
    model = tiny_model("llama")
    recs = [_ppl_record(seed=0), _ppl_record(seed=1)]
    expected = math.exp(np.mean([_hf_span_nll(model, r["input_ids"], 12) for r in recs]))
    settings = harness.make_settings(["dense", "window:sinks=2,window=8"], ["none"])
    res = harness.evaluate(model, None, settings, recs, progress=False)
    dense, window = res["rows"]
    assert dense["setting"] == "dense" and dense["task"] == "ppl" and dense["n"] == 2
    assert dense["ppl"] == pytest.approx(expected, rel=1e-5)  # decode steps through the Dense policy
    assert dense["dense_ppl"] == pytest.approx(expected, rel=1e-5)  # the reference
    assert dense["kl"] == pytest.approx(0.0, abs=1e-6) and dense["top1"] == 1.0
    assert dense["delta_max"] == pytest.approx(0.0, abs=1e-6) and dense["recall"] == pytest.approx(1.0)
    assert dense["steps"] == 12 and dense["kl_steps"] == 24
    # the same windows under a small window: a different perplexity and a positive dropped mass
    assert window["dense_ppl"] == dense["dense_ppl"]
    assert abs(window["ppl"] / expected - 1) > 1e-4  # random tiny models are near uniform: a small change
    assert window["delta_mean"] > 0.05 and window["kl"] > 0 and window["kv_keep"] < 1


def test_prefill_snapshot_matches_a_policy_own_prefill():
    """Policies that build state in `prefill` get a real prefill; the results match the snapshot path."""
    calls = []

    @dataclass
    class CountingWindow(Window):
        def prefill(self, state: KVState, q, k, v) -> None:
            calls.append(state.layer)

    model = tiny_model("qwen3")
    recs = [_ppl_record(64, 8, seed=s) for s in range(2)]
    plain = harness.Setting("window", Window(sinks=2, window=8), None)
    counting = harness.Setting("counting", CountingWindow(sinks=2, window=8), None)
    res = harness.evaluate(model, None, [plain, counting], recs, progress=False)
    a, b = res["rows"]
    assert calls == [0, 1]  # one prefill per layer (both records in one batch)
    assert b["ppl"] == pytest.approx(a["ppl"], rel=1e-5)
    assert b["delta_mean"] == pytest.approx(a["delta_mean"], rel=1e-4, abs=1e-6)


def test_topk_mass_recall_by_hand():
    p = torch.tensor([[[0.5, 0.3, 0.2, 0.0], [0.1, 0.2, 0.3, 0.4]]])  # [B=1, H=2, N=4], one KV head
    valid = torch.ones(1, 4, dtype=torch.bool)
    sel = Selection(indices=torch.tensor([[[1, 2, 0]]], dtype=torch.int32), count=torch.tensor([[2]], dtype=torch.int32))
    recall = harness.topk_mass_recall(p, sel, valid)
    # head 0 kept 0.3 + 0.2 of the best two (0.5 + 0.3); head 1 kept 0.2 + 0.3 of 0.4 + 0.3
    assert recall[0].tolist() == pytest.approx([0.5 / 0.8, 0.5 / 0.7])
    best = Selection(indices=torch.tensor([[[0, 1, 3]]], dtype=torch.int32), count=torch.tensor([[2]], dtype=torch.int32))
    assert harness.topk_mass_recall(p[:, :1], best, valid).item() == pytest.approx(1.0)
    empty = Selection(indices=torch.zeros(1, 1, 3, dtype=torch.int32), count=torch.zeros(1, 1, dtype=torch.int32))
    assert harness.topk_mass_recall(p, empty, valid)[0].tolist() == [1.0, 1.0]  # nothing kept, nothing to recall
    pages = Selection(indices=torch.tensor([[[1]]], dtype=torch.int32), count=torch.tensor([[1]], dtype=torch.int32), block=2)
    assert harness.topk_mass_recall(p[:, :1], pages, valid).item() == pytest.approx(0.2 / 0.8)  # tokens 2, 3


def test_recall_is_one_for_exact_topk_without_forced_tokens():
    model = tiny_model("llama", heads=2, kv_heads=2)  # no GQA: the exact top-k is the best selection
    settings = [harness.Setting("topk", AttentionTopK(16, sinks=0, window=0), None)]
    res = harness.evaluate(model, None, settings, [_ppl_record(64, 6)], progress=False)
    row = res["rows"][0]
    assert row["recall"] == pytest.approx(1.0, abs=1e-5) and row["recall_p5"] == pytest.approx(1.0, abs=1e-5)
    assert row["delta_mean"] > 0


def test_audit_aggregation_on_a_hand_made_audit():
    audit = Audit()
    # two layers, three steps, one row, two KV heads
    audit.dropped_mass[0] += [torch.tensor([[0.0, 0.1]]), torch.tensor([[0.2, 0.3]]), torch.tensor([[0.4, 0.5]])]
    audit.dropped_mass[1] += [torch.tensor([[0.6, 0.7]]), torch.tensor([[0.8, 0.9]]), torch.tensor([[1.0, 0.05]])]
    audit.output_error[0] += [torch.tensor([[0.01, 0.02]])] * 3
    audit.output_error[1] += [torch.tensor([[0.03, 0.04]])] * 3
    audit.logits_kl += [torch.tensor([0.1]), torch.tensor([0.3])]
    audit.top1_agree += [torch.tensor([True]), torch.tensor([False])]
    audit.proj_keep["0.q"] += [torch.tensor([0.5])]
    s = harness.summarize_audit(audit)
    values = np.array([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 0.05])
    assert s["delta_mean"] == pytest.approx(values.mean())
    assert s["delta_p95"] == pytest.approx(np.quantile(values, 0.95))
    assert s["delta_p95"] == pytest.approx(0.9 + 0.45 * 0.1)  # linear interpolation between 0.9 and 1.0
    assert s["delta_max"] == pytest.approx(1.0)
    assert s["delta_per_layer"] == pytest.approx([0.25, (0.6 + 0.7 + 0.8 + 0.9 + 1.0 + 0.05) / 6])
    assert s["output_error"] == pytest.approx(0.025) and s["output_error_p95"] == pytest.approx(0.04 - 0.05 * 0.01 * 1.5, abs=2e-3)
    assert s["kl"] == pytest.approx(0.2) and s["top1"] == 0.5 and s["proj_keep"] == 0.5
    assert s["steps"] == 3 and math.isnan(s["recall"])  # a plain Audit records no recall


def test_parse_length():
    assert harness.parse_length("1k") == 1024 and harness.parse_length("1.5K") == 1536
    assert harness.parse_length("3000") == 3000
    for bad in ("x", "0", "-1k", "1.3"):
        with pytest.raises(Exception):
            harness.parse_length(bad)
    assert harness.length_label(3072) == "3K" and harness.length_label(1000) == "1000" and harness.length_label(256) == "256"


# ------------------------------------------------------------------------------------------ CLI
@pytest.fixture(scope="module")
def tok():
    pytest.importorskip("gguf")
    return assets.load_tokenizer()


def test_cli_eval_writes_json_markdown_and_plots(tok, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    model = tiny_model("llama", vocab=len(tok))
    monkeypatch.setattr(assets, "load_model", lambda name, **kw: (model, tok))
    out = tmp_path / "run"
    argv = [
        "eval", "--kv", "dense", "window:sinks=2,window=16", "--proj", "topk:0.5",
        "--tasks", "passkey,multikey,ppl", "--lengths", "256", "--placements", "1", "--windows", "1",
        "--span", "4", "--out", str(out), "--no-progress",
    ]  # fmt: skip
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert cli.main(argv) == 0
    for name in ("results.json", "results.md", "accuracy.png", "delta_per_layer.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    res = json.loads((out / "results.json").read_text())
    assert [s["label"] for s in res["settings"]] == ["dense + topk:0.5", "window:sinks=2,window=16 + topk:0.5"]
    assert len(res["rows"]) == 2 * 3  # settings × tasks × lengths
    assert len(res["items"]) == 2 * 3
    assert res["meta"]["versions"]["datasets"] and res["meta"]["records"] == 3
    for r in res["rows"]:
        assert 0 <= r["delta_mean"] <= r["delta_p95"] + 1e-9 <= r["delta_max"] + 2e-9 <= 1 + 2e-9
        assert len(r["delta_per_layer"]) == 2 and r["proj_keep"] == pytest.approx(0.5, abs=0.01)
        if r["task"] == "ppl":
            assert r["accuracy"] is None and r["ppl"] > 0 and r["steps"] == 4
        else:
            assert 0 <= r["accuracy"] <= 1 and r["ppl"] is None
    md = (out / "results.md").read_text()
    assert md.count("\n| ") == 1 + 6 and "δ p95" in md and "| dense + topk:0.5 | ppl | 256 |" in md


def test_cli_eval_rejects_a_bad_spec_with_the_accepted_names(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", "--kv", "qwest:0.1", "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown KV policy 'qwest'" in err and "attn-topk" in err and "quest" in err
    with pytest.raises(SystemExit):
        cli.main(["eval", "--lengths", "1q", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        cli.main(["eval", "--tasks", "passkey,needles", "--out", str(tmp_path)])
    assert "accepted: passkey, multikey, ppl" in capsys.readouterr().err


def test_cli_eval_runs_a_saved_dataset(tmp_path, monkeypatch):
    """Users bring their own records (same fields) with --dataset: here a save_to_disk folder."""
    from datasets import Dataset

    model = tiny_model("llama")
    monkeypatch.setattr(assets, "load_model", lambda name, **kw: (model, None))
    Dataset.from_list([_ppl_record(48, 6, seed=s) for s in range(3)]).save_to_disk(str(tmp_path / "data"))
    out = tmp_path / "run"
    with contextlib.redirect_stdout(io.StringIO()):
        cli.main(["eval", "--dataset", str(tmp_path / "data"), "--kv", "attn-topk:16,sinks=2,window=4", "--out", str(out), "--no-plots", "--no-progress"])
    res = json.loads((out / "results.json").read_text())
    (row,) = res["rows"]
    assert (row["setting"], row["task"], row["length"], row["n"], row["steps"]) == ("attn-topk:16,sinks=2,window=4", "ppl", 48, 3, 6)
    assert not (out / "accuracy.png").exists()


def test_a_sampling_policy_gives_each_batch_the_same_draws_whatever_ran_before():
    # SSA's random stream restarts per batch: a record's result does not depend on the grid's order.
    model = tiny_model("llama")
    first, second = [_ppl_record(length=90, seed=3)], [_ppl_record(length=70, seed=4)]
    settings = harness.make_settings(["ssa:budget=4,sample=4,proxy=exact,window=4"], ["none"])
    alone = harness.evaluate(model, None, settings, second, progress=False)["rows"][0]
    after = [r for r in harness.evaluate(model, None, settings, first + second, progress=False)["rows"] if r["length"] == 70]
    assert after[0]["ppl"] == alone["ppl"] and after[0]["delta_mean"] == alone["delta_mean"]

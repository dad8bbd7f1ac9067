"""policyzoo.eval.cli: `policyzoo eval` end to end on tiny models, and its argument handling."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

pytest.importorskip("datasets")

from tiny_models import tiny_model

from policyzoo import assets, cli
from policyzoo.eval.cli import parse_length
from policyzoo.eval.report import length_label


def _ppl_record(length: int = 80, span: int = 12, seed: int = 0, vocab: int = 128) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (length,), generator=g).tolist()
    return {"task": "ppl", "input_ids": ids, "answer": "", "length": length, "span": span}


def test_parse_length():
    assert parse_length("1k") == 1024 and parse_length("1.5K") == 1536
    assert parse_length("3000") == 3000
    for bad in ("x", "0", "-1k", "1.3"):
        with pytest.raises(Exception):
            parse_length(bad)
    assert length_label(3072) == "3K" and length_label(1000) == "1000" and length_label(256) == "256"


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


def test_cli_eval_to_an_unwritable_out_is_a_clear_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", "--out", str(blocker / "results"), "--tasks", "ppl", "--lengths", "256"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "policyzoo eval: error:" in err and "Traceback" not in err

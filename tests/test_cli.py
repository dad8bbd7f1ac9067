"""`policyzoo run` end to end on the embedded model (small sizes), plus argument handling."""

from __future__ import annotations

import contextlib
import io
import json
import math
import runpy
import sys

import pytest

from policyzoo import cli

SETTINGS = [label for label, _ in cli.default_settings()]


@pytest.fixture(scope="module")
def run_output(tmp_path_factory):
    pytest.importorskip("gguf")
    path = tmp_path_factory.mktemp("cli") / "rows.json"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["run", "--tokens", "512", "--new-tokens", "7", "--depth", "0.5", "--json", str(path), "--no-progress"])
    return rc, out.getvalue(), json.loads(path.read_text())


def table_rows(stdout: str) -> dict[str, list[str]]:
    """Each setting's label -> its last five columns (ok, tok/s, kv keep, proj keep, δ)."""
    rows = {}
    for line in stdout.splitlines():
        for label in SETTINGS:
            if line.startswith(label + "  "):
                rows[label] = line[len(label) :].split()[-5:]
    return rows


@pytest.mark.slow
def test_run_prints_five_rows(run_output):
    rc, stdout, _ = run_output
    assert rc == 0
    assert "tok/s" in stdout and "median decode-step" in stdout and "prefill excluded" in stdout
    rows = table_rows(stdout)
    assert list(rows) == SETTINGS
    for cols in rows.values():
        ok, tps, kv, proj, delta = cols[0], *map(float, cols[1:])
        assert ok in ("right", "WRONG")
        assert tps > 0
        assert 0 < kv <= 1 and 0 < proj <= 1 and 0 <= delta <= 1


@pytest.mark.slow
def test_run_json_rows_are_sane(run_output):
    _, _, record = run_output
    assert record["prompt_tokens"] <= 512 and record["new_tokens"] == 7
    rows = {r["setting"]: r for r in record["rows"]}
    assert list(rows) == SETTINGS
    for r in rows.values():
        assert 0 < r["kv_keep"] <= 1 and 0 < r["proj_keep"] <= 1
        assert 0 <= r["dropped_mass"] <= 1
        assert r["tokens_per_s"] > 0 and math.isfinite(r["tokens_per_s"])
    dense = rows["dense"]
    assert dense["correct"] and dense["dropped_mass"] < 1e-4
    assert dense["kv_keep"] == pytest.approx(1.0) and dense["proj_keep"] == 1.0
    assert rows["Window(sinks=4, window=256)"]["kv_keep"] < 0.6  # 260 of ~500 tokens
    for label in ("AttentionTopK(0.25)", "Quest(0.25, page=16)", "AttentionTopK(0.25) + TopK(0.5)"):
        assert rows[label]["kv_keep"] == pytest.approx(0.25, abs=0.03)
        assert rows[label]["dropped_mass"] > 0
    assert rows["AttentionTopK(0.25) + TopK(0.5)"]["proj_keep"] == pytest.approx(0.5, abs=0.01)
    for label in ("dense", "AttentionTopK(0.25)"):
        assert rows[label]["correct"], rows[label]


def test_parser_has_run_and_rejects_bad_arguments(capsys):
    parser = cli.build_parser()
    args = parser.parse_args(["run"])
    assert (args.tokens, args.depth, args.new_tokens, args.model) == (2048, 0.5, 8, "smollm2-135m")
    for bad in (["run", "--depth", "1.5"], ["run", "--tokens", "0"], ["run", "--new-tokens", "-1"], [], ["nope"]):
        with pytest.raises(SystemExit) as e:
            cli.main(bad)
        assert e.value.code == 2
    assert "depth" in capsys.readouterr().err


def test_python_m_policyzoo_help(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["policyzoo", "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module("policyzoo", run_name="__main__")
    assert e.value.code == 0
    assert "run" in capsys.readouterr().out


def test_format_table_is_fixed_width():
    rows = [
        cli.Row("dense", "12345.", True, 10.0, 1.0, 1.0, 0.0),
        cli.Row("Window(sinks=4, window=256)", "a very long answer that goes on and on", False, 9.5, 0.25, 1.0, 0.5),
    ]
    lines = cli.format_table(rows).splitlines()
    assert len({len(line) for line in lines}) == 1  # header, rule and rows line up
    assert "WRONG" in lines[-1] and "right" in lines[-2]


def test_calibrate_writes_thresholds_that_a_proj_spec_loads(tmp_path):
    """One command calibrates `Threshold` on the embedded model and essays; the file it writes is
    what ``--proj threshold:path=FILE`` loads, with a positive threshold for every projection."""
    pytest.importorskip("gguf")
    from policyzoo.spec import parse_proj

    path = tmp_path / "thresholds.safetensors"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(["calibrate", "--keep", "0.4", "--texts", "2", "--tokens", "128", "--out", str(path), "--no-progress"])
    assert rc == 0 and path.is_file() and f"--proj threshold:path={path}" in out.getvalue()
    proj = parse_proj(f"threshold:path={path}")
    assert proj.keep == 0.4 and len(proj.thresholds) == 30 * 7  # SmolLM2: 30 layers, seven projections
    assert all(v > 0 for v in proj.thresholds.values())
    fast_path = tmp_path / "fast.safetensors"
    with contextlib.redirect_stdout(out):
        argv = ["calibrate", "--method", "topk-fast", "--keep", "0.4", "--texts", "1", "--tokens", "128"]
        assert cli.main([*argv, "--targets", "gate,up,down", "--out", str(fast_path), "--no-progress"]) == 0
    assert f"--proj topk:mode=fast,path={fast_path}" in out.getvalue()
    fast = parse_proj(f"topk:mode=fast,path={fast_path}")
    assert fast.mode == "fast" and fast.keep == 0.4 and len(fast.ratios) == 30 * 3
    assert all(0 < v < 5 for v in fast.ratios.values())


def test_calibrate_refuses_bad_arguments_before_loading_the_model(tmp_path, capsys):
    for argv, match in ((["--keep", "0"], "keep"), (["--targets", "qkv"], "targets")):
        with pytest.raises(SystemExit):
            cli.main(["calibrate", "--out", str(tmp_path / "x"), *argv])
        assert match in capsys.readouterr().err


def test_calibrate_prhs_writes_a_schedule_that_a_kv_spec_loads(tmp_path):
    """``calibrate --method prhs`` measures PrHS's axes around ``--kv`` on the embedded model and
    essays; ``--kv prhs:path=FILE`` loads the policy it wrote, and the measurements sit beside it."""
    pytest.importorskip("gguf")
    from policyzoo import PrHS, Quest
    from policyzoo.spec import parse_kv

    path = tmp_path / "prhs.safetensors"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        argv = ["calibrate", "--method", "prhs", "--kv", "quest:0.2", "--texts", "1", "--tokens", "160", "--steps", "6"]
        assert cli.main([*argv, "--out", str(path), "--no-progress"]) == 0
    assert f"--kv prhs:path={path}" in out.getvalue() and path.with_suffix(".json").is_file()
    policy = parse_kv(f"prhs:path={path}")
    assert isinstance(policy, PrHS) and policy.policy == Quest(0.2)
    assert len(policy.depth) == 30 and len(policy.layer) == 30 and 0 < policy.time <= 1  # SmolLM2: 30 layers
    assert policy.eps is None and abs(sum(policy.depth.scale) / 30 - 1) < 1e-6
    report = json.loads(path.with_suffix(".json").read_text())
    assert {"depth", "layer", "time"} <= set(report) and report["time"]["tau"] == policy.time


def test_outputs_and_inputs_are_checked_before_any_work(tmp_path, capsys):
    """An --out or --json that cannot be written, a model config that is not one, options of another
    method: each a one-line error before a model loads (no traceback, no Rust error after the work)."""
    cases = [
        (["calibrate", "--out", str(tmp_path / "missing" / "x.safetensors")], "no directory"),
        (["calibrate", "--out", str(tmp_path)], "is a directory"),
        (["calibrate", "--method", "threshold", "--kv", "quest:0.1", "--out", str(tmp_path / "t.safetensors")], "--kv apply to --method prhs only"),
        (["run", "--json", str(tmp_path / "missing" / "rows.json")], "no directory"),
        (["bytes", "--model", __file__, "--rp", "0.5", "--rkv", "0.5"], "is not a JSON model config"),
        (["bytes", "--model", str(tmp_path / "nope.json"), "--rp", "0.5", "--rkv", "0.5"], "neither a built-in name"),
    ]
    for argv, match in cases:
        with pytest.raises(SystemExit) as stop:
            cli.main(argv)
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert match in err and "Traceback" not in err, err


def test_a_spec_naming_a_missing_file_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit):
        cli.main(["eval", "--kv", "forecast:0.1,heads=/missing/heads.safetensors", "--out", "/tmp/never"])
    err = capsys.readouterr().err
    assert "heads='/missing/heads.safetensors'" in err and "no policy file" in err and "Traceback" not in err

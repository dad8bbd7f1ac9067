"""`policyzoo bytes`: the printed crossover, step bytes, floor and bound agree with `ByteAccount`;
bad ratios, models and batch arguments are clear errors."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest

from policyzoo import cli
from policyzoo.bytes import ByteAccount, format_k, parse_tokens, report


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(["bytes", *argv])
        except SystemExit as e:  # argparse and main's error path exit
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def crossover_lines(stdout: str) -> tuple[str, str]:
    full = re.search(r"all seven projections\s+(\S+)", stdout).group(1)
    ff = re.search(r"feed-forward only\s+(\S+)", stdout).group(1)
    return full, ff


@pytest.mark.parametrize(
    ("model", "full", "ff"),
    [("llama-3.1-8b", "74.3K", "60.0K"), ("qwen3-8b", "65.7K", "51.4K"), ("llama-3.1-70b", "291.4K", "240.0K")],
)
def test_text_crossover_matches_the_account(model, full, ff):
    rc, out, _ = run("--model", model, "--rp", "0.5", "--rkv", "0.3")
    assert rc == 0
    assert crossover_lines(out) == (full, ff)
    acct = ByteAccount.from_config(model)
    assert format_k(acct.crossover(0.5, 0.3)) == full and format_k(acct.crossover(0.5, 0.3, ff_only=True)) == ff


def test_text_rows_match_the_account():
    rc, out, _ = run("--model", "llama-3.1-8b", "--rp", "0.5", "--rkv", "0.3", "--contexts", "4k,32k,128k")
    assert rc == 0
    acct = ByteAccount.from_config("llama-3.1-8b")
    lines = [ln for ln in out.splitlines() if ln.rstrip().endswith("x")]
    assert len(lines) == 12  # 3 contexts × dense / proj / kv / both
    # 32K, both: floor and bound as ByteAccount computes them at the default 4.27 TB/s.
    both_32k = lines[7].split()
    assert both_32k[0] == "both"
    assert float(both_32k[-2]) == pytest.approx(acct.floor_ms(32768, 4.27e12, 0.5, 0.3), abs=1e-3)
    assert float(both_32k[-1].rstrip("x")) == pytest.approx(acct.bound(32768, 0.5, 0.3), abs=0.005)
    assert "32K" in lines[4] and "dense" in lines[4] and lines[4].endswith("1.00x")
    assert "4.521" in lines[4]  # the dense byte floor at 32K on an H200 (4.5 ms)


def test_json_matches_the_account():
    rc, out, _ = run("--model", "llama-3.1-8b", "--rp", "0.5", "--rkv", "0.3", "--contexts", "4k,131072",
                     "--bandwidth", "2", "--json")  # fmt: skip
    assert rc == 0
    rep = json.loads(out)
    acct = ByteAccount.from_config("llama-3.1-8b")
    assert rep["crossover"]["all"]["tokens"] == pytest.approx(acct.crossover(0.5, 0.3))
    assert rep["crossover"]["all"]["K"] == pytest.approx(74.3, abs=0.05)
    assert rep["crossover"]["ff_only"]["K"] == pytest.approx(60.0, abs=0.05)
    assert [(r["context"], r["setting"]) for r in rep["rows"]] == [
        (n, s) for n in (4096, 131072) for s in ("dense", "proj", "kv", "both")
    ]
    for r in rep["rows"]:
        assert r["step_bytes"] == acct.step_bytes(r["context"], r["r_p"], r["r_kv"])
        assert r["floor_ms"] == pytest.approx(acct.floor_ms(r["context"], 2e12, r["r_p"], r["r_kv"]))
        assert r["bound"] == pytest.approx(acct.bound(r["context"], r["r_p"], r["r_kv"]))
    kv = next(r for r in rep["rows"] if r["setting"] == "kv")
    assert (kv["r_p"], kv["r_kv"]) == (1.0, 0.3)


def test_batch_uses_the_union_keep_for_sparse_projections_only():
    rc, out, _ = run("--model", "llama-3.1-8b", "--rp", "0.5", "--rkv", "0.3", "--batch", "4", "--union-keep", "0.92", "--json")
    assert rc == 0
    rep = json.loads(out)
    acct = ByteAccount.from_config("llama-3.1-8b")
    assert rep["crossover"]["all"]["tokens"] == pytest.approx(acct.crossover(0.5, 0.3, batch=4, union_keep=0.92))
    rows = {(r["context"], r["setting"]): r for r in rep["rows"]}
    assert rows[(4096, "proj")]["step_bytes"] == acct.step_bytes(4096, 0.5, 1.0, batch=4, union_keep=0.92)
    assert rows[(4096, "kv")]["step_bytes"] == acct.step_bytes(4096, 1.0, 0.3, batch=4)  # dense projections


def test_config_json_path_and_kv_keep_one(tmp_path):
    cfg = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 2, "num_attention_heads": 16,
           "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 1000}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc, out, _ = run("--model", str(tmp_path), "--rp", "0.5", "--rkv", "1")
    assert rc == 0
    assert crossover_lines(out) == ("never", "never")  # KV keep 1 saves nothing
    rc, out, _ = run("--model", str(tmp_path / "config.json"), "--rp", "0.5", "--rkv", "1", "--json")
    assert json.loads(out)["crossover"]["all"] == {"tokens": None, "K": None}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "llama-3.1-8b", "--rp", "1.5", "--rkv", "0.3"], "--rp: must be a keep ratio in (0, 1]"),
        (["--model", "llama-3.1-8b", "--rp", "0.5", "--rkv", "0"], "--rkv: must be a keep ratio in (0, 1]"),
        (["--model", "llama-3.1-8b", "--rp", "half", "--rkv", "0.3"], "--rp: must be a keep ratio"),
        (["--model", "gpt-17", "--rp", "0.5", "--rkv", "0.3"], "neither a built-in name"),
        (["--model", "llama-3.1-8b", "--rp", "0.5", "--rkv", "0.3", "--contexts", "4k,lots"], "'lots' is not a token count"),
        (["--model", "llama-3.1-8b", "--rp", "0.5", "--rkv", "0.3", "--contexts", "0"], "not a positive whole number"),
        (["--model", "llama-3.1-8b", "--rp", "0.5", "--rkv", "0.3", "--batch", "4"], "needs --union-keep"),
        (["--model", "llama-3.1-8b", "--rp", "0.5", "--rkv", "0.3", "--union-keep", "0.9"], "--batch > 1 only"),
        (["--model", "llama-3.1-8b", "--rp", "0.5", "--rkv", "0.3", "--batch", "2", "--union-keep", "0.4"], "cannot be below r_p"),
        (["--model", "llama-3.1-8b", "--rp", "0.5", "--rkv", "0.3", "--bandwidth", "-1"], "--bandwidth: must be a positive number"),
    ],
)
def test_bad_arguments_are_clear_errors(argv, message):
    rc, out, err = run(*argv)
    assert rc == 2 and out == ""
    assert message in err, err


def test_bad_config_file_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    rc, _, err = run("--model", str(tmp_path), "--rp", "0.5", "--rkv", "0.3")
    assert rc == 2 and "lacks the dimensions" in err


def test_parse_tokens_and_report_checks():
    assert [parse_tokens(s) for s in ("4096", "4k", "128K", "1m", "1.5k")] == [4096, 4096, 131072, 1 << 20, 1536]
    for bad in ("", "k", "0.5", "-4k", "inf"):
        with pytest.raises(ValueError):
            parse_tokens(bad)
    acct = ByteAccount.from_config("smollm2-135m")
    with pytest.raises(ValueError, match="contexts"):
        report(acct, 0.5, 0.3, [])
    with pytest.raises(ValueError, match="bandwidth"):
        report(acct, 0.5, 0.3, [1024], bandwidth=0)


def test_a_closed_pipe_ends_the_command_quietly(monkeypatch):
    """`policyzoo bytes | head`: the reader closing the pipe is not an error worth a traceback."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "policyzoo", "bytes", "--model", "llama-3.1-8b", "--rp", "0.5", "--rkv", "0.5", "--contexts", ",".join(["4k"] * 3000)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    proc.stdout.readline()
    proc.stdout.close()  # as `head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and "Traceback" not in err and "BrokenPipe" not in err

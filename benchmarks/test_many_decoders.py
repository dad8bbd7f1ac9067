"""Smoke test of `benchmarks.many_decoders` on CPU: the shared process's rows, then each setting in a
process of its own (`--alone-for`), merged into one table (timings mean nothing here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_many_decoders_runs_and_merges_the_processes_of_their_own(tmp_path):
    from benchmarks import many_decoders

    env = dict(os.environ, TRITON_INTERPRET="1")
    base = [sys.executable, "-m", "benchmarks.many_decoders", "--tiny", "--backend", "eager", "--out", str(tmp_path)]
    # The shared process is this one; the processes of their own are real ones.
    # --recapture: the first Decoder's graphs captured again; --retime-first: a fresh Decoder of the
    # first setting after the sequence, then again after a pause
    many_decoders.main(base[3:] + ["--settings", "dense,window4+512", "--contexts", "96", "--new-tokens", "10", "--retime-first", "0",
                                   "--recapture", "1"])
    saved = json.loads((tmp_path / "many_decoders.json").read_text())
    assert [r["setting"] for r in saved["rows"]] == ["dense", "dense", "window4+512", "dense", "dense"]
    assert [r["order"] for r in saved["rows"]] == [1, "1, captured 2 times", 2, "1, again", "1, after 0 s idle"]
    assert {r["section"] for r in saved["rows"]} == {"many-retime"}  # a probe: not in LATEST.md
    assert all(r["fallbacks"] == 0 and r["generate_ms"] > 0 and r["bound"] >= 1.0 for r in saved["rows"])
    alone = subprocess.run(base + ["--alone-for", str(tmp_path / "many_decoders.json")], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=600)
    assert alone.returncode == 0, alone.stdout[-3000:] + alone.stderr[-3000:]
    rows = json.loads((tmp_path / "many_decoders.json").read_text())["rows"]
    assert all(r["fresh_generate_ms"] > 0 and "fresh_x_dense" in r for r in rows)
    table = (tmp_path / "many_decoders.md").read_text()
    assert table.count("\n| ") == 1 + 5 and "one process / alone" in table

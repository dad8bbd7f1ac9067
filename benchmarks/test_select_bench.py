"""Smoke test of `benchmarks.select_bench` on CPU: one toy context, the kernels in the Triton
interpreter. Its timings mean nothing; what it checks is that the probe's old and fused paths choose
the same entries and that every row is written. (That every policy's fused choice is its steps'
choice is the library's own contract: `tests/test_select_pages.py`.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import select_bench

ROOT = Path(__file__).resolve().parents[1]


def run_tiny(tmp_path, *flags: str) -> list[dict]:
    """The probe's rows at its toy context with ``flags``, the kernels in the Triton interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1", POLICYZOO_TRITON="1")
    out = tmp_path / "select-bench.json"
    cmd = [sys.executable, "-m", "benchmarks.select_bench", *flags, "--tiny", "--out", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-5000:]
    return json.loads(out.read_text())["rows"]


def test_select_bench_runs_on_cpu(tmp_path):
    # two copies of the layer (the timed calls rotate); the box, and CommunityKV, whose communities
    # the probe makes first (the other policies take the box's path through the probe)
    rows = run_tiny(tmp_path, "--copies", "2", "--policies", "quest0.1,community-kv0.1-runs10")
    assert [r for r in rows if "error" in r] == []
    assert all(r["copies"] == 2 for r in rows if "copies" in r) and any("copies" in r for r in rows)
    policies = [r for r in rows if r["setting"] != "dense" and not r["setting"].startswith("gaussian threshold")]
    assert {r["setting"] for r in policies} == {"quest0.1", "community-kv0.1-runs10"}
    assert all(r["same"] and r["old_select_us"] > 0 and r["new_select_us"] > 0 for r in policies)
    assert all(r["attention_us"] > 0 and 0 < r["kv_keep"] <= 1 for r in policies)
    threshold = [r for r in rows if r["setting"] == "gaussian threshold"]
    assert len(threshold) == 1 and threshold[0]["rel_diff"] < 1e-9
    # EntmaxKV's float32 steps: within the float32 root's documented distance (about 1e-5 of the pool's scale)
    fast = [r for r in rows if r["setting"] == "gaussian threshold, float32 steps"]
    assert len(fast) == 1 and fast[0]["float64_steps"] == 0 and fast[0]["scaled_diff"] < 2e-5


def test_select_bench_refuses_an_unknown_policy():
    with pytest.raises(SystemExit, match="unknown policies"):
        select_bench.main(["--tiny", "--policies", "quest0.1,quest9"])


def test_select_bench_tune_runs_on_cpu(tmp_path):
    rows = run_tiny(tmp_path, "--tune", "--copies", "2")  # the timed calls rotate two copies of the layer
    assert [r for r in rows if "error" in r] == []
    cases = {r["case"] for r in rows}
    assert cases == {"grouped bound alone", "select_scores alone", "box selection", "attention, every page",
                     "attention, box selection", "community selection"}
    timed = [r for r in rows if "correct" in r]
    assert timed and all(r["correct"] and r["us"] > 0 for r in timed)  # every config chose what the default chose
    assert sum(r["config"].startswith("best: ") for r in rows) == 4


def test_select_bench_breakdown_runs_on_cpu(tmp_path):
    rows = run_tiny(tmp_path, "--breakdown")
    cases = {(r["case"], r.get("stages")) for r in rows}
    for case in ("box selection", "selection from given scores"):
        assert {(case, s) for s in select_bench.STAGE_NAMES} <= cases
    assert all(r["us"] > 0 for r in rows if r.get("stages") == max(select_bench.STAGE_NAMES))
    # the choice's cost under each launch shape of CHOICE_GRID: after the arrival, and with the choice
    grid = [r for r in rows if "us_arrived" in r]
    assert len(grid) == sum(map(len, select_bench.CHOICE_GRID.values()))
    assert all(r["us"] > 0 and r["us_arrived"] > 0 and r["same"] for r in grid)
    assert [r["us"] > 0 for r in rows if r.get("what") == "kernels.select_scores"] == [True]
    assert [r["us"] > 0 for r in rows if r.get("what") == "choose_topk_steps"] == [True]

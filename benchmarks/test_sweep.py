"""Smoke test of the device sweep's logic on CPU (`python -m benchmarks.sweep --tiny`).

The sweep only runs for real on a GPU, where a Python error costs device time; here every section
that needs no compile of the whole model runs at toy sizes with the kernels in the Triton
interpreter (its timings mean nothing), and the files it writes are checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
from benchmarks import common
from policyzoo.bytes import ByteAccount


def _tiny_sweep(tmp_path, *args: str) -> tuple[list[dict], dict]:
    """Run ``benchmarks.sweep --tiny`` with the kernels in Triton's interpreter; its rows and meta."""
    env = dict(os.environ, TRITON_INTERPRET="1", POLICYZOO_TRITON="1")
    cmd = [sys.executable, "-m", "benchmarks.sweep", "--tiny", "--out", str(tmp_path), *args]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-5000:]
    record = json.loads((tmp_path / "sweep.json").read_text())
    assert [r for r in record["rows"] if "error" in r] == []
    return record["rows"], record["meta"]


# The variants and the other sections run as two tests (about a minute and 40 s in the interpreter),
# so that a suite's workers can share them.
def test_sweep_variants_run_on_cpu(tmp_path):
    rows, meta = _tiny_sweep(tmp_path, "--only", "variants", "--variants",
                             "select_top,merge,page_bound,sketch_bound,attention_pages,epilogue,append", "--contexts", "256")
    variants = [r for r in rows if r["section"] == "variants"]
    # variants: every alternative checked against the reference, one choice per group
    chosen = [r["setting"] for r in variants if r["setting"].startswith("chosen: ")]
    # select_top per row shape, the merge, the page bound, the sketch bound, sparse attention, the GEMV
    # epilogue per shape
    assert len(chosen) == 5 + 1 + 1 + 1 + 1 + 4
    assert all(r["correct"] for r in variants if "correct" in r)
    # select_top's choice for the rest of the run is a rule by row length, and the run records it
    rule = [r["setting"] for r in variants if r["setting"].startswith("rule for the rest")]
    assert len(rule) == 1 and "METHOD=" in rule[0]
    # the launch configs in force: the merge and the page bounds kept from the variants section
    assert meta["knobs"]["select_top"]["method"] == "auto" and set(meta["knobs"]["overridden"]) >= {"attention", "page_score", "sketch_score"}
    assert meta["source"] == common.source_digest()  # the code this test runs
    appends = [r for r in variants if r["shape"].startswith("cache append")]
    assert len(appends) == 2 * 3 * 2 and all(r["us"] > 0 for r in appends)  # 2 page sizes x 3 summary sets x 2
    assert (tmp_path / "sweep.md").read_text().count("## ") == 1


def test_sweep_sections_run_on_cpu(tmp_path):
    rows, _ = _tiny_sweep(tmp_path, "--only", "kernel,select,step,gemvfused", "--contexts", "256",
                          "--select-contexts", "256", "--select-policies", "quest0.1,entmax-kv0.1",
                          "--settings", "dense,quest0.1", "--gemv-batches", "1,4")
    by_section = {s: [r for r in rows if r["section"] == s] for s in ("kernel", "select", "step")}
    assert {r["setting"] for r in by_section["kernel"]} == {"split-K dense", "split-K 1/16 pages", "split-K 1/16 pages (page 64)", "torch SDPA"}
    # the policies asked for (every policy's select runs in its own contract tests), beside dense
    assert {r["setting"] for r in by_section["select"]} == {"dense", "quest0.1", "entmax-kv0.1 (softmax)"}
    assert all(r["select_us"] > 0 and 0 < r["kv_keep"] <= 1 for r in by_section["select"] if r["setting"] != "dense")
    step = {r["setting"]: r for r in by_section["step"]}
    assert set(step) == {"dense", "quest0.1"}
    assert step["dense"]["speedup"] == 1.0 and all(r["ms"] > 0 and r["bound"] >= 1.0 for r in step.values())
    fused = [r for r in rows if r["section"] == "gemvfused"]
    assert {(r["shape"], r["batch"]) for r in fused} == {(s, b) for s in ("q|k|v", "o", "gate|up", "down") for b in (1, 4)}
    assert all(r["rel_err"] < 2e-2 and r["TB/s"] > 0 and 0 < r["union"] <= 1 for r in fused)
    assert all(a["union"] <= b["union"] for a in fused for b in fused if a["shape"] == b["shape"] and a["batch"] < b["batch"])
    assert (tmp_path / "sweep.md").read_text().count("## ") == 4
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_compiled_rows_with_a_dynamic_capacity_compile_once_per_setting(tmp_path):
    """``--dynamic-capacity``: each setting's second context reuses its compiled step (on CPU through
    aot_eager: the graphs Inductor would get, without its code generation).
    The generate rows time `Decoder.generate` beside the compiled step."""
    env = {k: v for k, v in os.environ.items() if k != "POLICYZOO_TRITON"}  # the reference kernels: the rows' logic is tested here
    cmd = [sys.executable, "-m", "benchmarks.sweep", "--tiny", "--out", str(tmp_path),
           "--only", "compiled,generate", "--dynamic-capacity", "--backend", "aot_eager", "--compiled",
           "dense@256,dense@512,quest0.1@512,quest0.1@256,dense@256x2",
           "--generate", "dense@64,dense@128,quest0.1@128x2", "--new-tokens", "12"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-5000:]
    rows = json.loads((tmp_path / "sweep.json").read_text())["rows"]
    assert [r for r in rows if "error" in r] == []
    got = {(r["setting"], r["context"]): r for r in rows if r["section"] == "compiled" and r["batch"] == 1}
    assert set(got) == {("dense", 256), ("dense", 512), ("quest0.1", 256), ("quest0.1", 512)}
    batched = [r for r in rows if r["section"] == "compiled" and r["batch"] == 2]  # its own compile and dense
    assert [(r["setting"], r["context"], r["speedup"]) for r in batched] == [("dense", 256, 1.0)]
    assert all(r["mode"] == "compiled-dynamic" for r in got.values())
    assert got["dense", 256]["new_graphs"] >= 1 and got["quest0.1", 512]["new_graphs"] >= 1
    assert got["dense", 512]["new_graphs"] == 0 and got["quest0.1", 256]["new_graphs"] == 0
    assert got["quest0.1", 256]["speedup"] > 0  # over the dense row of the same mode and context
    # Each row on a cache sized for its own context, also after a longer one (grids follow capacity).
    assert all(r["context"] < r["capacity"] <= r["context"] + 256 for r in got.values())
    gen = {(r["setting"], r["context"], r["batch"]): r for r in rows if r["section"] == "generate"}
    assert set(gen) == {("dense", 64, 1), ("dense", 128, 1), ("quest0.1", 128, 2)}
    for r in gen.values():
        assert r["tokens"] == 12 and r["fallbacks"] == 0 and r["generate_ms"] > 0 and r["step_ms"] > 0 and r["floor_ms"] > 0
        assert r["generate/step"] == r["generate_ms"] / r["step_ms"]
        assert 0 < r["prefill_s"] < r["setup_s"]  # the set-up call's first token came after its prefill
    assert res.stdout.count("s after the prompt (the prefill)") == 3  # announced live, once per row
    assert gen["dense", 128, 1]["new_graphs"] == 0  # the dynamic capacity: its compile served 64 too


def test_compile_section_times_each_policy_in_a_cold_process(tmp_path):
    """The compile section: one child process per (policy, mode) on a toy model, rows with the
    compile time, its phases and the graph size; a child past its timeout is a row, not a crash."""
    # the torch references: what is timed is the compile, and the interpreter would only slow the steps
    env = {k: v for k, v in os.environ.items() if k != "POLICYZOO_TRITON"}
    base = [sys.executable, "-m", "benchmarks.sweep", "--tiny", "--only", "compile", "--compile-context", "48",
            "--compile-backend", "aot_eager", "--deadline", "3000"]  # a child gets at most the time left
    cmd = base + ["--out", str(tmp_path / "a"), "--compile-policies", "quest0.1", "--compile-modes", "regional,whole"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-5000:]
    rows = json.loads((tmp_path / "a" / "sweep.json").read_text())["rows"]
    assert [r for r in rows if "error" in r] == []
    got = {(r["setting"], r["mode"]): r for r in rows if r["section"] == "compile"}
    assert set(got) == {("quest0.1", m) for m in ("regional", "whole")}
    for (name, mode), r in got.items():
        assert r["regional"] == (mode == "regional") and r["context"] == 48 and r["graphs"] >= 1
        assert r["first_s"] > 0 and r["steady_s"] > 0 and r["dynamo_s"] > 0 and r["aot_s"] > 0 and r["step_ms"] > 0
    assert got["quest0.1", "whole"]["fx_calls"] > got["quest0.1", "regional"]["fx_calls"]  # 2 layers traced against 1
    assert "## compile" in (tmp_path / "a" / "sweep.md").read_text()

    cmd = base + ["--out", str(tmp_path / "b"), "--compile-policies", "dense", "--compile-modes", "whole", "--compile-timeout", "0.5"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-5000:]
    (row,) = json.loads((tmp_path / "b" / "sweep.json").read_text())["rows"]
    assert row["timeout"] is True and row["error"].startswith("timeout after")


def test_compiled_items_parse_batches_and_refuse_typos():
    from benchmarks.sweep import compiled_items, settings

    known = set(settings())
    assert compiled_items("dense@32768,quest0.2@32768x16", known) == [("dense", 32768, 1), ("quest0.2", 32768, 16)]
    for bad in ("dense@32k", "quest@4096", "dense@4096x0", "dense", "dense@4096x"):
        with pytest.raises(ValueError, match="setting@context"):
            compiled_items(bad, known)


def test_source_digest_follows_the_code_and_nothing_else(tmp_path):
    """``meta.source`` names the code a sweep ran: the same for the same files, changed by any edit
    to a ``.py`` under policyzoo/ or benchmarks/, blind to other files."""
    for folder in ("policyzoo", "benchmarks"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "a.py").write_text("x = 1\n")
    first = common.source_digest(tmp_path)
    (tmp_path / "benchmarks" / "notes.md").write_text("not code")
    assert common.source_digest(tmp_path) == first and len(first) == 12
    (tmp_path / "policyzoo" / "a.py").write_text("x = 2\n")
    assert common.source_digest(tmp_path) != first


def test_selection_bytes_of_each_setting():
    """The bound counts what a setting reads to choose: page summaries (EntmaxKV's mean and std weigh
    as much as its min and max), a second stage's keys, every key for exact scorers."""
    assert common.selection_ratio("dense") == common.selection_ratio("topk0.5") == 0.0
    assert common.selection_ratio("quest0.1") == common.selection_ratio("ssa0.05+0.05") == 1 / 16
    assert common.selection_ratio("quest0.1p64") == 1 / 64
    assert common.selection_ratio("entmax-kv0.1") == 2 / 16
    assert common.selection_ratio("quest0.1-rescore3") == pytest.approx(1 / 16 + 0.5 * 0.3)
    assert common.selection_ratio("attn-topk0.1") == common.selection_ratio("topk0.5+attn-topk0.2") == 0.5


def test_offloaded_step_rows_record_the_host_link_and_the_page_cache(tmp_path):
    """``--offload N --offload-cache share``: step rows with the last N layers' KV in host memory, the
    page caches' hit rate over the timed steps, and a floor that reads the misses over the link. A
    policy that predicts the next layer's selection (`Forecast`) prefetches, and the row says so."""
    cmd = [sys.executable, "-m", "benchmarks.sweep", "--tiny", "--out", str(tmp_path), "--only", "step",
           "--contexts", "128", "--settings", "quest0.1,forecast0.1", "--offload", "1", "--offload-cache", "1.0"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-5000:]
    rows = {r["setting"]: r for r in json.loads((tmp_path / "sweep.json").read_text())["rows"] if r["section"] == "step"}
    assert set(rows) == {"quest0.1", "forecast0.1"}
    for row in rows.values():
        assert "error" not in row and row["host_layers"] == 1 and row["host_link_GBps"] > 0 and row["page_cache"] == 1.0
        assert row["ms"] > 0 and row["floor_ms"] > 0 and 0.0 < row["hit_rate"] <= 1.0
    assert rows["forecast0.1"]["prefetch"] is True and rows["quest0.1"]["prefetch"] is False
    row = rows["quest0.1"]
    selected = ByteAccount.from_config(common.random_config(tiny=True), dtype=torch.float32).host_bytes(128, 0.1, 1) / 1e9
    assert row["host_GB"] == pytest.approx(selected * (1 - row["hit_rate"]))  # only the misses cross the link

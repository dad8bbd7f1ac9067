"""Smoke test of `benchmarks.ab` on CPU: two variants in one round on a toy model (eager), each
process a sweep of its own. Its timings mean nothing; what it checks is that each variant's
settings reach its process and the table; the alternating order and the ratios within rounds are
checked on `schedule` and `summarise` directly."""

from __future__ import annotations

import json

import pytest

from benchmarks import ab


def test_schedule_alternates_the_order():
    assert ab.schedule(["a", "b"], 3) == [(0, 0, "a"), (0, 1, "b"), (1, 0, "b"), (1, 1, "a"), (2, 0, "a"), (2, 1, "b")]


def test_variants_are_checked_before_anything_runs():
    assert ab.parse_variant("base=") == ("base", [])
    assert ab.parse_variant("own=select_pages.finish_min_row=0,select_pages.finish_warps=16") == (
        "own", ["select_pages.finish_min_row=0", "select_pages.finish_warps=16"])
    assert ab.parse_variant("pdl=env:TORCHINDUCTOR_ENABLE_PDL=1,attention.block_t=32") == (
        "pdl", ["env:TORCHINDUCTOR_ENABLE_PDL=1", "attention.block_t=32"])
    assert ab.environment(["env:AB_TEST=x=1", "attention.block_t=32"])["AB_TEST"] == "x=1"
    for bad in ("noequals", "=attention.block_t=32", "x=attention.block_t=48", "x=nokernel.a=1", "x=env:=1"):
        with pytest.raises(ValueError):
            ab.parse_variant(bad)


def test_summary_ratios_are_within_rounds():
    rows = [{"variant": v, "round": r, "setting": "s", "context": 8, "batch": 1, "generate_ms": ms}
            for v, r, ms in (("a", 0, 10.0), ("b", 0, 9.0), ("b", 1, 8.0), ("a", 1, 11.0))]
    table = {t["variant"]: t for t in ab.summarise(rows, ["a", "b"])}
    assert table["a"]["vs_base_median"] == 1.0 and table["a"]["ms_per_round"] == [10.0, 11.0]
    assert table["b"]["vs_base_min"] == pytest.approx(8 / 11) and table["b"]["vs_base_max"] == pytest.approx(0.9)
    assert table["b"]["ms_median"] == pytest.approx(8.5)


def test_ab_runs_on_cpu(tmp_path):
    rows = ab.main(["--tiny", "--backend", "eager", "--generate", "dense@64", "--new-tokens", "8", "--rounds", "1",
                    "--variant", "base=", "--variant", "tiles=attention.block_t=16,env:POLICYZOO_AB_SMOKE=1",
                    "--out", str(tmp_path)])
    assert [r for r in rows if "error" in r] == []
    assert [(r["round"], r["variant"]) for r in rows] == [(0, "base"), (0, "tiles")]  # later rounds: test_schedule_...
    assert all(r["generate_ms"] > 0 and r["tokens"] == 8 for r in rows)
    # each process ran under its own settings, and recorded them
    knobs = {r: json.loads((tmp_path / f"{r}/sweep.json").read_text())["meta"]["knobs"]
             for r in ("base-round0", "tiles-round0")}
    assert knobs["base-round0"]["overridden"] == [] and knobs["base-round0"]["attention"]["block_t"] == 0
    assert knobs["tiles-round0"]["overridden"] == ["attention"] and knobs["tiles-round0"]["attention"]["block_t"] == 16
    saved = json.loads((tmp_path / "ab.json").read_text())
    assert {t["variant"] for t in saved["table"]} == {"base", "tiles"}
    assert "× baseline" in (tmp_path / "ab.md").read_text()

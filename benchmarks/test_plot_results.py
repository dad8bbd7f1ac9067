"""`plot_results.py`: speedups divide by dense of the same call, never by another call's dense."""

from __future__ import annotations

import json

import pytest
from benchmarks.plot_results import compiled_points, main


def _call(path, rows):
    path.write_text(json.dumps({"meta": {"gpu": "test GPU"}, "rows": rows}))


def _row(setting, context, ms, bound=2.0, mode="compiled"):
    return {"section": "compiled", "mode": mode, "setting": setting, "context": context, "ms": ms, "bound": bound}


def test_ratios_stay_within_one_call(tmp_path):
    _call(tmp_path / "call1.json", [_row("dense", 1024, 10.0), _row("quest0.1", 1024, 5.0), _row("quest0.1", 2048, 4.0)])
    _call(tmp_path / "call2.json", [_row("dense", 2048, 12.0), {"section": "step", "setting": "dense", "context": 4096},
                                    _row("topk0.5", 1024, 9.0)])
    points = {(p["setting"], p["context"]): p for p in compiled_points(tmp_path)}
    # quest0.1@2048 has no dense in its own call; topk0.5@1024 none in call2: no points for them
    assert set(points) == {("quest0.1", 1024)}
    assert points["quest0.1", 1024]["speedup"] == pytest.approx(2.0)
    assert points["quest0.1", 1024]["of_bound"] == pytest.approx(1.0)


def test_later_call_wins_and_files_are_written(tmp_path):
    _call(tmp_path / "call1.json", [_row("dense", 1024, 10.0), _row("quest0.1", 1024, 5.0)])
    _call(tmp_path / "call2.json", [_row("dense", 1024, 9.0), _row("quest0.1", 1024, 6.0)])
    main([str(tmp_path)])
    table = (tmp_path / "compiled.md").read_text()
    assert "| quest0.1 | 1024 | 6.00 | 9.00 | 1.50 |" in table and "call2.json" in table
    assert (tmp_path / "compiled.png").stat().st_size > 0


def test_folder_without_compiled_rows_is_an_error(tmp_path):
    _call(tmp_path / "call1.json", [_row("dense", 1024, 10.0)])
    with pytest.raises(SystemExit, match="no compiled rows"):
        main([str(tmp_path)])


def test_dynamic_capacity_rows_divide_by_their_own_dense(tmp_path):
    _call(tmp_path / "call1.json", [_row("dense", 1024, 10.0), _row("dense", 1024, 8.0, mode="compiled-dynamic"),
                                    _row("quest0.1", 1024, 5.0), _row("quest0.1", 1024, 4.0, mode="compiled-dynamic")])
    points = {p["setting"]: p for p in compiled_points(tmp_path)}
    assert points["quest0.1"]["speedup"] == pytest.approx(2.0)
    assert points["quest0.1 (dynamic capacity)"]["speedup"] == pytest.approx(2.0)
    assert points["quest0.1 (dynamic capacity)"]["dense_ms"] == 8.0


def test_batched_rows_divide_by_dense_of_their_batch(tmp_path):
    rows = [_row("dense", 1024, 10.0), _row("quest0.2", 1024, 5.0),
            {**_row("dense", 1024, 30.0), "batch": 16}, {**_row("quest0.2", 1024, 20.0), "batch": 16},
            {**_row("quest0.1", 1024, 1.0), "batch": 4}]  # no dense row at batch 4: no point
    _call(tmp_path / "call1.json", rows)
    points = {p["setting"]: p for p in compiled_points(tmp_path)}
    assert set(points) == {"quest0.2", "quest0.2 (batch 16)"}
    assert points["quest0.2"]["speedup"] == pytest.approx(2.0)
    assert points["quest0.2 (batch 16)"]["speedup"] == pytest.approx(1.5)


def test_rows_marked_excluded_are_left_out_and_listed(tmp_path):
    bad = dict(_row("quest0.1", 2048, 1.0), excluded="timed on a larger cache")
    _call(tmp_path / "call1.json", [_row("dense", 1024, 10.0), _row("dense", 2048, 10.0), _row("quest0.1", 1024, 5.0), bad])
    assert {(p["setting"], p["context"]) for p in compiled_points(tmp_path)} == {("quest0.1", 1024)}
    main([str(tmp_path)])
    assert "- quest0.1 at 2048 (call1.json): timed on a larger cache" in (tmp_path / "compiled.md").read_text()

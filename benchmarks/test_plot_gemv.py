"""`plot_gemv.py`: per group and batch, the default and the fastest row beside cuBLAS."""

from __future__ import annotations

import json

import pytest
from benchmarks.plot_gemv import gemv_summary, main


def _row(setting, us, shape="o", batch=1, tbps=None):
    return {"section": "gemvfused", "shape": shape, "batch": batch, "union": 0.5, "cublas_us": 10.0, "cublas_TB/s": 3.0,
            "setting": f"threshold GEMV {setting}", "us": us, "TB/s": tbps or 20.0 / us}


def test_summary_keeps_the_default_and_the_fastest(tmp_path):
    rows = [_row("default", 8.0), _row("block_n=64", 5.0), _row("block_n=128", 6.0),
            {"section": "gemvfused", "shape": "o", "batch": 1, "setting": "threshold GEMV bad", "error": "x"},
            _row("default", 30.0, batch=4), {"section": "generate", "setting": "dense"}]
    got = {(s["shape"], s["batch"]): s for s in gemv_summary(rows)}
    assert set(got) == {("o", 1), ("o", 4)}
    assert got["o", 1]["default_us"] == 8.0 and got["o", 1]["best_us"] == 5.0 and got["o", 1]["best"] == "block_n=64"
    assert got["o", 1]["best_vs_cublas"] == pytest.approx(2.0)
    assert got["o", 4]["best"] == "default" and got["o", 4]["best_vs_cublas"] == pytest.approx(1 / 3)
    path = tmp_path / "call.json"
    path.write_text(json.dumps({"meta": {"gpu": "test GPU", "date": "today"}, "rows": rows}))
    main([str(path)])
    md = (tmp_path / "call-gemv.md").read_text()
    assert "| o | 1 | 0.500 | 10.0 (3.00) | 8.0 (2.50) | 5.0 (4.00) | 2.00x | block_n=64 |" in md
    assert (tmp_path / "call-gemv.png").stat().st_size > 0


def test_a_file_without_probe_rows_is_an_error(tmp_path):
    path = tmp_path / "call.json"
    path.write_text(json.dumps({"rows": [{"section": "generate"}]}))
    with pytest.raises(SystemExit, match="no gemvfused rows"):
        main([str(path)])

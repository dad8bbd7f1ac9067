"""`benchmarks.latest`: the newest row per setting, each linked to its run, and the README block."""

from __future__ import annotations

import json

from benchmarks import latest


def _run(folder, name, date, rows):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps({"meta": {"gpu": "GPU X", "date": date, "model": "m"}, "rows": rows}))


def _row(setting, context, ms, section="compiled", **extra):
    return {"section": section, "mode": "compiled", "setting": setting, "context": context, "batch": 1, "ms": ms, **extra}


def test_the_newest_run_wins_per_setting_and_rows_link_to_their_run(tmp_path):
    _run(tmp_path / "2026-01-01-run1", "call1.json", "2026-01-01", [_row("dense", 4096, 5.0), _row("quest", 4096, 4.0)])
    _run(tmp_path / "2026-01-02-run2", "call1.json", "2026-01-02", [_row("dense", 4096, 4.8), _row("dense", 8192, 6.0, error="OOM")])
    _run(tmp_path / "2026-01-02-run2", "call2.json", "2026-01-02", [_row("dense", 4096, 4.7)])
    _run(tmp_path / "2026-01-02-run2", "call10.json", "2026-01-02", [_row("dense", 4096, 4.6, excluded="timed on a larger cache")])
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "results.json").write_text(json.dumps({"rows": [{"setting": "dense"}]}))  # not a sweep
    rows = latest.newest(latest.load_rows(tmp_path))
    got = {(r.data["setting"], r.data["context"]): (r.data["ms"], r.path.parent.name + "/" + r.path.name) for r in rows}
    assert got == {("dense", 4096): (4.7, "2026-01-02-run2/call2.json"), ("quest", 4096): (4.0, "2026-01-01-run1/call1.json")}
    text = latest.render(rows, tmp_path)
    assert "[2026-01-02-run2/call2](2026-01-02-run2/call2.json)" in text and "OOM" not in text


def test_run_folders_of_one_day_compare_their_numbers_as_numbers(tmp_path):
    _run(tmp_path / "2026-01-02-h200-run9", "call2.json", "2026-01-02", [_row("dense", 4096, 5.0)])
    _run(tmp_path / "2026-01-02-h200-run10", "call1.json", "2026-01-02", [_row("dense", 4096, 4.0)])
    (row,) = latest.newest(latest.load_rows(tmp_path))
    assert row.data["ms"] == 4.0 and row.path.parent.name == "2026-01-02-h200-run10"


def test_offloaded_rows_are_settings_of_their_own_and_say_so(tmp_path):
    """A row with layers on the host (and a page cache) does not replace the row of the same setting
    and context without them; its name gives the layers, the cache's share and its hit rate."""
    _run(tmp_path / "2026-01-01-run1", "call1.json", "2026-01-01", [_row("quest", 4096, 4.0, section="step")])
    _run(tmp_path / "2026-01-02-run2", "call1.json", "2026-01-02", [
        _row("quest", 4096, 9.0, section="step", host_layers=4),
        _row("quest", 4096, 6.0, section="step", host_layers=4, page_cache=0.15, hit_rate=0.5),
        _row("quest", 4096, 5.0, section="step", host_layers=4, page_cache=0.15, hit_rate=0.5, prefetch=True),
    ])
    rows = latest.newest(latest.load_rows(tmp_path))
    assert sorted(r.data["ms"] for r in rows) == [4.0, 5.0, 6.0, 9.0]
    text = latest.render(rows, tmp_path)
    assert "quest (offload 4 layers) |" in text and "quest (offload 4 layers, page cache 0.15, hits 0.50) |" in text
    assert "quest (offload 4 layers, page cache 0.15, hits 0.50, prefetch) |" in text


def test_tensor_parallel_rows_are_kept_per_world_size(tmp_path):
    _run(tmp_path / "2026-01-01-run1", "tp1.json", "2026-01-01", [_row("dense", 32768, 6.0, section="tp", world=1, generate_ms=6.0)])
    _run(tmp_path / "2026-01-02-run2", "tp2.json", "2026-01-02", [_row("dense", 32768, 3.5, section="tp", world=2, generate_ms=3.5)])
    rows = latest.newest(latest.load_rows(tmp_path))
    assert sorted((r.data["world"], r.data["generate_ms"]) for r in rows) == [(1, 6.0), (2, 3.5)]
    assert "Tensor-parallel" in latest.render(rows, tmp_path)


def test_generate_rows_make_the_readme_block_between_its_markers():
    row = latest.Row({"section": "generate", "setting": "dense", "context": 4096, "batch": 1, "generate_ms": 5.0, "step_ms": 4.9,
                      "generate/step": 1.02, "floor_ms": 3.6}, {"gpu": "GPU X", "date": "2026-01-01", "model": "llama-3.1-8b"},
                     latest.RESULTS / "run" / "call1.json")
    block = latest.readme_block([row])
    assert block.startswith(latest.BEGIN) and block.endswith(latest.END)
    assert "| llama-3.1-8b | dense | 4096 | 1 | 5 | 4.9 | 1.02 | 3.6 |" in block
    text = f"intro\n{latest.BEGIN}\nold\n{latest.END}\noutro\n"
    assert latest.update_readme(text, block) == f"intro\n{block}\noutro\n"


def test_the_committed_latest_and_readme_are_current():
    assert latest.main(["--check"]) == 0, "run: python -m benchmarks.latest"


def test_rows_of_a_redefined_setting_from_before_the_change_go_under_the_name_of_what_they_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(latest, "REDEFINED", {"comm": ("2026-01-02", "comm-whole")})
    _run(tmp_path / "2026-01-01-run1", "call1.json", "2026-01-01", [_row("comm", 4096, 5.0)])
    _run(tmp_path / "2026-01-02-run2", "call1.json", "2026-01-02", [_row("comm", 4096, 6.0)])
    got = {r.data["setting"]: r.data["ms"] for r in latest.newest(latest.load_rows(tmp_path))}
    assert got == {"comm-whole": 5.0, "comm": 6.0}

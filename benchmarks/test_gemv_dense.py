"""Smoke test of `benchmarks.gemv_dense` on CPU: toy sizes that no tile divides, two configs per shape,
the kernels in the Triton interpreter. Its timings mean nothing; what it checks is that every config
agrees with the reference (cuBLAS on a GPU) and that every row is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gemv_dense_runs_on_cpu(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", POLICYZOO_TRITON="1")
    out = tmp_path / "gemv-dense.json"
    cmd = [sys.executable, "-m", "benchmarks.gemv_dense", "--tiny", "--out", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-5000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [r for r in rows if "error" in r] == []
    # per shape and batch: cuBLAS, the defaults and two grid configs
    assert len(rows) == 5 * 2 * 4 and {r["shape"] for r in rows} == {"q|k|v", "gate|up", "o", "down", "lm_head"}
    assert all(r["rel_err"] < 1e-5 and r["us"] > 0 for r in rows if r["setting"] != "cublas")
    assert len(data["best"]) == 10 and "fastest config per shape" in res.stdout


def test_grid_is_modest_and_fits():
    from benchmarks.gemv_dense import grid

    for input_major in (False, True):
        for batch in (1, 4):
            configs = grid(input_major, batch)
            assert 20 <= len(configs) <= 48 and configs == grid(input_major, batch)  # seeded
            assert len({tuple(c.values()) for c in configs}) == len(configs)
            if batch > 1:
                assert min(min(c["block_n"], c["block_k"]) for c in configs) >= 16

"""CPU smoke test of `benchmarks.tp`: two gloo ranks time a sharded toy model and rank 0 writes
its rows (compiled through aot_eager: the rows' logic is what is tested here)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys


def test_two_ranks_write_their_rows(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
           str(port), "-m", "benchmarks.tp", "--tiny", "--context", "128", "--new-tokens", "8", "--settings", "dense,quest0.1",
           "--backend", "aot_eager", "--out", str(tmp_path)]  # the script's logic; Inductor's sharded step: tests/test_distributed.py
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "sweep.json").read_text())["rows"]
    assert [(r["setting"], r["world"]) for r in rows] == [("dense", 2), ("quest0.1", 2)]
    assert all(r["generate_ms"] > 0 and r["step_ms"] > 0 and r["tokens"] == 8 for r in rows)
    # one rank reads half the projections and KV but the whole LM head: between 1 and 2 times less
    assert all(1 < r["bound_vs_tp1"] < 2 for r in rows)
    assert "| dense | 2 | 128 |" in (tmp_path / "sweep.md").read_text()

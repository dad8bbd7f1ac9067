"""`policyzoo.kernels.scratch`: per-device buffers that are zero between launches, reserved eagerly."""

from __future__ import annotations

import pytest
import torch

from policyzoo.kernels import scratch


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(scratch, "_BUFFERS", {})
    monkeypatch.setattr(scratch, "_OUTGROWN", [])


def test_on_cuda_buffers_come_only_from_reserve():
    """Made during a compiled step's CUDA-graph warm-up, a buffer would sit untracked in the graph's
    pool: on CUDA `zeroed` never makes one, and answers None when none (or too few) was reserved."""
    cuda = torch.device("cuda", 0)
    assert scratch.zeroed("gemv_counters", 8, cuda) is None
    scratch._BUFFERS["gemv_counters", cuda] = torch.zeros(4, dtype=torch.int32)  # stands in for a reserved one
    assert scratch.zeroed("gemv_counters", 8, cuda) is None
    assert scratch.zeroed("gemv_counters", 4, cuda) is not None
    assert scratch.zeroed("select_histograms", 4, cuda) is None  # another name, another buffer


def test_on_cpu_buffers_are_made_on_first_use_and_zero():
    buf = scratch.zeroed("select_histograms", 10, torch.device("cpu"))
    assert buf.dtype == torch.int32 and buf.numel() >= 10 and int(buf.abs().sum()) == 0
    assert scratch.zeroed("select_histograms", 10, torch.device("cpu")) is buf


def test_reserve_makes_every_buffer_and_keeps_outgrown_ones_alive():
    scratch.reserve("cpu")
    assert {name for name, _ in scratch.buffers()} == set(scratch.SIZES)
    first = scratch.buffers()["gemv_counters", torch.device("cpu")]
    scratch.reserve("cpu", "gemv_counters", first.numel() + 1)
    grown = scratch.buffers()["gemv_counters", torch.device("cpu")]
    assert grown.numel() == first.numel() + 1 and any(t is first for t in scratch._OUTGROWN)
    scratch.reserve("cpu", "gemv_counters", 1)  # never shrinks
    assert scratch.buffers()["gemv_counters", torch.device("cpu")] is grown

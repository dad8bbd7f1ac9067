"""`policyzoo.kernels.Workspace`: per-device buffers that are zero between launches, owned by the
caller and made eagerly; without one, an op makes what it needs per call."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from policyzoo import kernels
from policyzoo.kernels import workspace
from policyzoo.kernels.workspace import SIZES, Workspace, buffer, zeroed


def test_a_workspace_holds_every_buffer_zeroed():
    ws = Workspace("cpu")
    assert set(ws.buffers) == set(SIZES)
    for name, buf in ws.buffers.items():
        assert buf.dtype == torch.int32 and buf.numel() == SIZES[name] and int(buf.abs().sum()) == 0
        assert getattr(ws, name) is buf  # a plain attribute, which a compiled step reads as such
    assert ws.prefetch_stream is None and ws.prefetch_stream_ids is None  # no side stream off CUDA
    assert buffer(ws, "select_histograms") is ws.select_histograms and buffer(None, "gemv_sums") is None


def test_a_workspace_is_a_value():
    ws = Workspace("cpu", sizes={"gemv_counters": 8})
    with pytest.raises(dataclasses.FrozenInstanceError):
        ws.gemv_counters = torch.zeros(16, dtype=torch.int32)
    assert ws.select_histograms is None and buffer(ws, "select_histograms") is None  # the ops make theirs per call
    assert set(ws.buffers) == {"gemv_counters"}
    with pytest.raises(ValueError, match="unknown workspace buffers"):
        Workspace("cpu", sizes={"histograms": 8})
    assert Workspace("cpu") != Workspace("cpu")  # each owns its buffers: equal only to itself


def test_zeroed_takes_the_workspace_buffer_when_it_is_large_enough():
    """A buffer large enough is used as it is; a call that needs more, or has no workspace, gets new
    zeros of its own (so a call never fails for want of scratch)."""
    ws = Workspace("cpu", sizes={"gemv_counters": 8})
    own = ws.buffers["gemv_counters"]
    assert zeroed(own, 8, torch.device("cpu")) is own
    bigger = zeroed(own, 9, torch.device("cpu"))
    assert bigger is not own and bigger.numel() == 9 and int(bigger.abs().sum()) == 0
    fresh = zeroed(None, 4, torch.device("cpu"))
    assert fresh.dtype == torch.int32 and fresh.numel() == 4 and int(fresh.abs().sum()) == 0


def test_kernels_exports_the_workspace():
    assert kernels.Workspace is workspace.Workspace

"""Scratch buffers that kernels keep per device, zero between launches (the launch that used them
leaves them zero), so a call needs no memset: the arrival counters of the sparse GEMV, its
fp32 sums (`GemvConfig.atomic_sum`) and `select_top`'s histograms.

They are made eagerly by `reserve`, never inside a decode step: made during torch.compile's
CUDA-graph warm-up, a buffer would sit untracked in the graph's memory pool, which cudagraph trees
refuse ("tensor(s) in the cudagraph pool not tracked as outputs").
A `Decoder` on CUDA reserves them when it wraps a model, and so does `ProjectionSparsifier.install`.
A kernel that finds none (or too few) takes its path without them. On CPU (the interpreter, no
graphs) they are made on first use.

Two launches running at the same time on different streams would share a buffer: a decode step
runs them one after another on one stream, and a CUDA graph captured from one stream keeps that
order.
"""

from __future__ import annotations

import torch
from torch import Tensor

# int32 entries reserved per device: output blocks x batch rows of the GEMV (gate|up has 448 blocks
# of 64, so up to batch 146), its fp32 sums with `GemvConfig.atomic_sum` (outputs x batch rows:
# gate|up of an 8B model up to batch 16), and 512 bins x rows of `select_top` (up to 512 rows).
SIZES = {"gemv_counters": 65536, "gemv_sums": 16 * 28672, "select_histograms": 512 * 512}

_BUFFERS: dict[tuple[str, torch.device], Tensor] = {}
_OUTGROWN: list[Tensor] = []  # buffers a larger one replaced: a recorded CUDA graph may still use them


def _device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def reserve(device: torch.device | str, name: str | None = None, n: int | None = None) -> None:
    """Make buffer ``name`` (every buffer in `SIZES` when None) of at least ``n`` entries (its
    `SIZES` entry by default) on ``device``, zeroed, outside any CUDA graph."""
    device = _device(device)
    for key in (name,) if name is not None else tuple(SIZES):
        size = n if n is not None else SIZES[key]
        buf = _BUFFERS.get((key, device))
        if buf is None or buf.numel() < size:
            if buf is not None:
                _OUTGROWN.append(buf)
            _BUFFERS[key, device] = torch.zeros(size, dtype=torch.int32, device=device)


def zeroed(name: str, n: int, device: torch.device) -> Tensor | None:
    """The reserved buffer ``name`` if it has ``n`` entries at least, else None (never made here on
    CUDA)."""
    device = _device(device)
    if device.type != "cuda":
        reserve(device, name, max(n, SIZES[name]))
    buf = _BUFFERS.get((name, device))
    return buf if buf is not None and buf.numel() >= n else None


def buffers() -> dict[tuple[str, torch.device], Tensor]:
    """Every buffer made so far (tests check they are back to zero after each launch)."""
    return dict(_BUFFERS)


__all__ = ["SIZES", "reserve", "zeroed", "buffers"]

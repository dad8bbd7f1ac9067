"""`Workspace`: the scratch that one device's kernels share, owned by whoever drives them.

Some launches need memory that is zero when they start and that they leave zero: the arrival
counters of the sparse GEMV, its fp32 sums (`GemvConfig.atomic_sum`), and the histograms of
`select_top` and of the fused selection (`select_pages`, `select_scores`), and the entmax threshold's
barrier counters.
A `Workspace` holds them for one device, made zeroed at once, with the device's prefetch stream
(`kernels.prefetch_pages`). Whoever drives the kernels owns one and passes it to the ops that take
``workspace=`` (a `Decoder` on CUDA makes one per device; the KV policies reach it through
`KVState.workspace`, the projection wrappers get it at install).

Make it eagerly, never inside a decode step: made during a CUDA-graph capture or warm-up, its
buffers would sit in the graph's memory pool. Without a workspace (``workspace=None``) an op makes
what it needs per call (`zeroed`): the same results, at the cost of a memset per launch.

Two launches that share a buffer must not run at the same time: a decode step runs them one after
another on one stream, and a CUDA graph captured from one stream keeps that order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

import torch
from torch import Tensor

# int32 entries per buffer: output blocks x batch rows of the GEMV (gate|up has 448 blocks of 64, so
# up to batch 146), its fp32 sums with `GemvConfig.atomic_sum` (outputs x batch rows: gate|up of an
# 8B model up to batch 16), and the selections' histograms: 512 bins x rows of `select_top` (up to
# 1,024 rows), or 4,096 bins and 2 counters x rows of `select_pages` (up to 127 rows: batch 15 at 8
# KV heads). The two never run at once (one stream), and each leaves the buffer zero. Then 2 barrier
# counters x rows of the entmax threshold (rows: batch x query heads, up to batch 128 at 32 heads).
SIZES: Mapping[str, int] = MappingProxyType(
    {"gemv_counters": 65536, "gemv_sums": 16 * 28672, "select_histograms": 1 << 19, "barrier_counters": 8192}
)


def _device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@dataclasses.dataclass(frozen=True, init=False, eq=False)
class Workspace:
    """Zeroed int32 buffers (`SIZES`, or ``sizes``) and the prefetch stream of one ``device`` (CUDA
    only; `kernels.prefetch_pages_op`).

    A value: nothing in it is reassigned after it is made (the kernels write its buffers and leave
    them zero). A buffer ``sizes`` leaves out is None, and a call that needs more than a buffer holds
    makes its own for that call (`zeroed`). Its parts are plain attributes, which a compiled step
    reads without a graph break."""

    device: torch.device
    gemv_counters: Tensor | None
    gemv_sums: Tensor | None
    select_histograms: Tensor | None
    barrier_counters: Tensor | None
    prefetch_stream: torch.cuda.Stream | None
    prefetch_stream_ids: tuple[int, int, int] | None
    """The prefetch stream as an op argument names it (a custom op takes no stream object)."""

    def __init__(self, device: torch.device | str, sizes: Mapping[str, int] = SIZES) -> None:
        device = _device(device)
        unknown = set(sizes) - set(SIZES)
        if unknown:
            raise ValueError(f"unknown workspace buffers {sorted(unknown)}; known: {sorted(SIZES)}")
        cuda = device.type == "cuda"
        parts: dict[str, object] = {"device": device}
        for name in SIZES:
            buf = torch.zeros(sizes[name], dtype=torch.int32, device=device) if name in sizes else None
            if buf is not None and cuda:
                torch._dynamo.mark_static_address(buf)  # fixed addresses: a compiled step reads them in its graph
            parts[name] = buf
        stream = torch.cuda.Stream(device=device) if cuda else None
        parts["prefetch_stream"] = stream
        parts["prefetch_stream_ids"] = None if stream is None else (stream.stream_id, stream.device_index, stream.device_type)
        for name, value in parts.items():
            object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return f"Workspace({self.device}, {dict((k, v.numel()) for k, v in self.buffers.items())})"

    @property
    def buffers(self) -> dict[str, Tensor]:
        """Its buffers by name (`SIZES`), those it has."""
        return {name: getattr(self, name) for name in SIZES if getattr(self, name) is not None}


def buffer(workspace: Workspace | None, name: str) -> Tensor | None:
    """``workspace``'s buffer ``name`` (`SIZES`), or None without a workspace or that buffer."""
    return None if workspace is None else getattr(workspace, name)


def zeroed(buf: Tensor | None, n: int, device: torch.device) -> Tensor:
    """``buf`` when it holds ``n`` entries on ``device``, else ``n`` new int32 zeros there for this call."""
    if buf is not None and buf.numel() >= n and buf.device == device:
        return buf
    return torch.zeros(n, dtype=torch.int32, device=device)


__all__ = ["SIZES", "Workspace", "buffer", "zeroed"]

"""`Workspace`: the scratch that one device's kernels share, owned by whoever drives them.

Some launches need memory that is zero when they start and that they leave zero: the arrival
counters of the sparse GEMV, its fp32 sums (`GemvConfig.atomic_sum`) and `select_top`'s histograms.
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

from collections.abc import Mapping
from types import MappingProxyType

import torch
from torch import Tensor

# int32 entries per buffer: output blocks x batch rows of the GEMV (gate|up has 448 blocks of 64, so
# up to batch 146), its fp32 sums with `GemvConfig.atomic_sum` (outputs x batch rows: gate|up of an
# 8B model up to batch 16), and 512 bins x rows of `select_top` (up to 512 rows).
SIZES: Mapping[str, int] = MappingProxyType(
    {"gemv_counters": 65536, "gemv_sums": 16 * 28672, "select_histograms": 512 * 512}
)


def _device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class Workspace:
    """Zeroed int32 buffers (`SIZES`, or ``sizes``) and the prefetch stream of one ``device`` (CUDA
    only; `kernels.prefetch_pages_op`).

    Nothing in it is reassigned after it is made: the kernels write its buffers and leave them zero.
    A call that needs more than a buffer holds makes its own for that call (`zeroed`)."""

    def __init__(self, device: torch.device | str, sizes: Mapping[str, int] = SIZES) -> None:
        self.device = _device(device)
        unknown = set(sizes) - set(SIZES)
        if unknown:
            raise ValueError(f"unknown workspace buffers {sorted(unknown)}; known: {sorted(SIZES)}")
        self.buffers: Mapping[str, Tensor] = MappingProxyType(
            {name: torch.zeros(n, dtype=torch.int32, device=self.device) for name, n in sizes.items()}
        )
        self.prefetch_stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        # How an op argument names the stream (a custom op takes no stream object): plain ints.
        self.prefetch_stream_ids: tuple[int, int, int] | None = None
        if self.prefetch_stream is not None:
            s = self.prefetch_stream
            self.prefetch_stream_ids = (s.stream_id, s.device_index, s.device_type)
        if self.device.type == "cuda":
            for buf in self.buffers.values():  # fixed addresses: a compiled step reads them in its graph
                torch._dynamo.mark_static_address(buf)

    def __repr__(self) -> str:
        return f"Workspace({self.device}, {dict((k, v.numel()) for k, v in self.buffers.items())})"

    def buffer(self, name: str) -> Tensor | None:
        """Buffer ``name`` (`SIZES`), or None when this workspace has none."""
        if name not in SIZES:
            raise KeyError(f"unknown workspace buffer {name!r}; known: {sorted(SIZES)}")
        return self.buffers.get(name)


def buffer(workspace: Workspace | None, name: str) -> Tensor | None:
    """``workspace``'s buffer ``name``, or None without a workspace."""
    return None if workspace is None else workspace.buffer(name)


def zeroed(buf: Tensor | None, n: int, device: torch.device) -> Tensor:
    """``buf`` when it holds ``n`` entries on ``device``, else ``n`` new int32 zeros there for this call."""
    if buf is not None and buf.numel() >= n and buf.device == device:
        return buf
    return torch.zeros(n, dtype=torch.int32, device=device)


__all__ = ["SIZES", "Workspace", "buffer", "zeroed"]

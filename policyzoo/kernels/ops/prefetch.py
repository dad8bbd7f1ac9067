"""Page prefetch on a side stream: the ops ``policyzoo::prefetch_pages`` and
``policyzoo::wait_for_prefetch``.

An offloaded layer's page cache (`offload.PageCache`) can stage the next layer's predicted pages
while this layer runs: ``prefetch_pages`` forks to the workspace's prefetch stream and stages there;
the next layer's ``wait_for_prefetch`` makes its stream wait for that one before its own lookup. Each
is one custom op, so that a compiled step keeps it whole and its CUDA graph captures the fork and the
join. Without a workspace (``workspace=None``), or off CUDA, the staging runs inline on the current
stream and there is nothing to wait for: the same pages, without the overlap.

What staging is belongs to the page cache: `prefetch_pages_op` defines the op around its ``stage``
function (the page cache's tensors in, nothing out), so this module needs nothing from `offload`.
No kernel of its own: staging launches `page_fetch`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..workspace import Workspace

# What a prefetch mutates: the page cache's slots and maps (`PageCache._state`).
STATE = ("keys", "values", "page_slot", "slot_page", "last_used", "clock", "fetched")


def _side_stream(stream: Sequence[int]) -> torch.cuda.Stream | None:
    """The stream a workspace names by ``(stream_id, device_index, device_type)``; None for ``()``."""
    if not stream:
        return None
    stream_id, device_index, device_type = stream
    return torch.cuda.Stream(stream_id=stream_id, device_index=device_index, device_type=device_type)


def _stream_of(workspace: Workspace | None) -> tuple[int, ...]:
    return () if workspace is None or workspace.prefetch_stream_ids is None else workspace.prefetch_stream_ids


def prefetch_pages_op(stage: Callable[..., None]) -> Callable[..., None]:
    """Define ``policyzoo::prefetch_pages`` around ``stage(indices, count, host_keys, host_values,
    length, keys, values, page_slot, slot_page, last_used, clock, fetched, page_size)``, which stages
    the predicted page selection ahead into the page cache's tensors; return the function that calls
    it (same arguments, and ``workspace=``: its prefetch stream runs the staging). Called once, by the
    page cache's module."""

    @torch.library.custom_op("policyzoo::prefetch_pages", mutates_args=STATE)
    def _prefetch_pages(indices: Tensor, count: Tensor, host_keys: Tensor, host_values: Tensor, length: Tensor,
                        keys: Tensor, values: Tensor, page_slot: Tensor, slot_page: Tensor, last_used: Tensor,
                        clock: Tensor, fetched: Tensor, page_size: int, stream: Sequence[int]) -> None:
        args = (indices, count, host_keys, host_values, length, keys, values, page_slot, slot_page, last_used, clock,
                fetched, page_size)
        side = _side_stream(stream) if keys.device.type == "cuda" else None
        if side is None:
            stage(*args)
            return
        side.wait_stream(torch.cuda.current_stream(keys.device))
        for t in (indices, count):  # made on the main stream, read on the side one: not reused before it is done
            t.record_stream(side)
        with torch.cuda.stream(side):
            stage(*args)

    @_prefetch_pages.register_fake
    def _(indices, count, host_keys, host_values, length, keys, values, page_slot, slot_page, last_used, clock,
          fetched, page_size, stream):
        return None

    def prefetch_pages(indices: Tensor, count: Tensor, host_keys: Tensor, host_values: Tensor, length: Tensor,
                       keys: Tensor, values: Tensor, page_slot: Tensor, slot_page: Tensor, last_used: Tensor,
                       clock: Tensor, fetched: Tensor, page_size: int, *, workspace: Workspace | None = None) -> None:
        torch.ops.policyzoo.prefetch_pages(indices, count, host_keys, host_values, length, keys, values, page_slot,
                                           slot_page, last_used, clock, fetched, page_size, _stream_of(workspace))

    return prefetch_pages


@torch.library.custom_op("policyzoo::wait_for_prefetch", mutates_args=("page_slot",))
def _wait_for_prefetch_op(page_slot: Tensor, after: Tensor, stream: Sequence[int]) -> None:
    side = _side_stream(stream) if page_slot.device.type == "cuda" else None
    if side is not None:
        torch.cuda.current_stream(page_slot.device).wait_stream(side)


@_wait_for_prefetch_op.register_fake
def _(page_slot, after, stream):
    return None


def wait_for_prefetch(page_slot: Tensor, after: Tensor, *, workspace: Workspace | None = None) -> None:
    """Make the current stream wait for ``workspace``'s prefetch stream (nothing without one). Issued
    once ``after`` (e.g. the layer's query) exists, so that a compiler cannot move the wait up to the
    prefetch; ``page_slot``, the page cache's map that the prefetch wrote, orders it before the lookup."""
    torch.ops.policyzoo.wait_for_prefetch(page_slot, after, _stream_of(workspace))


__all__ = ["prefetch_pages_op", "wait_for_prefetch"]

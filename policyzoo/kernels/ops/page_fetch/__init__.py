"""The page fetch: the op ``policyzoo::page_fetch``, copies of listed pages into a page cache's slots.

Specification: ``reference.py``; kernel: ``kernel.py`` (persistent programs reading pinned host
memory in place). Launch parameters: `PageFetchConfig`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ...config import LaunchConfig, current, positive, powers_of_two
from ...route import HAS_TRITON, need_triton, routed
from . import reference

if HAS_TRITON:
    from . import kernel


@dataclasses.dataclass(frozen=True, kw_only=True)
class PageFetchConfig(LaunchConfig):
    """Launch parameters of the page fetch: persistent programs, each taking every ``programs``-th
    page of the list. 32 programs reading pinned host pages in place draw the host link's full rate
    on an H200."""

    keyword = "page_fetch"

    programs: int = 32
    """Persistent programs (each copies one page at a time)."""
    num_warps: int = 4
    """Warps per program."""

    def __post_init__(self) -> None:
        positive(self, "programs")
        powers_of_two(self, "num_warps")


@torch.library.custom_op("policyzoo::page_fetch", mutates_args=("dst_keys", "dst_values"))
def _page_fetch_op(
    src_keys: Tensor, src_values: Tensor, dst_keys: Tensor, dst_values: Tensor,
    src_pages: Tensor, dst_pages: Tensor, count: Tensor, page_size: int,
) -> None:
    need_triton()
    cfg = current(PageFetchConfig)
    kernel.page_fetch(src_keys, src_values, dst_keys, dst_values, src_pages, dst_pages, count, page_size, cfg)


@_page_fetch_op.register_fake
def _(src_keys, src_values, dst_keys, dst_values, src_pages, dst_pages, count, page_size):
    return None


@routed(reference.page_fetch)
def page_fetch(
    src_keys: Tensor, src_values: Tensor, dst_keys: Tensor, dst_values: Tensor,
    src_pages: Tensor, dst_pages: Tensor, count: Tensor, page_size: int,
) -> None:
    """Copy listed pages of a cache into a page cache's slots, in place; see `reference.page_fetch`
    (the kernel copies only the entries below ``count``)."""
    torch.ops.policyzoo.page_fetch(src_keys, src_values, dst_keys, dst_values, src_pages, dst_pages, count, page_size)


__all__ = ["PageFetchConfig", "page_fetch"]

"""The decode step's cache append: the op ``policyzoo::cache_append``, in place.

`cache_append` writes a decode token at slot ``length - 1`` and refreshes its page's kept summaries.
Specification: ``reference.py``; kernel: ``kernel.py`` (one launch; its warps follow the page size
and head dim, so it has no launch config).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...route import HAS_TRITON, need_triton, routed
from . import reference

if HAS_TRITON:
    from . import kernel


@torch.library.custom_op(
    "policyzoo::cache_append", mutates_args=("keys", "values", "page_min", "page_max", "page_mean", "page_std")
)
def _cache_append_op(
    k: Tensor,
    v: Tensor,
    keys: Tensor,
    values: Tensor,
    page_min: Tensor,
    page_max: Tensor,
    page_mean: Tensor,
    page_std: Tensor,
    start: Tensor,
    length: Tensor,
    page_size: int,
) -> None:
    need_triton()
    kept = tuple(s if s.numel() else None for s in (page_min, page_max, page_mean, page_std))
    kernel.cache_append(k, v, keys, values, kept, start, length, page_size)


@_cache_append_op.register_fake
def _(k, v, keys, values, page_min, page_max, page_mean, page_std, start, length, page_size):
    return None


@routed(reference.cache_append)
def cache_append(
    k: Tensor,
    v: Tensor,
    keys: Tensor,
    values: Tensor,
    summaries: tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None],
    start: Tensor,
    length: Tensor,
    page_size: int,
) -> None:
    """Write a decode token at slot ``length - 1`` and refresh its page's kept summaries, in place;
    see `reference.cache_append`. On the kernel path a summary the cache does not keep travels as an
    empty tensor (an op's mutable arguments cannot be optional in every torch this runs on)."""
    absent = [keys.new_empty(0) if s is None else s for s in summaries]
    torch.ops.policyzoo.cache_append(k, v, keys, values, *absent, start, length, int(page_size))


__all__ = ["cache_append"]

"""The page fetch's specification, in plain torch."""

from __future__ import annotations

from torch import Tensor


def page_fetch(
    src_keys: Tensor, src_values: Tensor, dst_keys: Tensor, dst_values: Tensor,
    src_pages: Tensor, dst_pages: Tensor, count: Tensor, page_size: int,
) -> None:
    """Copy pages of ``src_keys, src_values [..., N, D]`` into pages of ``dst_keys, dst_values [..., S, D]``,
    in place: list entry ``i < count`` copies flat source page ``src_pages[i]`` (rows
    ``src_pages[i]·page_size ..`` of the source viewed as ``[rows, D]``) to flat destination page
    ``dst_pages[i]``. Entries at or past ``count`` may be copied too (this reference copies every entry
    without reading ``count``), so a caller points them at a scratch page nothing reads.
    ``src_pages, dst_pages int64[M]``, ``count int64[1]``."""
    d = src_keys.shape[-1]
    for src, dst in ((src_keys, dst_keys), (src_values, dst_values)):
        pages = dst.view(-1, page_size, d)
        pages.index_copy_(0, dst_pages, src.reshape(-1, page_size, d).index_select(0, src_pages).to(dst.dtype))


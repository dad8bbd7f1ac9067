"""Page fetch (Triton): copy listed pages of a cache into the slots of a page cache; spec:
`reference.page_fetch`, beside this file.

An offloaded layer's keys and values live in pinned host memory (`offload.host_tensor`); its page
cache (`offload.PageCache`) keeps device copies of the pages it fetched. This kernel makes the
copies: copy engines pay a fixed cost per transfer, far too much for pages of a few KB, while loads
by SMs from the pinned memory's unified address run at the host link's rate even for small pages.

The programs are persistent (`PageFetchConfig.programs`): program ``i`` copies list entries
``i, i + programs, ..`` below ``count``, read on the device, so one launch serves any number of
misses and the step stays the same CUDA graph. The list holds flat page numbers: source page ``p``
is rows ``p·page .. p·page + page - 1`` of the source viewed as ``[rows, D]``, and the same for
destination slots.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _page_fetch_kernel(
    src_k, src_v, dst_k, dst_v, src_pages, dst_pages, count_ptr,
    D: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr, PAGE_PAD: tl.constexpr,
):
    n = tl.load(count_ptr)
    offs_t = tl.arange(0, PAGE_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_t[:, None] < PAGE) & (offs_d[None, :] < D)
    tile = offs_t[:, None] * D + offs_d[None, :]
    for i in range(tl.program_id(0), n, tl.num_programs(0)):
        src = tl.load(src_pages + i).to(tl.int64) * (PAGE * D) + tile
        dst = tl.load(dst_pages + i).to(tl.int64) * (PAGE * D) + tile
        tl.store(dst_k + dst, tl.load(src_k + src, mask=mask), mask=mask)
        tl.store(dst_v + dst, tl.load(src_v + src, mask=mask), mask=mask)


def page_fetch(
    src_keys: Tensor, src_values: Tensor, dst_keys: Tensor, dst_values: Tensor,
    src_pages: Tensor, dst_pages: Tensor, count: Tensor, page_size: int, cfg,
) -> None:
    """Launch the kernel with ``cfg`` (a `PageFetchConfig`); arguments as `reference.page_fetch`."""
    for name, t in (("src_keys", src_keys), ("src_values", src_values), ("dst_keys", dst_keys), ("dst_values", dst_values)):
        if not t.is_contiguous():
            raise ValueError(f"page_fetch needs contiguous keys and values; {name} is not")
    d = src_keys.shape[-1]
    programs = max(1, min(cfg.programs, src_pages.numel()))
    _page_fetch_kernel[(programs,)](
        src_keys, src_values, dst_keys, dst_values, src_pages, dst_pages, count.reshape(1),
        D=d, D_PAD=triton.next_power_of_2(d), PAGE=page_size, PAGE_PAD=triton.next_power_of_2(page_size),
        num_warps=cfg.num_warps,
    )

"""`Offload`: whole layers' keys and values in pinned host memory, read by the GPU in place or
through a device cache of the pages they last selected.

A 1M-token cache of an 8B model (Llama-3.1-8B: 128 KiB per token) is 128 GiB. That does not fit
beside the weights on one 141 GB GPU, which holds about 928K tokens. `Decoder(model, kv=Quest(0.1),
offload=Offload(layers=8))` keeps the keys and values of the last 8 layers in pinned host memory,
exposed to CUDA as device tensors at the pinned buffer's unified address (`host_tensor`):
- Kernels read and write them in place over the host link (about 50 GB/s on an H200's PCIe host,
  against the GPU memory's 4.3 TB/s).
- Nothing else changes: the attention function, the Triton kernels, `torch.compile` and CUDA
  graphs see an ordinary CUDA tensor.

Every layer's page summaries stay on the GPU, as do the other layers' keys and values. A page
policy (`Quest`, `SSA`'s proxy, ...) therefore scores pages without touching the host. Over the
link, a step reads only the selected pages of the offloaded layers (`bytes.ByteAccount.host_bytes`),
plus the one token each layer appends.

With ``Offload(layers=8, cache=0.15)`` each offloaded layer also keeps a `PageCache`: device slots
for 15% of its pages, holding copies of the pages it selected most recently. Consecutive decode
steps select mostly the same pages, so a step fetches only the pages it did not select lately (one
`kernels.page_fetch` launch per layer) and the attention reads every selected page from the device
(`kernels.decode_attention`'s ``slots``). The link then carries the misses only: a step's host
bytes are ``1 - hit_rate`` of the synchronous form's. The cache applies to page selections (a block
of one page, or of several, which it splits into pages); a token-level selection reads the host in
place as before.

A policy that knows the next layer's selection while it selects for this one (`kv.Forecast`, whose
head at layer l predicts layer l+1's blocks; `kv.PrHS` where layer l+1 shares layer l's selection:
`KVSelector.predicts_layer`) has that layer's pages fetched ahead: at layer l the page cache of layer
l+1 stages the predicted selection on a side stream (`PageCache.prefetch`) while layer l attends and
runs its MLP, and layer l+1's main stream waits for it before its own lookup (`PageCache.wait_for_prefetch`).
A predicted page that has not arrived makes the step wait; a page the prediction missed is fetched
at the layer's own lookup as without prefetch, so the step reads the same values either way. Overlap
hides at most the device time of the layer before, so where the link carries far more than the GPU
does (1M tokens, 8 layers offloaded) the fetches it saves matter more than the prefetch.

On a CPU device the cache is in host memory anyway: the layers are ordinary tensors, and decoding is
the same as without offload (a page cache, if asked for, copies pages between host tensors: it
serves the tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

import torch
from torch import Tensor

from . import kernels
from .selection import Selection

# The array-interface type of each element size: the bytes are wrapped as integers of that size and
# viewed as the cache's dtype (the interface has no bfloat16).
_TYPESTR = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}
_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Offload:
    """Which layers keep their keys and values in pinned host memory (module docstring).

    Args:
        layers: an int ``n``, the last ``n`` layers; or the layer indices themselves.
        cache: the share of each offloaded layer's pages that a device `PageCache` holds (0: none,
            every selected page is read over the link at every step). It must hold a whole
            selection: at least the policy's budget, plus room for the pages selected lately
            (``1.5`` times the budget is a good start, e.g. ``0.15`` for ``Quest(0.1)``).
        prefetch: with a page cache and a policy that makes the next layer's selection early
            (`KVSelector.predicts_layer`), fetch an offloaded layer's pages while the layer before it
            runs (`PageCache.prefetch`). ``False`` fetches them at the layer's own lookup (to compare).
    """

    layers: int | tuple[int, ...] = 1
    cache: float = 0.0
    prefetch: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.cache, bool) or not isinstance(self.cache, (int, float)) or not 0.0 <= self.cache <= 1.0:
            raise ValueError(f"cache must be a share of the pages in [0, 1], got {self.cache!r}")
        if not isinstance(self.prefetch, bool):
            raise TypeError(f"prefetch must be a bool, got {self.prefetch!r}")
        layers = self.layers
        if isinstance(layers, bool):
            raise TypeError(f"layers must be an int or a tuple of layer indices, got {layers!r}")
        if isinstance(layers, int):
            if layers < 1:
                raise ValueError(f"layers must be at least 1 (no offload: leave offload=None), got {layers}")
            return
        if not isinstance(layers, Sequence) or not layers or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
            raise TypeError(f"layers must be an int or a non-empty tuple of layer indices, got {layers!r}")
        if len(set(layers)) != len(layers) or min(layers) < 0:
            raise ValueError(f"layer indices must be distinct and >= 0, got {tuple(layers)}")
        object.__setattr__(self, "layers", tuple(sorted(layers)))

    def host_layers(self, num_layers: int) -> frozenset[int]:
        """The offloaded layer indices of a model with ``num_layers`` layers."""
        if isinstance(self.layers, int):
            if self.layers > num_layers:
                raise ValueError(f"Offload(layers={self.layers}) asks for more layers than the model's {num_layers}")
            return frozenset(range(num_layers - self.layers, num_layers))
        if max(self.layers) >= num_layers:
            raise ValueError(f"Offload(layers={self.layers}) names layer {max(self.layers)}; the model has {num_layers}")
        return frozenset(self.layers)


    def cache_slots(self, num_pages: int) -> int:
        """Slots per (row, KV head) of each offloaded layer's page cache, for a cache of ``num_pages``
        pages (0: no page cache)."""
        return math.ceil(self.cache * num_pages) if self.cache > 0 else 0


def host_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Zeros in host memory, as a tensor of ``device``.

    On CUDA the memory is pinned (page-locked) and the tensor is a CUDA tensor at its unified address.
    Kernels read and write it in place over the host link, and it keeps the pinned buffer alive. On
    other devices it is a plain tensor: a CPU cache is in host memory already.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return torch.zeros(shape, dtype=dtype, device=device)
    host = torch.zeros(shape, dtype=dtype, pin_memory=True)
    size = host.element_size()
    wrapped = torch.as_tensor(_PinnedBuffer(host.view(_INTEGER[size])), device=device)
    return wrapped.view(dtype)


class _PinnedBuffer:
    """A pinned host tensor as the CUDA array interface sees it (its unified address). The tensor that
    `torch.as_tensor` makes from it holds a reference to it, so the pinned buffer lives as long."""

    def __init__(self, host: Tensor) -> None:
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": _TYPESTR[host.element_size()],
            "data": (host.data_ptr(), False),
            "strides": None,
            "version": 3,
        }


class PageCounts(NamedTuple):
    """A page cache's counts: selected pages looked up, found on the device at the lookup, and
    fetched over the link (at lookups and prefetches)."""

    hits: int
    lookups: int
    fetched: int

    @property
    def hit_rate(self) -> float:
        """Share of the looked-up pages that the link did not carry: ``1 - fetched / lookups`` (NaN
        before any lookup). Without prefetch these are the pages found on the device; with it,
        pages fetched ahead count as carried, so this is always the byte account's."""
        return 1.0 - self.fetched / self.lookups if self.lookups else float("nan")

    def __sub__(self, other: "PageCounts") -> "PageCounts":  # type: ignore[override]
        return PageCounts(*(a - b for a, b in zip(self, other)))

    @staticmethod
    def sum(counts: Iterable["PageCounts"]) -> "PageCounts":
        """Field by field (zero counts for none)."""
        return PageCounts(*(sum(field) for field in zip(PageCounts(0, 0, 0), *counts)))


class PageCache:
    """Device copies of one offloaded layer's pages: the pages it selected most recently, reused
    across decode steps, so that the host link carries only the pages it did not select lately.

    Per (row, KV head), ``slots`` slots of one page each (`keys`, `values` ``[B, H_kv, (slots+1)·page,
    D]``; the last slot is scratch for the fetch list's padding) and the maps between pages and slots.
    `stage` runs in the decode step, before the layer's attention:

    1. look the selected pages up (``page_slot``): hits are read from their slots;
    2. give each miss the least recently used slot not holding a page of this selection, evicting
       its page;
    3. copy the misses in from the host (`kernels.page_fetch`, one launch);
    4. return every entry's slot, which the attention reads (`kernels.decode_attention`'s ``slots``).

    A page is kept for later steps only once complete before this step's token: the newest page
    still grows, and a step can be redone with other values for its token (`DecodeSession.redo_dense`),
    so a copy of either could go stale. It is fetched again while it grows: one page per head.
    Anything that rewrites earlier tokens must forget their pages: a new request clears the cache,
    `PagedKVCache.rewind` forgets the pages from the new length on (`forget_from`).

    All shapes are fixed and nothing syncs with the host, so a compiled step captures it in its
    CUDA graph. ``hits`` and ``lookups`` count selected pages found and looked up since `clear`.
    """

    def __init__(self, batch: int, num_kv_heads: int, head_dim: int, num_pages: int, slots: int, page_size: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        if slots < 1:
            raise ValueError(f"a page cache needs at least one slot, got {slots}")
        self.num_pages, self.slots, self.page_size = num_pages, slots, page_size
        shape = (batch, num_kv_heads, (slots + 1) * page_size, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        # Column num_pages of page_slot and slot `slots` of slot_page and last_used take the writes of
        # masked entries; they are reset after each update.
        self.page_slot = torch.full((batch, num_kv_heads, num_pages + 1), -1, dtype=torch.int32, device=device)
        self.slot_page = torch.full((batch, num_kv_heads, slots + 1), num_pages, dtype=torch.int64, device=device)
        self.last_used = torch.zeros((batch, num_kv_heads, slots + 1), dtype=torch.int64, device=device)
        self.clock = torch.zeros((), dtype=torch.int64, device=device)
        self.hits = torch.zeros((), dtype=torch.int64, device=device)
        self.lookups = torch.zeros((), dtype=torch.int64, device=device)
        self.fetched = torch.zeros((), dtype=torch.int64, device=device)

    def tensors(self) -> list[Tensor]:
        """Every tensor it owns (static addresses for CUDA graphs, memory accounting)."""
        return [self.keys, self.values, self.page_slot, self.slot_page, self.last_used, self.clock, self.hits,
                self.lookups, self.fetched]

    def clear(self) -> None:
        """Forget every page (their host copies changed) and the hit counts."""
        self.page_slot.fill_(-1)
        self.slot_page.fill_(self.num_pages)
        self.last_used.zero_()
        self.clock.zero_()
        self.hits.zero_()
        self.lookups.zero_()
        self.fetched.zero_()

    def forget_from(self, page: int) -> None:
        """Forget the copies of pages ``page`` and later (their slots will be written again, e.g.
        after `PagedKVCache.rewind`); the earlier pages' copies stay valid."""
        self.page_slot[..., page:] = -1
        stale = self.slot_page >= page  # empty slots hold num_pages: marking them again is harmless
        self.slot_page.masked_fill_(stale, self.num_pages)
        self.last_used.masked_fill_(stale, 0)

    def counts(self) -> PageCounts:
        """Its counts since `clear` (read from the device)."""
        return PageCounts(int(self.hits), int(self.lookups), int(self.fetched))

    def hit_rate(self) -> float:
        """`PageCounts.hit_rate` since `clear`."""
        return self.counts().hit_rate

    def stage(self, sel: Selection, host_keys: Tensor, host_values: Tensor, length: Tensor, ahead: bool = False) -> Tensor:
        """Bring the pages of page selection ``sel`` (``block`` = the page size) into the slots and
        return each entry's slot, ``int32`` shaped as ``sel.indices`` (`PageCache` steps 1-4).
        ``host_keys, host_values [B, H_kv, capacity, D]``: the layer's cache; ``length``: the cache's,
        this step's token included. ``ahead``: a prefetch (`prefetch`), which stages complete pages
        only and counts them as fetched but not as looked up (the layer's own lookup counts them)."""
        n, s, page = self.num_pages, self.slots, self.page_size
        if sel.block != page:
            raise ValueError(f"a page cache takes selections of pages of {page} tokens, got blocks of {sel.block}")
        if sel.k_max > s:
            raise ValueError(f"the selection has up to {sel.k_max} pages per head; the page cache holds {s}: "
                             f"raise Offload(cache=...) to at least {sel.k_max / n:.3f}")
        idx = sel.indices.long()
        valid = sel.entry_valid() & (idx >= 0) & (idx < n) & (idx * page < length)  # a block's future pages: nothing to read
        if ahead:  # a page that still grows would be fetched again at the lookup, after this step's token
            valid &= (idx + 1) * page <= length - 1
        pages = torch.where(valid, idx, n)
        slot = self.page_slot.gather(-1, pages).long()
        hit = valid & (slot >= 0)
        miss = valid & ~hit
        self.clock += 1
        self.last_used.scatter_(-1, torch.where(hit, slot, s), self.clock.expand(pages.shape).contiguous())
        # Misses take the least recently used slots; this selection's hits were just used, so they sort last.
        order = self.last_used[..., :s].argsort(-1)
        rank = (miss.cumsum(-1) - 1).clamp(0, s - 1)
        target = torch.where(miss, order.gather(-1, rank), s)
        evicted = self.slot_page.gather(-1, target)
        self.page_slot.scatter_(-1, evicted, -1)
        complete = (pages + 1) * page <= length - 1
        installed = torch.where(miss & complete, pages, n)
        self.page_slot.scatter_(-1, installed, target.to(torch.int32))
        self.page_slot[..., n] = -1
        self.slot_page.scatter_(-1, target, installed)
        self.slot_page[..., s] = n
        self.last_used.scatter_(-1, target, torch.where(complete, self.clock, 0))  # a growing page's slot is free next step
        if not ahead:
            self.hits += hit.sum()
            self.lookups += valid.sum()
        self.fetched += miss.sum()
        self._fetch(miss, pages, target, host_keys, host_values)
        return torch.where(hit, slot, torch.where(miss, target, 0)).to(torch.int32)

    def prefetch(self, sel: Selection, host_keys: Tensor, host_values: Tensor, length: Tensor, *,
                 workspace: kernels.Workspace | None = None) -> None:
        """`stage` page selection ``sel`` ahead of the layer's lookup, on ``workspace``'s prefetch
        stream (on CUDA; inline elsewhere, and without a workspace): the layer before calls it with
        this layer's predicted selection, and this layer calls `wait_for_prefetch` before its own
        `stage`. One custom op (`kernels.prefetch_pages_op`), so that a compiled step keeps it whole
        and its CUDA graph captures the fork and the join."""
        _prefetch_pages(sel.indices, sel.count, host_keys, host_values, length, *self._state(), self.page_size,
                        workspace=workspace)

    def wait_for_prefetch(self, after: Tensor, *, workspace: kernels.Workspace | None = None) -> None:
        """Make the current stream wait for this cache's `prefetch` on ``workspace``'s stream (issued
        once ``after``, e.g. the layer's query, exists, so that a compiler cannot move the wait up to
        the prefetch)."""
        kernels.wait_for_prefetch(self.page_slot, after, workspace=workspace)

    def _state(self) -> tuple[Tensor, ...]:
        return (self.keys, self.values, self.page_slot, self.slot_page, self.last_used, self.clock, self.fetched)

    @classmethod
    def _of(cls, keys: Tensor, values: Tensor, page_slot: Tensor, slot_page: Tensor, last_used: Tensor, clock: Tensor,
            fetched: Tensor, page_size: int) -> "PageCache":
        """A page cache over existing tensors (`_state`'s, as a custom op receives them); it counts
        no lookups (a prefetch does not)."""
        cache = cls.__new__(cls)
        cache.keys, cache.values, cache.page_slot, cache.slot_page = keys, values, page_slot, slot_page
        cache.last_used, cache.clock, cache.fetched = last_used, clock, fetched
        cache.num_pages, cache.slots, cache.page_size = page_slot.shape[-1] - 1, slot_page.shape[-1] - 1, page_size
        return cache

    def _fetch(self, miss: Tensor, pages: Tensor, target: Tensor, host_keys: Tensor, host_values: Tensor) -> None:
        """Copy the missed pages into their slots: the misses listed first (flat page numbers), the
        rest of the list pointing at the scratch slot."""
        b, h, _ = miss.shape
        n, s = self.num_pages, self.slots
        row = torch.arange(b * h, device=miss.device).view(b, h, 1)
        src = (row * n + pages.clamp(max=n - 1)).flatten()
        dst = (row * (s + 1) + target).flatten()
        flat = miss.flatten()
        m = flat.numel()
        at = torch.where(flat, flat.cumsum(0) - 1, m)
        src_list = torch.zeros(m + 1, dtype=torch.int64, device=miss.device).scatter_(0, at, src)[:m]
        dst_list = torch.full((m + 1,), s, dtype=torch.int64, device=miss.device).scatter_(0, at, dst)[:m]
        kernels.page_fetch(host_keys, host_values, self.keys, self.values, src_list, dst_list, flat.sum(), self.page_size)


def _stage_ahead(indices: Tensor, count: Tensor, host_keys: Tensor, host_values: Tensor, length: Tensor,
                 keys: Tensor, values: Tensor, page_slot: Tensor, slot_page: Tensor, last_used: Tensor, clock: Tensor,
                 fetched: Tensor, page_size: int) -> None:
    """`PageCache.stage` ahead, over the page cache's tensors (as the prefetch op receives them)."""
    cache = PageCache._of(keys, values, page_slot, slot_page, last_used, clock, fetched, page_size)
    cache.stage(Selection(indices=indices, count=count, block=page_size), host_keys, host_values, length, ahead=True)


_prefetch_pages = kernels.prefetch_pages_op(_stage_ahead)


__all__ = ["Offload", "PageCache", "PageCounts", "host_tensor"]

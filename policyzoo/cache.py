"""Static, preallocated, paged KV cache with per-page key summaries.

Layout per layer: keys and values ``[B, H_kv, capacity, D]`` (capacity a multiple of the page size;
``keys.view(B, H_kv, pages, page_size, D)`` is the page view), four summaries
``[B, H_kv, pages, D]``: per-page key min, max, mean and std over the page's *visible* tokens, and
optionally ``key_sketch``: every key coded in 4 bits per channel on its page's min/max grid, from
which a policy bounds each token's logit within about a nat without reading the keys. The keys and
values of ``host_layers`` live in pinned host memory, read in place by the GPU (`offload`); their
summaries stay on the device, and so does each one's `offload.PageCache` when ``cache_slots`` asks
for one (``prefetch``: the layer below may fill it ahead, `offload.PageCache.prefetch`).
Min and max are stored in the cache's dtype: they are key values, so they are exact there, and a
page policy reads them every step (in fp32 they would be 12.5% of the KV bytes at page 16 in bf16;
in bf16 they are 6.25%). Mean and std are stored in the cache's dtype too, rounded from their fp32
sums: `EntmaxKV`'s Gaussian page model, their only reader, is far coarser than bf16's 3 significant
digits, and in fp32 they were as many bytes as min and max twice over. A cache keeps
only the summaries its policies read (``summaries``, from `KVSelector.summaries`; min and max go
together, and so do mean and std): a dense decode keeps none and refreshes none.

A sliding-window layer (``windows``: layer -> window, the model's own) keeps a ring instead: keys and
values ``[B, H_kv, ring, D]``, ``ring = ring_slots(window, page_size)``, slot ``s`` at ``s % ring``,
so its memory is O(window) per row whatever the capacity; it keeps no summaries (no policy reads it).

All rows of a batch share slot numbers (left padding): row ``b`` owns slots ``start[b] .. length-1``.
``length`` is a 0-dim tensor, never a Python int, so a compiled decode step sees the same graph at
every step. A write never advances ``length``: the Decoder advances it once per step, before the
forward, so every layer writes its new token at slot ``length - 1`` and attends to ``< length``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import kernels
from .kernels import reference
from .kernels.reference import page_summaries, visible
from .offload import PageCache, PageCounts, host_tensor

SUMMARIES = ("page_min", "page_max", "page_mean", "page_std")
PAIRS = (("page_min", "page_max"), ("page_mean", "page_std"))  # kept together, or not at all
# A per-token summary: the 4-bit key sketch on its page's min/max grid (`reference.sketch_encode`),
# ``uint8[B, H_kv, capacity, ceil(D/2)]``. It needs the min/max pair, which the cache then keeps too.
SKETCH = "key_sketch"


def ring_slots(window: int, page_size: int) -> int:
    """Slots of a sliding-window layer's ring: whole pages, one more than a window fills, so the
    pages that any ``window`` consecutive slots touch (``ceil(window / page) + 1`` at most) lie in
    distinct ring pages, and a slot stays in the ring until it is out of every later window."""
    return (math.ceil(window / page_size) + 1) * page_size


class NotKept:
    """Stands in for the per-layer list of a summary the cache does not keep: reading it fails with
    the reason, instead of returning a stale tensor."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getitem__(self, layer: int):
        raise RuntimeError(f"this cache keeps no {self.name}: a policy that reads it must name it in its "
                           "KVSelector.summaries (the Decoder keeps what its KV policy lists)")


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        summaries: tuple[str, ...] = SUMMARIES,
        host_layers: frozenset[int] | set[int] = frozenset(),
        cache_slots: int = 0,
        prefetch: bool = False,
        windows: dict[int, int] | None = None,
    ) -> None:
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity!r}")
        sizes = {"num_layers": num_layers, "batch": batch, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
        for name, value in sizes.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        unknown = [name for name in summaries if name not in SUMMARIES + (SKETCH,)]
        if unknown:
            raise ValueError(f"summaries must be a subset of {SUMMARIES + (SKETCH,)}, got {list(summaries)}")
        # A pair's kernel computes both halves from one pass over the page; the sketch's grid is min/max.
        wanted = set(summaries) | ({"page_min"} if SKETCH in summaries else set())
        self.summaries = tuple(n for pair in PAIRS if wanted & set(pair) for n in pair)
        self.summaries += (SKETCH,) if SKETCH in summaries else ()
        self.num_layers, self.batch, self.num_kv_heads, self.head_dim = num_layers, batch, num_kv_heads, head_dim
        self.page_size = page_size
        num_pages = math.ceil(capacity / page_size)
        self.dtype, self.device = dtype, torch.device(device)
        kv_shape = (batch, num_kv_heads, num_pages * page_size, head_dim)
        page_shape = (batch, num_kv_heads, num_pages, head_dim)
        if not all(isinstance(i, int) and 0 <= i < num_layers for i in host_layers):
            raise ValueError(f"host_layers must be layer indices below {num_layers}, got {sorted(host_layers)}")
        self.host_layers = frozenset(host_layers)
        self.windows = _check_windows(windows or {}, num_layers, self.host_layers)
        # The layers that keep the whole sequence; `capacity` reads their shape. Without one (every
        # layer a window), the slot count the cache was made for stands in.
        self.full_layers = tuple(layer for layer in range(num_layers) if layer not in self.windows)
        self.total_slots = num_pages * page_size

        def kv(layer: int) -> Tensor:  # an offloaded layer's keys and values live in pinned host memory
            if layer in self.windows:  # a sliding-window layer's ring
                ring = ring_slots(self.windows[layer], page_size)
                return torch.zeros(batch, num_kv_heads, ring, head_dim, dtype=dtype, device=device)
            if layer in self.host_layers:
                return host_tensor(kv_shape, dtype, self.device)
            return torch.zeros(kv_shape, dtype=dtype, device=device)

        self.keys = [kv(layer) for layer in range(num_layers)]
        self.values = [kv(layer) for layer in range(num_layers)]
        for name in SUMMARIES:
            if name not in self.summaries:
                setattr(self, name, NotKept(name))
                continue
            setattr(self, name, [None if layer in self.windows else torch.zeros(page_shape, dtype=dtype, device=device)
                                 for layer in range(num_layers)])
        if self.keeps(SKETCH):
            code_shape = (batch, num_kv_heads, num_pages * page_size, -(-head_dim // 2))
            self.key_sketch = [None if layer in self.windows else torch.zeros(code_shape, dtype=torch.uint8, device=device)
                               for layer in range(num_layers)]
        else:
            self.key_sketch = NotKept(SKETCH)
        if isinstance(cache_slots, bool) or not isinstance(cache_slots, int) or cache_slots < 0:
            raise ValueError(f"cache_slots must be an int >= 0, got {cache_slots!r}")
        self.page_caches = {
            layer: PageCache(batch, num_kv_heads, head_dim, num_pages, cache_slots, page_size, dtype, device)
            for layer in sorted(self.host_layers) if cache_slots
        }
        self.prefetch = bool(prefetch)  # the layer below may stage a page cache's selection ahead
        self.length = torch.zeros((), dtype=torch.long, device=device)
        self.start = torch.zeros(batch, dtype=torch.long, device=device)
        if self.device.type == "cuda":
            # Fixed addresses let a compiled step mutate the cache inside a CUDA graph.
            for t in self.tensors():
                torch._dynamo.mark_static_address(t)

    # Read from the tensors' shapes rather than stored as ints, so that a step compiled with a
    # dynamic capacity (`Decoder.compile(dynamic_capacity=True)`) traces them as symbols.
    @property
    def capacity(self) -> int:
        """Token slots per row (a whole number of pages)."""
        if self.full_layers:
            return self.keys[self.full_layers[0]].shape[2]
        return self.total_slots

    @property
    def num_pages(self) -> int:
        return self.capacity // self.page_size

    def keeps(self, *names: str) -> bool:
        """Whether the cache keeps every one of the named summaries."""
        return all(name in self.summaries for name in names)

    def tensors(self) -> list[Tensor]:
        """Every tensor the cache owns (for static-address marking and memory accounting)."""
        per_layer = [self.keys, self.values] + [getattr(self, name) for name in self.summaries]
        paged = [t for pc in self.page_caches.values() for t in pc.tensors()]
        return [t for group in per_layer for t in group if t is not None] + paged + [self.length, self.start]

    def page_cache(self, layer: int) -> PageCache | None:
        """The device cache of offloaded ``layer``'s recently selected pages, or None."""
        return self.page_caches.get(layer)

    def page_cache_counts(self) -> PageCounts:
        """The offloaded layers' page cache counts since the sequence began, summed over layers."""
        return PageCounts.sum(pc.counts() for pc in self.page_caches.values())

    def page_cache_hit_rate(self) -> float:
        """Share of the offloaded layers' looked-up pages the link did not carry since the sequence
        began (`PageCounts.hit_rate`; NaN without page caches or before a lookup)."""
        return self.page_cache_counts().hit_rate

    # ----------------------------------------------------------------- visibility (derived state)
    def token_valid(self) -> Tensor:
        """``bool[B, capacity]``: slot ``t`` of row ``b`` holds a real, visible token."""
        return visible(self.start, self.length, self.capacity)

    def visible_at(self, slots: Tensor) -> Tensor:
        """``bool``, shaped as ``slots int64[B, ...]``: whether each slot holds a visible token, from
        the row's span alone (no tensor the size of the capacity is built or gathered from)."""
        shape = (self.batch,) + (1,) * (slots.dim() - 1)
        return (slots >= self.start.view(shape)) & (slots < self.length.reshape(-1, *shape[1:]))

    def page_spans(self, size: int | None = None) -> tuple[Tensor, Tensor]:
        """``(first, last) int64[B, units]``: unit ``p`` (a page, or a run of ``size`` slots, e.g. a
        policy's block) of row ``b`` holds visible slots ``first .. last-1`` (none when ``first >= last``)."""
        size = size or self.page_size
        lo = torch.arange(-(-self.capacity // size), device=self.device) * size
        first = torch.maximum(lo, self.start[:, None])
        last = torch.minimum(lo + size, self.length.expand(self.batch)[:, None])
        return first, last

    def page_counts(self) -> Tensor:
        """``int64[B, pages]``: visible tokens per page (0 for pages of padding or the future)."""
        first, last = self.page_spans()
        return (last - first).clamp(min=0)

    # ---------------------------------------------------------------------------------- writes
    def reset(self, start: Tensor, length: int) -> None:
        """Begin a new sequence batch: rows own slots ``start[b] .. length-1`` once prefilled."""
        if length > self.capacity:
            raise ValueError(f"prompt of {length} tokens does not fit a cache of {self.capacity}")
        self.start.copy_(start)
        self.length.fill_(length)
        for pc in self.page_caches.values():
            pc.clear()

    def rewind(self, length: int) -> None:
        """Set every row's length back to ``length`` tokens: the slots from it on will be written
        again, so the page caches forget the pages that hold them."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self.capacity:
            raise ValueError(f"length must be an int in [0, {self.capacity}], got {length!r}")
        if self.windows:  # a ring keeps its window's slots and a page more, not the whole past
            slack = min(self.keys[layer].shape[2] - window for layer, window in self.windows.items())
            if length < int(self.length) - slack:
                raise ValueError(f"length: a sliding-window layer's ring holds {slack} slots beyond its window; "
                                 f"cannot rewind from {int(self.length)} to {length}")
        self.length.fill_(length)
        for pc in self.page_caches.values():
            pc.forget_from(length // self.page_size)

    def write_prefill(self, layer: int, k: Tensor, v: Tensor, offset: int = 0) -> None:
        """Write a prompt's ``k, v [B, H_kv, T, D]`` at slots ``offset .. offset+T-1`` (a whole
        prompt, or one chunk of it) and summarise the pages they touch."""
        t = k.shape[2]
        self.keys[layer][:, :, offset : offset + t].copy_(k)
        self.values[layer][:, :, offset : offset + t].copy_(v)
        self.summarise(layer, slice(offset // self.page_size, math.ceil((offset + t) / self.page_size)))

    def write(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Write one token ``k, v [B, H_kv, 1, D]`` at slot ``length - 1``; refresh its page.

        Only the touched page is re-summarised (``page_size`` keys per head), so the cost per step
        is constant and the summaries always equal a recomputation over the visible tokens. On the
        kernel path it is one launch (`kernels.cache_append`).
        """
        kept = tuple(getattr(self, name)[layer] if self.keeps(name) else None for name in SUMMARIES)
        kernels.cache_append(k, v, self.keys[layer], self.values[layer], kept, self.start, self.length, self.page_size)
        if self.keeps(SKETCH):
            # The page's min or max may have moved, which moves its grid: recode the whole page.
            page = torch.div(self.length - 1, self.page_size, rounding_mode="floor").reshape(1)
            self._encode(layer, page)

    # ------------------------------------------------------------------ sliding-window rings
    def write_window(self, layer: int, k: Tensor, v: Tensor, first: int) -> None:
        """Write a prompt's (or a chunk's) ``k, v [B, H_kv, T, D]`` for slots ``first .. first+T-1``
        into window layer ``layer``'s ring: the last ``ring`` of them, each at its slot mod ring."""
        ring, t = self.keys[layer].shape[2], k.shape[2]
        keep = min(t, ring)
        where = torch.arange(first + t - keep, first + t, device=self.device) % ring
        self.keys[layer].index_copy_(2, where, k[:, :, t - keep :])
        self.values[layer].index_copy_(2, where, v[:, :, t - keep :])

    def write_window_token(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Write one token ``k, v [B, H_kv, 1, D]`` at slot ``length - 1`` of window layer ``layer``'s ring."""
        where = ((self.length - 1) % self.keys[layer].shape[2]).reshape(1)
        self.keys[layer].index_copy_(2, where, k)
        self.values[layer].index_copy_(2, where, v)

    def window_tokens(self, layer: int, first: int, last: int) -> tuple[Tensor, Tensor]:
        """Keys and values ``[B, H_kv, last - first, D]`` of slots ``first .. last-1`` from window
        layer ``layer``'s ring (they must be among its last ``ring`` slots written)."""
        where = torch.arange(first, last, device=self.device) % self.keys[layer].shape[2]
        return self.keys[layer].index_select(2, where), self.values[layer].index_select(2, where)

    def _encode(self, layer: int, pages: Tensor) -> None:
        """Recompute the sketch codes of ``pages int64[n]`` from their keys and min/max."""
        b, h, d, p = self.batch, self.num_kv_heads, self.head_dim, self.page_size
        k = self.keys[layer].view(b, h, self.num_pages, p, d).index_select(2, pages)
        lo, hi = self.page_min[layer].index_select(2, pages), self.page_max[layer].index_select(2, pages)
        codes = reference.sketch_encode(k, lo, hi)  # [B, H_kv, n, page, ceil(D/2)]
        slots = (pages[:, None] * p + torch.arange(p, device=pages.device)).flatten()
        self.key_sketch[layer].index_copy_(2, slots, codes.flatten(2, 3))

    def summarise(self, layer: int, pages: slice) -> None:
        """Recompute the kept summaries of ``pages`` over their visible slots (after a prefill, or
        after a benchmark fills the cache by hand)."""
        if not self.summaries:
            return
        b, h, d, p = self.batch, self.num_kv_heads, self.head_dim, self.page_size
        k = self.keys[layer].view(b, h, self.num_pages, p, d)[:, :, pages]
        m = self.token_valid().view(b, self.num_pages, p)[:, pages]
        stats = page_summaries(k, m[:, None, :, :, None].expand_as(k))
        for name, value in zip(SUMMARIES, stats):
            if self.keeps(name):
                dest = getattr(self, name)[layer]
                dest[:, :, pages] = value.to(dest.dtype)  # exact for min and max: they are key values
        if self.keeps(SKETCH):
            self._encode(layer, torch.arange(self.num_pages, device=self.device)[pages])


def _check_windows(windows: dict[int, int], num_layers: int, host_layers: frozenset[int]) -> dict[int, int]:
    """``windows`` (layer -> window in tokens) checked: layers of the cache, positive windows, none offloaded."""
    for layer, window in windows.items():
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
            raise ValueError(f"windows: layer {layer!r} is not a layer index below {num_layers}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"windows: layer {layer}'s window must be a positive int, got {window!r}")
    offloaded = sorted(set(windows) & host_layers)
    if offloaded:
        raise ValueError(f"layers {offloaded} are sliding-window layers (a ring of O(window) slots stays on the device): "
                         "offload only full-attention layers")
    return dict(windows)


__all__ = ["PagedKVCache", "SUMMARIES", "SKETCH", "NotKept", "page_summaries", "ring_slots"]

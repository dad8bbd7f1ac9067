"""Per-layer backends: what one decoder layer does with its keys, values and queries.

The session owns one backend per decoder layer (`build_backends`) and hands them to the model's
forward inside `ForwardArgs`; the registered attention function (`policyzoo.attention`) finds its
layer's backend there and calls `Backend.prefill` or `Backend.decode`. A decode step of one layer
is a fixed pipeline (`Backend.decode`)::

    select   write the step's key and value, ask the policy for a Selection, record it
    fetch    where the selected keys and values are read from (the cache, or a page cache)
    compute  attend over the selection (softmax or 1.5-entmax)
    observe  nothing, unless an audit watches

`LayerBackend` is a layer whose cache lives on the device; `WindowLayer` a sliding-window layer of the
model, which keeps a ring of its window's tokens and never asks the policy. Offload, prefetch and audit are
wrappers (`BackendWrapper`) that override one stage each: `Offloaded` reads an offloaded layer's
pages through its page cache, `Prefetching` starts the next layer's predicted pages on a side
stream once this layer has fetched its own, `Audited` reports each step to a recorder.
"""

from __future__ import annotations

import copy
from typing import Literal, NamedTuple, Protocol

import torch
from torch import Tensor

from . import kernels
from .attention import prefill_attention, prefill_attention_chunk, prefill_attention_entmax15, prefill_attention_window
from .cache import PagedKVCache
from .forward import ForwardArgs
from .kv.base import KVSelector, KVState
from .kv.context import ContextStore, StepContext
from .kv.dense import Dense
from .offload import PageCache
from .selection import Selection
from .workers import Workers

Attention = Literal["softmax", "entmax"]
ATTENTIONS = ("softmax", "entmax")


class Recorder(Protocol):
    """What an audit reports to (`policyzoo.eval.audit.Audit`): every decode step of every layer,
    and every sparse projection."""

    def record_attention(
        self, layer: int, q: Tensor, cache: PagedKVCache, sel: Selection, out: Tensor, scale: float, attention: Attention = "softmax"
    ) -> None: ...

    def record_projection(self, name: str, keep: Tensor) -> None: ...


class Fetched(NamedTuple):
    """Where a selection is read from: ``keys, values [B, H_kv, N, D]`` and the selection over them;
    ``slots`` maps its entries to slots of a page cache (None: the entries are cache slots)."""

    keys: Tensor
    values: Tensor
    sel: Selection
    slots: Tensor | None = None


class Backend:
    """One decoder layer's prefill and decode (see the module docstring). Subclasses implement the
    stages; `decode` runs them in order."""

    layer: int
    cache: PagedKVCache
    state: KVState
    contexts: ContextStore
    attention: Attention
    window: int | None = None  # a sliding-window layer's window (`WindowLayer`); None: the policy's layer

    def prefill(self, args: ForwardArgs, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        raise NotImplementedError  # abstract

    def load(self, policy: KVSelector, k: Tensor, v: Tensor, slot: int, q: Tensor | None = None) -> None:
        raise NotImplementedError  # abstract

    def decode(self, args: ForwardArgs, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """One decode step of this layer: ``q [B, H, D]``, ``k, v [B, H_kv, 1, D]`` → ``[B, H, D]``."""
        sel = self.select(args, q, k, v)
        fetched = self.fetch(args, q, sel)
        out = self.compute(q, fetched, scale)
        self.observe(q, fetched.sel, out, scale)
        return out

    def select(self, args: ForwardArgs, q: Tensor, k: Tensor, v: Tensor) -> Selection:
        raise NotImplementedError  # abstract

    def fetch(self, args: ForwardArgs, q: Tensor, sel: Selection) -> Fetched:
        raise NotImplementedError  # abstract

    def compute(self, q: Tensor, fetched: Fetched, scale: float) -> Tensor:
        raise NotImplementedError  # abstract

    def observe(self, q: Tensor, sel: Selection, out: Tensor, scale: float) -> None:
        """Nothing: an `Audited` backend records here."""

    def view(self) -> "Backend":
        """This layer as layer 0 of a one-layer cache (the same tensors), for one compiled layer that
        serves every layer (`policyzoo.regional`): nothing in it tells the layers apart but tensors."""
        raise NotImplementedError  # abstract


class LayerBackend(Backend):
    """A decoder layer whose keys and values live in the device cache ``cache`` at index ``layer``.

    ``state`` is what the policy sees of the layer (`KVState`), ``contexts`` the session's step
    context, ``attention`` the model's attention (``"softmax"`` or ``"entmax"``).
    """

    def __init__(self, cache: PagedKVCache, layer: int, state: KVState, contexts: ContextStore, attention: Attention) -> None:
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be 'softmax' or 'entmax', got {attention!r}")
        self.cache, self.layer, self.state, self.contexts, self.attention = cache, layer, state, contexts, attention

    def prefill(self, args: ForwardArgs, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Write a prompt chunk's keys and values, attend densely over the prompt so far, and run the
        policy's prefill: ``q [B, H, T, D]``, ``k, v [B, H_kv, T, D]`` → ``[B, H, T, D]``."""
        cache, state, prompt = self.cache, self.state, args.prompt
        base, offset = prompt.slot, prompt.offset
        cache.write_prefill(self.layer, k, v, base + offset)
        if offset:  # a later chunk of an unpadded prompt: it attends to the chunks before it too
            end = base + offset + q.shape[2]
            out = prefill_attention_chunk(q, state.keys[:, :, base:end], state.values[:, :, base:end], scale)
        elif self.attention == "entmax":
            out = prefill_attention_entmax15(q, k, v, cache.start - base, scale)
        else:
            out = prefill_attention(q, k, v, cache.start - base, scale, prompt.padded)
        self._prefill_policy(args.policy, q, k, v, prompt.last)
        return out

    def load(self, policy: KVSelector, k: Tensor, v: Tensor, slot: int, q: Tensor | None = None) -> None:
        """Write a whole prompt's keys and values computed elsewhere from ``slot`` on (no attention),
        and, given its queries ``q``, run the policy's prefill (`DecodeSession.load_prefix`)."""
        self.cache.write_prefill(self.layer, k, v, slot)
        if q is not None:
            self._prefill_policy(policy, q, k, v, last=True)

    def _prefill_policy(self, policy: KVSelector, q: Tensor, k: Tensor, v: Tensor, last: bool) -> None:
        policy.prefill(self.state, q, k, v)
        if last and self.contexts.keep_previous:  # step 0's "previous": the prompt's last token's
            policy.finish_prefill([self.state])
            self.contexts.seed_previous(self.layer, policy.select(self.state, q[:, :, -1]))

    def select(self, args: ForwardArgs, q: Tensor, k: Tensor, v: Tensor) -> Selection:
        self.cache.write(self.layer, k, v)
        args.policy.append(self.state, k, v)
        if args.phase != "decode":  # a dense reference pass leaves the policy's record alone
            return args.policy.select(self.state, q)
        sel = self.contexts.reusable(args.policy.same_every_layer)
        if sel is None:
            sel = args.policy.select(self.state, q)
        self.contexts.record(self.layer, sel)
        return sel

    def fetch(self, args: ForwardArgs, q: Tensor, sel: Selection) -> Fetched:
        return Fetched(self.state.keys, self.state.values, sel)

    def compute(self, q: Tensor, fetched: Fetched, scale: float) -> Tensor:
        attend = kernels.decode_attention_entmax15 if self.attention == "entmax" else kernels.decode_attention
        out, _ = attend(q, fetched.keys, fetched.values, fetched.sel, self.cache.start, self.cache.length, scale, fetched.slots)
        return out

    def view(self) -> "LayerBackend":
        cache = layer_cache(self.cache, self.layer)
        contexts = LayerContexts(self.contexts, self.layer)
        state = KVState(cache, 0, self.state.scale, layer_states=self.state.layer_states, contexts=contexts, workspace=self.state.workspace,
                        workers=self.state.workers)
        return LayerBackend(cache, 0, state, contexts, self.attention)


class WindowLayer(Backend):
    """A sliding-window layer of the model: each token attends to the last ``window`` slots, its own
    included, as the model's attention does. Its keys and values live in the cache's ring for the
    layer (`PagedKVCache.windows`), O(window) per row; the KV policy never runs on it.

    Prefill attends with the band mask (`prefill_attention_window`; a later chunk also reads the
    window's earlier slots from the ring) and keeps the prompt's last ring slots. A decode step
    selects every ring page, named by the latest sequence page it holds, and attends through the
    decode kernel's ``slots`` (the entries' places in the ring), with each row's visible span cut to
    the window (``start = max(start, length - window)``): exactly the window's tokens, any policy.
    """

    def __init__(self, cache: PagedKVCache, layer: int, state: KVState, contexts: ContextStore, attention: Attention) -> None:
        if attention != "softmax":
            raise ValueError(f"layer {layer} is a sliding-window layer of the model, which attends with softmax: "
                             f"a policy with attention={attention!r} cannot decode beyond its window")
        self.cache, self.layer, self.state, self.contexts, self.attention = cache, layer, state, contexts, attention
        self.window = cache.windows[layer]

    def prefill(self, args: ForwardArgs, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Attend over the prompt chunk's window and keep its last tokens in the ring:
        ``q [B, H, T, D]``, ``k, v [B, H_kv, T, D]`` → ``[B, H, T, D]``."""
        cache, prompt = self.cache, args.prompt
        first = prompt.slot + prompt.offset
        keys, values = k, v
        if prompt.offset:  # a later chunk of an unpadded prompt: its window reaches into the chunks before it
            earlier_k, earlier_v = cache.window_tokens(self.layer, max(prompt.slot, first - self.window + 1), first)
            keys, values = torch.cat([earlier_k, k], dim=2), torch.cat([earlier_v, v], dim=2)
        out = prefill_attention_window(q, keys, values, first, cache.start, self.window, scale)
        cache.write_window(self.layer, k, v, first)
        return out

    def load(self, policy: KVSelector, k: Tensor, v: Tensor, slot: int, q: Tensor | None = None) -> None:
        """Keep the last ring slots of a prompt's keys and values written from ``slot`` on."""
        self.cache.write_window(self.layer, k, v, slot)

    def select(self, args: ForwardArgs, q: Tensor, k: Tensor, v: Tensor) -> Selection:
        """Write the step's token into the ring; select every ring page by the sequence page it holds."""
        cache = self.cache
        cache.write_window_token(self.layer, k, v)
        page = cache.page_size
        ring_pages = cache.keys[self.layer].shape[2] // page
        current = torch.div(cache.length - 1, page, rounding_mode="floor")
        # Ring page j holds the latest sequence page p <= current with p = j (mod ring_pages); a page
        # before the sequence (p < 0) lies before every row's start, so it is never visible.
        pages = current - (current - torch.arange(ring_pages, device=cache.device)) % ring_pages
        b, h_kv = cache.batch, cache.num_kv_heads
        indices = pages.to(torch.int32).expand(b, h_kv, ring_pages)
        count = torch.full((b, h_kv), ring_pages, dtype=torch.int32, device=cache.device)
        return Selection(indices, count, block=page)

    def fetch(self, args: ForwardArgs, q: Tensor, sel: Selection) -> Fetched:
        slots = torch.arange(sel.k_max, dtype=torch.int32, device=q.device).expand_as(sel.indices)
        return Fetched(self.state.keys, self.state.values, sel, slots)

    def compute(self, q: Tensor, fetched: Fetched, scale: float) -> Tensor:
        cache = self.cache
        start = torch.maximum(cache.start, cache.length - self.window)  # the window's first slot, or the row's
        out, _ = kernels.decode_attention(q, fetched.keys, fetched.values, fetched.sel, start, cache.length, scale, fetched.slots)
        return out

    def view(self) -> "WindowLayer":
        cache = layer_cache(self.cache, self.layer)
        contexts = LayerContexts(self.contexts, self.layer)
        state = KVState(cache, 0, self.state.scale, layer_states=self.state.layer_states, contexts=contexts, workspace=self.state.workspace,
                        workers=self.state.workers)
        return WindowLayer(cache, 0, state, contexts, self.attention)


class BackendWrapper(Backend):
    """A backend around another (``inner``): every stage is the inner's unless overridden."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner

    @property
    def layer(self) -> int:  # type: ignore[override]
        return self.inner.layer

    @property
    def cache(self) -> PagedKVCache:  # type: ignore[override]
        return self.inner.cache

    @property
    def state(self) -> KVState:  # type: ignore[override]
        return self.inner.state

    @property
    def contexts(self) -> ContextStore:  # type: ignore[override]
        return self.inner.contexts

    @property
    def attention(self) -> Attention:  # type: ignore[override]
        return self.inner.attention

    @property
    def window(self) -> int | None:  # type: ignore[override]
        return self.inner.window

    def prefill(self, args: ForwardArgs, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        return self.inner.prefill(args, q, k, v, scale)

    def load(self, policy: KVSelector, k: Tensor, v: Tensor, slot: int, q: Tensor | None = None) -> None:
        self.inner.load(policy, k, v, slot, q)

    def select(self, args: ForwardArgs, q: Tensor, k: Tensor, v: Tensor) -> Selection:
        return self.inner.select(args, q, k, v)

    def fetch(self, args: ForwardArgs, q: Tensor, sel: Selection) -> Fetched:
        return self.inner.fetch(args, q, sel)

    def compute(self, q: Tensor, fetched: Fetched, scale: float) -> Tensor:
        return self.inner.compute(q, fetched, scale)

    def observe(self, q: Tensor, sel: Selection, out: Tensor, scale: float) -> None:
        self.inner.observe(q, sel, out, scale)


class Offloaded(BackendWrapper):
    """An offloaded layer (keys and values in pinned host memory): a page selection is read through
    the layer's ``page_cache`` on the device; a token selection, and the dense setting (every page),
    read the host in place. ``prefetched``: the layer below may fetch this layer's predicted pages
    ahead (`Prefetching`), so a step waits for that fetch before its own lookup."""

    def __init__(self, inner: Backend, page_cache: PageCache, prefetched: bool) -> None:
        super().__init__(inner)
        self.page_cache, self.prefetched = page_cache, prefetched

    def fetch(self, args: ForwardArgs, q: Tensor, sel: Selection) -> Fetched:
        page = self.cache.page_size
        if sel.block % page != 0 or isinstance(args.policy, Dense):
            return self.inner.fetch(args, q, sel)
        if self.prefetched and fetched_ahead(args, self.layer):
            self.page_cache.wait_for_prefetch(q, workspace=self.state.workspace)
        sel = sel.split(page)
        slots = self.page_cache.stage(sel, self.state.keys, self.state.values, self.cache.length)
        return Fetched(self.page_cache.keys, self.page_cache.values, sel, slots)

    def view(self) -> "Offloaded":
        # A layer-invariant policy predicts no layer's selection, so nothing is prefetched for it.
        return Offloaded(self.inner.view(), self.page_cache, prefetched=False)


class Prefetching(BackendWrapper):
    """A layer below an offloaded one: where the policy makes the next layer's selection here
    (`KVSelector.predicts_layer`), start fetching that layer's pages into ``next_cache`` on a side
    stream, after this layer's own fetch (they would share the link), while this layer attends."""

    def __init__(self, inner: Backend, next_cache: PageCache, next_keys: Tensor, next_values: Tensor) -> None:
        super().__init__(inner)
        self.next_cache, self.next_keys, self.next_values = next_cache, next_keys, next_values

    def fetch(self, args: ForwardArgs, q: Tensor, sel: Selection) -> Fetched:
        fetched = self.inner.fetch(args, q, sel)
        if fetched_ahead(args, self.layer + 1):
            nxt = args.policy.next_layer_selection(self.state, sel)
            if nxt is None:
                raise RuntimeError(f"{type(args.policy).__name__}.predicts_layer({self.layer + 1}) is true, but "
                                   f"next_layer_selection gave no selection at layer {self.layer}")
            if nxt.block % self.cache.page_size == 0:
                self.next_cache.prefetch(nxt.split(self.cache.page_size), self.next_keys, self.next_values, self.cache.length,
                                         workspace=self.state.workspace)  # its stream: the session's Workspace
        return fetched

    def view(self) -> Backend:
        # A layer-invariant policy predicts no layer's selection: there is nothing to prefetch.
        return self.inner.view()


class Audited(BackendWrapper):
    """Reports every decode step of the layer to ``recorder`` (`Recorder.record_attention`)."""

    def __init__(self, inner: Backend, recorder: Recorder) -> None:
        super().__init__(inner)
        self.recorder = recorder

    def observe(self, q: Tensor, sel: Selection, out: Tensor, scale: float) -> None:
        self.inner.observe(q, sel, out, scale)
        self.recorder.record_attention(self.layer, q, self.cache, sel, out, scale, attention=self.attention)

    def view(self) -> Backend:
        raise RuntimeError("an audited step runs eagerly: it has no compiled layer view")


def fetched_ahead(args: ForwardArgs, layer: int) -> bool:
    """Whether layer ``layer``'s pages are fetched by the layer below in this forward: both the fork
    (`Prefetching`) and the join (`Offloaded`) decide by this, so they always pair."""
    return args.phase == "decode" and args.policy.predicts_layer(layer)


def build_backends(cache: PagedKVCache, contexts: ContextStore, attention: Attention, scale: float,
                   workspace: kernels.Workspace | None = None, workers: Workers | None = None) -> list[Backend]:
    """One backend per layer of ``cache``: device layers as they are, offloaded layers through their
    page caches, and, where the cache prefetches, each layer below an offloaded one prefetching."""
    backends: list[Backend] = []
    for layer in range(cache.num_layers):
        state = KVState(cache, layer, scale, contexts=contexts, workspace=workspace, workers=workers)
        if layer in cache.windows:  # a sliding-window layer: its ring, never offloaded (`PagedKVCache`)
            backends.append(WindowLayer(cache, layer, state, contexts, attention))
            continue
        backend: Backend = LayerBackend(cache, layer, state, contexts, attention)
        page_cache = cache.page_cache(layer)
        if page_cache is not None:
            backend = Offloaded(backend, page_cache, prefetched=cache.prefetch and layer > 0)
        below_offloaded = cache.page_cache(layer + 1) if layer + 1 < cache.num_layers else None
        if cache.prefetch and below_offloaded is not None:
            backend = Prefetching(backend, below_offloaded, cache.keys[layer + 1], cache.values[layer + 1])
        backends.append(backend)
    return backends


# ------------------------------------------------------------------------- one-layer views
def layer_cache(cache: PagedKVCache, layer: int) -> PagedKVCache:
    """A one-layer view of ``cache``: layer ``layer``'s tensors as layer 0 (the same tensors, no
    copy; ``length`` and ``start`` shared), so every method works on it as on the cache."""
    view = copy.copy(cache)
    view.num_layers = 1
    view.keys, view.values = [cache.keys[layer]], [cache.values[layer]]
    for name in cache.summaries:
        setattr(view, name, [getattr(cache, name)[layer]])
    view.host_layers = frozenset({0}) if layer in cache.host_layers else frozenset()
    view.windows = {0: cache.windows[layer]} if layer in cache.windows else {}
    view.full_layers = () if layer in cache.windows else (0,)
    view.total_slots = cache.capacity
    view.page_caches = {0: cache.page_caches[layer]} if layer in cache.page_caches else {}
    return view


class LayerContexts:
    """Layer ``layer``'s view of the session's `ContextStore` (as layer 0): the step index, the
    request state and the layer below's selection at this step (``None`` in layer 0). A
    layer-invariant policy keeps no previous selection and no hidden state."""

    keep_previous = False
    keep_hidden = False
    keep_rotary = False

    def __init__(self, main: ContextStore, layer: int) -> None:
        self.main = main
        self.first = layer == 0

    @property
    def request(self) -> object | None:
        return self.main.request

    @request.setter
    def request(self, value: object | None) -> None:
        self.main.request = value

    def view(self, layer: int) -> StepContext:
        return StepContext(index=self.main.index, below=None if self.first else self.main.below, request=self.main.request)

    def record(self, layer: int, sel: Selection) -> None:
        self.main.below = sel

    def reusable(self, same_every_layer: bool) -> Selection | None:
        """The step's shared selection (`ContextStore.share`): a tensor input of the compiled layer,
        made once before the layers."""
        return self.main.shared if same_every_layer else None


__all__ = [
    "ATTENTIONS", "Attention", "Audited", "Backend", "BackendWrapper", "Fetched", "LayerBackend", "LayerContexts",
    "Offloaded", "Prefetching", "Recorder", "WindowLayer", "build_backends", "fetched_ahead", "layer_cache",
]

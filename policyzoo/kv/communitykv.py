"""`CommunityKV`: keys that attend together are retrieved together (issue 20).

**Prefill** (eager, once per layer). Per batch row and graph (one per KV head, ``graph="group"``, or
per query head, ``"head"``), a token graph of the prompt: each query's ``top`` most attended keys
(`kernels.attention_edges`), mixed with the keys' co-attention, partitioned by Leiden in worker
processes while the forward goes on (`kv.community_graph`, which says how). `finish_prefill`, after
the forward, waits for every layer's partitions and lays them out. The edge search is quadratic in
the prompt (every query-key logit of every head; on CUDA a Triton kernel keeps them on chip: 1.1 s
per 32K prefill and 13 s per 128K prefill of an 8B model on an H200), and Leiden costs seconds per
1,000 tokens; the time is recorded in `CommunityKV.clustering`.

**Parts** (`split`). A community is a set of tokens that attend together, not of keys that lie
together, so its mean key can stand for none of them: a needle's digits share communities with the
same-place tokens of other needles and with filler text, the one key that matches the decode query
is averaged away, and the needle is dropped. So each community of more than ``split`` tokens is
halved at the median of its keys' projection on their principal axis (power iteration on the
centred keys), again until no part is larger (`community_graph.split_communities`): the parts never
straddle a community, and each is close in key space, so its mean key's logit is near its members'.
The parts are what the layout and decode below call communities. Scoring whole communities by a
bound (a min/max box, a ball around the mean) or by a Gaussian estimate of their log-mean-exp did
worse than splitting them. The price is more parts to score at each step (about ``n / 3`` for ``split=4``,
against ``n / 8.5`` communities on SmolLM2 at 3K tokens), the larger tables that go with them, and
the split itself, which runs in the same job as the graph's partition (`kv.community_graph`). The
measurements: ``benchmarks/results/smollm2-communitykv-multikey``.

**Layout.** Per row and graph (a *unit*), ``order`` lists token slots grouped by community: community
``c`` holds ``order[offset_c : offset_c + size_c]``, its prompt tokens first, most central (largest
weighted degree in the graph ``W``, `kv.community_graph`) first, then the tokens decoding appends to it. Each community's range has
spare slots behind it (its even share of the cache's free slots plus `SPARE`), so an append writes
one entry; the shapes are fixed at prefill from the cache's capacity and the community count rounded
up to one of eight sizes per octave (a prompt with more communities than the last one compiles again).

**Decode** (static shapes, no host sync). A community's score is ``scale · q · centroid`` (its mean
key), the largest over the group's query heads in group mode, its own head's in head mode (where a
KV head's candidates are the communities of all its query heads). The sinks and the window are kept,
then whole communities in score order fill the budget; the last one that does not fit is cut after
its most central tokens. A token reached through several communities (head mode) counts once. The
communities are scored by the candidates' logit kernel (`kernels.gathered_logits`, the centroids as
keys) and chosen by `kernels.community_choice`: on CUDA in group mode a weighted threshold of their
16-bit score keys (each community weighing the slots of its range free to take), no sort; its
reference (CPU, head mode) sorts them and turns the ranked ranges into slots by prefix sums. Either
way the step reads ``O(communities + budget)`` entries, never the whole context. The kept slots come
first (by community id from the kernel, in rank order from the reference), then the sinks and the
window.

**Appends.** A decoded token joins, per unit, one of ``candidates`` communities: those its layer's
last query ranked best (the previous step's selection; at the first step, the communities of the
prompt's last tokens), the one whose centroid is nearest to its key (squared distance) among those
with a free slot. That is the local rule: ``O(candidates · d)`` per unit, whatever the context,
where the nearest of all centroids would read them all (as many bytes as the selection) every step.
Where no candidate has room, the community with the most room left takes it: the one the layer's
last selection found (`kernels.community_choice` finds it in passing), which is the one with the
most room now, since each append follows its layer's previous selection and nothing else changes
the sizes (a layer that never selects, whose selection a wrapper takes from another layer, keeps
the layout's). The centroid is
updated in place, ``c ← c + (k − c) / (n + 1)`` (in float32, and copied to the cache's dtype, in
which decode scores the communities); nothing is re-partitioned. The token is in the window
(always kept) for its first ``window`` steps anyway.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch
from torch import Tensor

from .. import kernels
from ..selection import Selection
from .base import Budget, KVSelector, KVState, check_count
from .choose import round_for_ranking
from ..workers import INLINE, cpus
from .community_graph import LEIDENS, ClusteringTime, Leiden, Partition, graph_communities, require_leiden
from .registry import register

Graph = Literal["group", "head"]
GRAPHS = ("group", "head")
# Spare slots each community's range has beyond its even share of the cache's free slots: room for
# the tokens decoding appends to it, without moving any other community.
SPARE = 32
# Prompts from which the graphs are partitioned in worker processes by default (a pool's start costs
# a few seconds; shorter prompts partition in this process).
PARALLEL_TOKENS = 4096


@dataclass
class CommunityLayer:
    """`CommunityKV`'s state of one layer: the partitions its prefill started (``jobs``, until
    `finish_prefill` lays them out), then the communities of every row and unit (KV head, or query
    head in head mode): ``order [B, U, W+1]`` the token slots of each community's range, its
    ``offset``, ``size`` and ``room`` ``[B, U, C]``, the ``centroid [B, U, C, D]`` (float32) and its
    copy in the cache's dtype ``centroid_key`` that decode scores, the next token's candidate
    communities ``recent [B, U, M]``, and the community with the most room left ``roomiest [B, U,
    1]`` (as of the last selection)."""

    jobs: tuple | None = None
    order: Tensor | None = None
    offset: Tensor | None = None
    size: Tensor | None = None
    room: Tensor | None = None
    centroid: Tensor | None = None
    centroid_key: Tensor | None = None
    recent: Tensor | None = None
    roomiest: Tensor | None = None

    @property
    def laid_out(self) -> bool:
        return self.order is not None

@register("community-kv")
@dataclass
class CommunityKV(KVSelector):
    """Keep ``budget`` tokens (or a keep ratio of the visible context; sinks and window included) as
    whole communities of tokens that attend together (see the module docstring).

    ``top``: keys per query in the token graph; ``mix``: the co-attention share of the graph;
    ``graph``: ``"group"`` (one graph per KV head) or ``"head"`` (one per query head);
    ``resolution``: Leiden's RB-configuration resolution per 1,000 tokens of the graph (larger:
    smaller communities); ``leiden``: the implementation, ``"igraph"`` (igraph's C Leiden,
    ``Graph.community_leiden``) or ``"leidenalg"`` (``leidenalg.find_partition``), which optimise the
    same quality; ``seed`` fixes the partition (the same with any number of workers);
    ``workers``: processes that build and partition the graphs, all layers' at once (``None``: one
    per CPU for prompts of `PARALLEL_TOKENS` tokens or more, else this process; ``1``: this
    process); they are the decoding session's (`policyzoo.workers.Workers`, ended when it retires),
    so the policy itself holds none, and a `KVState` outside a session runs the graphs here. ``partition``: a function ``(n, lo, hi, weight, gamma, seed) -> membership int64[n]``
    that partitions one graph of ``n`` tokens, given as undirected edges ``lo[i] -- hi[i]`` (``lo <
    hi``, int64, on the CPU) of float64 ``weight[i]`` at RB-configuration resolution ``gamma``;
    ``None`` (the default): Leiden by ``leiden``. It runs in the worker processes, so it must
    pickle (a module-level function or a `functools.partial` of one). ``split``: the most tokens of
    a part: larger communities are halved along their keys' principal axis until no part is larger
    (``0``: the partition's communities as they are; see the module docstring). Leiden needs the optional
    ``community`` extra (``python-igraph``, ``leidenalg``).
    """

    budget: int | float = 0.1
    top: int = 8
    mix: float = 0.5
    graph: Graph = "group"
    resolution: float = 10.0
    leiden: Leiden = "igraph"
    sinks: int = 4
    window: int = 16
    seed: int = 0
    workers: int | None = None
    candidates: int = 8
    partition: Partition | None = None
    split: int = 4
    summaries = ()  # centroids of its own; no page summaries
    own_prefill = True  # the communities are found in prefill
    clustering: ClusteringTime = field(default_factory=ClusteringTime, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._budget = Budget(self.budget)
        check_count(self.top, "top", minimum=1)
        check_count(self.split, "split")
        check_count(self.sinks, "sinks")
        check_count(self.window, "window", minimum=1)  # the step's own token is always kept
        check_count(self.seed, "seed", maximum=2**31 - 1)
        check_count(self.candidates, "candidates", minimum=1)
        if self.workers is not None:
            check_count(self.workers, "workers", minimum=1)
        if isinstance(self.mix, bool) or not isinstance(self.mix, (int, float)) or not 0.0 <= self.mix <= 1.0:
            raise ValueError(f"mix must be a number in [0, 1], got {self.mix!r}")
        if isinstance(self.resolution, bool) or not isinstance(self.resolution, (int, float)) or not 0 < self.resolution < math.inf:
            raise ValueError(f"resolution must be a positive number, got {self.resolution!r}")
        if self.graph not in GRAPHS:
            raise ValueError(f"graph must be 'group' or 'head', got {self.graph!r}")
        if self.leiden not in LEIDENS:
            raise ValueError(f"leiden must be 'igraph' or 'leidenalg', got {self.leiden!r}")
        if self.partition is not None and not callable(self.partition):
            raise TypeError(f"partition must be a function (n, lo, hi, weight, gamma, seed) -> membership, got {self.partition!r}")

    # ------------------------------------------------------------------------------- prefill
    def prefill(self, state: KVState, q: Tensor, k: Tensor, v: Tensor) -> None:
        """Start partitioning the visible tokens of every row into communities, per graph (see the
        module docstring), from the queries ``q [B, H, T, D]`` (the prompt's last ``T`` slots) against
        every visible key in the cache. The edges are found here, on the model's device; the graphs
        are built and partitioned by `workers` processes while the forward goes on, and
        `finish_prefill` lays the communities out.

        A session prefills a policy with a prefill of its own in one forward
        (`DecodeSession._prefill_chunk`); given one chunk of a longer prompt, the graph has that
        chunk's queries only (against all the keys before them), and still covers every visible token.
        """
        if self.partition is None:
            require_leiden(self.leiden)  # missing: said here, not by a worker
        cache = state.cache
        b, h = q.shape[:2]
        h_kv = state.keys.shape[1]
        per_kv = h // h_kv if self.graph == "head" else 1
        heads = h // h_kv // per_kv  # query heads whose edges one graph sums
        length, starts = int(cache.length), cache.start.tolist()
        runner = self._runner(state, length - min(starts))
        tic = time.perf_counter()
        jobs = []
        how = (self.leiden, self.seed, self.partition)
        for row in range(b):
            n = length - starts[row]
            dst, p, first = self._edges(state, row, q[row], length)
            # The split's keys, at the precision it rounds them to (bf16's, so the cast is exact):
            # half the bytes to send, and a row is split alike alone and in a padded batch.
            keys = None
            if self.split:
                keys = round_for_ranking(state.keys[row, :, starts[row] : length].float()).bfloat16().cpu()
            gamma = float(self.resolution) * n / 1000
            for u in range(h // heads):
                one = slice(u * heads, (u + 1) * heads)
                unit_keys = None if keys is None else keys[u // per_kv]
                jobs.append(runner.submit(graph_communities, n, first, dst[one], p[one], self.mix, self.sinks, gamma, *how,
                                          split=self.split, keys=unit_keys))
        state.layer_state_of(self).jobs = (jobs, b, per_kv, length, time.perf_counter() - tic)
        if state.layer == 0:
            self.clustering.tokens += sum(length - s for s in starts)

    def finish_prefill(self, states: Sequence[KVState]) -> None:
        """Wait for the partitions that `prefill` started and lay each layer's communities out."""
        for state in states:
            layer = state.layer_state_of(self)
            pending, layer.jobs = layer.jobs, None
            if pending is None:
                continue
            jobs, b, per_kv, length, edge_s = pending
            tic = time.perf_counter()
            done = [job.result() for job in jobs]  # `Communities`, one per graph
            units = len(done) // b
            rows = [[(d.membership, d.strength) for d in done[r * units : (r + 1) * units]] for r in range(b)]
            self._lay_out(state, rows, per_kv, length)
            self.clustering.graph_seconds += edge_s + sum(d.graph_seconds for d in done)
            self.clustering.leiden_seconds += sum(d.partition_seconds for d in done)
            self.clustering.split_seconds += sum(d.split_seconds for d in done)
            self.clustering.wait_seconds += time.perf_counter() - tic
            self.clustering.graphs += len(done)

    def _runner(self, state: KVState, tokens: int) -> Executor:
        """Where the graphs go: `workers` processes of the session's pool (`KVState.workers`; by
        default one per CPU, for prompts of at least `PARALLEL_TOKENS` tokens), or this process (one
        worker, or a state outside a session)."""
        workers = self.workers if self.workers is not None else (cpus() if tokens >= PARALLEL_TOKENS else 1)
        return state.workers.executor(workers) if state.workers is not None else INLINE

    def _edges(self, state: KVState, row: int, q: Tensor, length: int) -> tuple[Tensor, Tensor, int]:
        """Row ``row``'s query → key edges, on the CPU: ``(dst, p, first)``, ``dst, p [H, Q, top]``
        (each query's top keys in local token indices ``slot - start`` and their probabilities,
        rounded for ranking; ``p = 0`` where a query sees fewer than ``top`` keys), for the queries of
        local indices ``first, first + 1, ...``. ``q [H, T, D]`` are the row's queries of the last
        ``T`` slots. The search is `kernels.attention_edges` (the Triton kernel on CUDA: it keeps
        the quadratic work on chip)."""
        t = q.shape[1]
        start = int(state.cache.start[row])
        keys = state.keys[row, :, start:length]  # [H_kv, n, D]
        first = max(start - (length - t), 0)  # the first query that is a visible token of the row
        q_pos0 = length - t + first - start  # its local index
        # Fewer keys than `top` leave p = 0 in the rest: no edge there. `top` past the row's keys is
        # capped at them (a graph of every pair already).
        dst, p = kernels.attention_edges(q[:, first:], keys, q_pos0, state.scale, min(self.top, keys.shape[1]))
        # Rounded to bf16 precision, so a row's graph is the same alone and in a batch. The edges
        # go to the workers, which sum them into the graph: they are 4-5x smaller than it.
        return dst.cpu(), round_for_ranking(p).cpu(), q_pos0

    def _lay_out(self, state: KVState, parts: list[list[tuple[Tensor, Tensor]]], per_kv: int, length: int) -> None:
        """Write the decode state (`order`, `offset`, `size`, `room`, `centroid` and its copy in the
        cache's dtype `centroid_key`, the candidates `recent`) into the layer's `CommunityLayer`
        from each row's and unit's ``(membership, strength)`` of its visible tokens, the slots before
        ``length`` (the cache's length at prefill)."""
        cache = state.cache
        b, units, d = len(parts), len(parts[0]), cache.head_dim
        capacity = cache.capacity
        # [H_kv, n, D] each, copied in the cache's dtype (half the bytes of float32 for bf16), then widened.
        keys_of = [state.keys[row, :, int(cache.start[row]) : length].cpu().float() for row in range(b)]
        counts = [[int(m.max()) + 1 for m, _ in row] for row in parts]
        most = max(max(row) for row in counts)
        step = 1 << max(0, most.bit_length() - 4)  # eight sizes per octave: few distinct shapes, at most 1/8 unused
        c = -(-most // step) * step
        free = capacity - length
        width = capacity + c * (SPARE + 1)  # holds every unit's ranges (see below), plus one discard slot
        order = torch.zeros(b, units, width + 1, dtype=torch.int32)
        offset, size, room = (torch.zeros(b, units, c, dtype=torch.long) for _ in range(3))
        centroid = torch.zeros(b, units, c, d)
        # `candidates` wide whatever the batch's table width, so that a row's joins do not depend on
        # its batchmates (fewer communities repeat, cyclically).
        recent = torch.zeros(b, units, self.candidates, dtype=torch.long)
        for row, row_parts in enumerate(parts):
            start = int(cache.start[row])
            keys = keys_of[row]
            n = length - start
            for unit, (member, strength) in enumerate(row_parts):
                n_c = counts[row][unit]
                sizes = torch.bincount(member, minlength=n_c)
                # Its share of the free slots plus SPARE, at most all of them: the ranges of the
                # n_c communities hold at most n + free + n_c·(SPARE + 1) <= `width` entries.
                spare = min(free, -(-free // n_c) + SPARE)
                ends = (sizes + spare).cumsum(0)
                offs = ends - (sizes + spare)
                by_strength = torch.argsort(-strength, stable=True)  # ties: the earlier token first
                grouped = by_strength[torch.argsort(member[by_strength], stable=True)]
                firsts = sizes.cumsum(0) - sizes
                community = member[grouped]
                order[row, unit, offs[community] + torch.arange(n) - firsts[community]] = (grouped + start).int()
                offset[row, unit, :n_c], size[row, unit, :n_c], room[row, unit, :n_c] = offs, sizes, sizes + spare
                sums = torch.zeros(n_c, d).index_add_(0, member, keys[unit // per_kv])
                centroid[row, unit, :n_c] = sums / sizes[:, None]
                last = member.flip(0)[: recent.shape[-1]]  # the prompt's last tokens' communities, latest first
                recent[row, unit] = last[torch.arange(recent.shape[-1]) % len(last)]
        device = state.keys.device
        stored = {"order": order, "offset": offset, "size": size, "room": room, "centroid": centroid,
                  "centroid_key": centroid.to(state.keys.dtype), "recent": recent,
                  "roomiest": (room - size).argmax(-1, keepdim=True)}  # fmt: skip
        layer = state.layer_state_of(self)
        for name, value in stored.items():
            value = value.to(device)
            if device.type == "cuda":  # updated in place by decode steps, which a CUDA graph replays
                torch._dynamo.mark_static_address(value)
            setattr(layer, name, value)

    # -------------------------------------------------------------------------------- decode
    def new_layer_state(self) -> CommunityLayer:
        return CommunityLayer()

    def _ready(self, state: KVState) -> CommunityLayer:
        """The layer's communities, laid out (a prefill still in progress is finished first: a
        caller that drives `prefill` itself need not call `finish_prefill`)."""
        layer = state.layer_state_of(self)
        if layer.jobs is not None:
            self.finish_prefill([state])
        if not layer.laid_out:
            raise RuntimeError(_NO_PREFILL)
        return layer

    def append(self, state: KVState, k: Tensor, v: Tensor) -> None:
        """Put the step's token (slot ``length - 1``, key ``k [B, H_kv, 1, D]``) into a community, per
        unit, and move that community's centroid to the new mean: ``O(candidates · d)`` (see the
        module docstring)."""
        layer = self._ready(state)
        order, offset, size, room = layer.order, layer.offset, layer.size, layer.room
        centroid, shadow, recent = layer.centroid, layer.centroid_key, layer.recent
        b, units, c, d = centroid.shape
        key = k[:, :, 0].float().repeat_interleave(units // k.shape[1], dim=1)  # [B, U, D]
        open_ = size < room  # padding communities have no room
        near = torch.gather(centroid, 2, recent[..., None].expand(*recent.shape, d))  # [B, U, M, D]
        dist = (near - key[:, :, None]).square().sum(-1)
        open_near = torch.gather(open_, 2, recent)
        # Ranked at bf16 precision, ties to the earlier candidate: a row chooses alike alone and in a batch.
        pick = round_for_ranking(dist).masked_fill(~open_near, torch.inf).argmin(-1, keepdim=True)
        # Where no candidate has room: the roomiest community, as the layer's last selection found it.
        nearest = torch.where(open_near.any(-1, keepdim=True), torch.gather(recent, 2, pick), layer.roomiest)  # [B, U, 1]
        fits = torch.gather(open_, 2, nearest)  # False only where every range is full (a rewound cache)
        n = torch.gather(size, 2, nearest)
        where = torch.where(fits, torch.gather(offset, 2, nearest) + n, order.shape[-1] - 1)  # else: the discard slot
        old = torch.gather(centroid, 2, nearest[..., None].expand(b, units, 1, d))
        new = old + (key[:, :, None] - old) * (fits / (n + 1))[..., None]
        # Written by index_put_, not scatter_: a compiled step then updates the tables in place (Inductor
        # re-inplaces index_put, where a scatter into a step's input copies the whole table twice). No
        # accumulating put: on CUDA an int64 one falls back to ATen, with bounds-check launches.
        rows, heads = torch.arange(b, device=k.device)[:, None, None], torch.arange(units, device=k.device)[None, :, None]
        order.index_put_((rows, heads, where), (state.cache.length - 1).to(order.dtype).expand(b, units, 1))
        centroid.index_put_((rows, heads, nearest), new)
        shadow.index_put_((rows, heads, nearest), new.to(shadow.dtype))
        size.index_put_((rows, heads, nearest), n + fits.long())

    def select(self, state: KVState, q: Tensor) -> Selection:
        """The best-scored communities' tokens, then the sinks and the window, ``count``
        of them at most (a token selection; see the module docstring)."""
        layer = self._ready(state)
        cache = state.cache
        order, offset, size, room = layer.order, layer.offset, layer.size, layer.room
        centroid, recent = layer.centroid_key, layer.recent
        b = q.shape[0]
        h_kv = state.keys.shape[1]
        units, c = size.shape[1], size.shape[2]
        # Each unit's communities scored as keys: the group's best (group mode; one head per unit in
        # head mode) of scale·q·centroid, by the candidates' logit kernel (read once per group).
        ids = torch.arange(c, device=q.device, dtype=torch.int32).expand(b, units, c)
        scores = kernels.gathered_logits(q.to(centroid.dtype), centroid, ids, state.scale, agg="max")  # [B, U, C]

        # The budget: the forced tokens, then `free` more from the communities.
        k_max = max(self._budget.k_max(cache.capacity), min(self.sinks + self.window, cache.capacity))
        n_valid = state.num_valid()
        # The sinks of a row, then its window past them: each visible forced token once.
        n_forced = torch.clamp(n_valid, max=min(self.sinks, cache.capacity) + min(self.window, cache.capacity))
        kept = torch.minimum(torch.maximum(self._budget.count(n_valid), n_forced).clamp(max=k_max), n_valid)
        indices, count, best, roomiest = kernels.community_choice(
            scores, size, room, offset, order, cache.start, cache.length, kept - n_forced, k_max, h_kv, self.sinks,
            self.window, recent.shape[-1], cache.capacity, workspace=state.workspace)
        layer.roomiest.copy_(roomiest)  # for the next append (see the module docstring)
        # The next token's candidate communities: this query's best, per unit, ties to the lower id;
        # fewer than `candidates` repeat, cyclically, as at the layout (static: the tables' width is
        # fixed at prefill).
        top = recent.shape[-1]
        recent.copy_(best if c >= top else best[..., torch.arange(top, device=q.device) % c])
        return Selection(indices=indices, count=count, block=1)

    # ---------------------------------------------------------------------------- inspection
    def members(self, state: KVState, row: int, unit: int) -> list[list[int]]:
        """The token slots of each community of ``row``'s graph ``unit`` (a KV head in group mode, a
        query head in head mode), in the order of its range (host reads: for tests and analysis)."""
        layer = self._ready(state)
        order = layer.order[row, unit].tolist()
        return [order[o : o + s] for o, s in zip(layer.offset[row, unit].tolist(), layer.size[row, unit].tolist()) if s]


_NO_PREFILL = "CommunityKV builds its communities in prefill: decode through a Decoder, or call prefill() first"

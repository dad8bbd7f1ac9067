"""`community_choice`'s specification, in plain torch: a sort of every community by score, and its
ranges turned into token slots by prefix sums (static shapes, no host sync)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..select_pages.reference import round_for_ranking


def forced_slots(start: Tensor, length: Tensor, sinks: int, window: int, capacity: int) -> tuple[Tensor, Tensor]:
    """``(slots, kept) [B, F]``: the sinks then the window of every row (``F = sinks + window``, each
    capped at ``capacity``), and which of them are visible tokens, each forced token once."""
    sinks, window = min(sinks, capacity), min(window, capacity)
    begin = start[:, None]
    sink_slots = begin + torch.arange(sinks, device=start.device)
    win_slots = (length - window + torch.arange(window, device=start.device)).expand(start.shape[0], window)
    slots = torch.cat([sink_slots, win_slots], -1)
    return slots, torch.cat([sink_slots < length, win_slots >= begin + sinks], -1)


def community_choice(
    scores: Tensor, size: Tensor, room: Tensor, offset: Tensor, order: Tensor, start: Tensor, length: Tensor,
    free: Tensor, k_max: int, heads: int, sinks: int, window: int, top: int, capacity: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The tokens of the best-scored communities, ``free[b]`` of them per KV head, then the forced ones
    → ``(indices int32[B, H_kv, k_max], count int32[B, H_kv], best int64[B, U, min(top, C)],
    roomiest int64[B, U, 1])``.

    Per row ``b`` and unit ``u`` (``U = heads · per_kv`` units; the ``per_kv`` units of KV head ``h``
    are ``h · per_kv ...``), community ``c`` holds the slots ``order[b, u, offset : offset + size]``
    (``size`` 0: padding) and scores ``scores[b, u, c]`` (float32). A slot is *free to take* when it
    holds a visible token (``start[b] <= slot < length``) that is not forced (a sink, ``slot < start
    + sinks``, or in the window, ``slot >= length - window``).

    A KV head's communities (those of its units) are ranked by score rounded to bf16
    (`round_for_ranking`), ties to the lower ``u · C + c``; their ranges, concatenated in that order,
    give the slots free to take, each token once (a token can lie in a community of each of the
    ``per_kv`` units), and the first ``free[b]`` of them are kept: whole communities, the last one
    cut after its first tokens. ``indices`` holds the kept slots, then the forced ones (sinks, then
    window, each visible one once), then zeros; ``count`` how many. The order of the kept slots is not
    part of the contract (here: the concatenation's; the kernel writes them by community id). A token
    is in at most ``per_kv`` communities of a head, so the concatenation's first ``per_kv · k_max``
    entries hold enough of them, when ``free + forced <= k_max`` and no range holds a slot that is not
    visible (a rewound cache's).

    ``best``: each unit's first ``min(top, C)`` communities by score, ties to the lower id.
    ``roomiest``: each unit's community with the most room left, ``room - size`` (``room``: the slots
    of its range), ties to the lower id.
    """
    b, units, c = size.shape
    h_kv = heads
    per_kv = units // h_kv
    m = per_kv * c
    device = scores.device
    ranked = round_for_ranking(scores.masked_fill(size == 0, -torch.inf)).to(torch.bfloat16)
    # Exact at the ranking's bf16 precision, and a 16-bit sort key is half the radix passes.
    ranked_ids = torch.sort(ranked, dim=-1, descending=True, stable=True).indices  # [B, U, C]
    if per_kv == 1:
        by_head = ranked_ids
    else:
        by_head = torch.sort(ranked.view(b, h_kv, m), dim=-1, descending=True, stable=True).indices
    sizes = size.view(b, h_kv, m)
    ranked_sizes = torch.gather(sizes, 2, by_head)
    ends = ranked_sizes.cumsum(-1)

    # Ranges to indices: position p of the communities' concatenation (best first) lies in the
    # community of rank r = #{ends <= p}, at p - (its start) in its range. The count is a prefix sum
    # of where the ranges end (not a binary search: Inductor's fused searchsorted fails to compile
    # on Triton 3.6).
    width = per_kv * k_max
    p = torch.arange(width, device=device).expand(b, h_kv, width)
    ended = torch.zeros(b, h_kv, width + 1, dtype=ends.dtype, device=device)
    rank = ended.scatter_add_(2, ends.clamp(max=width), torch.ones_like(ends)).cumsum(-1)[..., :width]
    within = rank < m
    rank = rank.clamp(max=m - 1)
    range_start = torch.gather(ends - ranked_sizes, 2, rank)  # of the community, in the concatenation
    community = torch.gather(by_head, 2, rank)
    stride = order.shape[-1]
    where = (community // c) * stride + torch.gather(offset.view(b, h_kv, m), 2, community) + p - range_start
    # Past the chosen ranges (``~within``) the arithmetic can point beyond the layout: clamped, and
    # masked out below.
    where = where.clamp(0, per_kv * stride - 1)
    slots = torch.gather(order.view(b, h_kv, per_kv * stride), 2, where).long()
    begin, end = start.view(b, 1, 1), length.reshape(-1, 1, 1)
    ok = within & (slots >= begin) & (slots < end) & ~((slots < begin + sinks) | (slots >= end - window))

    # Each token once (its first position), then the first `free` of them. In group mode a token
    # is in one community of its KV head: no duplicates.
    unique = ok
    if per_kv > 1:
        by_slot, at = torch.sort(torch.where(ok, slots, capacity), dim=-1, stable=True)
        first_seen = torch.ones_like(ok)
        first_seen[..., 1:] = by_slot[..., 1:] != by_slot[..., :-1]
        unique = torch.zeros_like(ok).scatter(2, at, first_seen & (by_slot < capacity))
    place = unique.cumsum(-1)
    take = unique & (place <= free.view(b, 1, 1))

    # The taken tokens in the concatenation's order (the i-th at entry i), then the forced ones; the
    # rest of the row is padding (written to a spare last entry and dropped).
    f_slots, f_ok = forced_slots(start, length, sinks, window, capacity)
    n_taken = take.sum(-1)
    forced_place = n_taken[..., None] + f_ok.cumsum(-1)[:, None]
    at = torch.cat([torch.where(take, place - 1, k_max), torch.where(f_ok[:, None], forced_place - 1, k_max)], -1)
    forced = f_slots[:, None].expand(b, h_kv, -1)
    indices = torch.zeros(b, h_kv, k_max + 1, dtype=torch.int32, device=device)
    indices.scatter_(2, at, torch.cat([slots, forced], -1).int())
    count = (n_taken + f_ok.sum(-1)[:, None]).int()
    roomiest = (room - size).argmax(-1, keepdim=True)
    return indices[..., :k_max], count, ranked_ids[..., : min(top, c)], roomiest

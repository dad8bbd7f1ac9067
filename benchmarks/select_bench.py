"""Selection at bandwidth (issue 38): each page policy's selection through the old steps and through
the fused kernels, side by side, on one layer of the Llama-3.1-8B shape (32 q / 8 KV heads, head
dim 128, pages of 16, batch 1, bf16), then attention over the selection and its bandwidth.

Run on a CUDA machine::

    python -m benchmarks.select_bench                                   # 32K and 128K, the four policies
    python -m benchmarks.select_bench --contexts 131072 --policies quest0.1,entmax-kv0.1
    python -m benchmarks.select_bench --out benchmarks/results/RUN/select-bench.json

Per context and policy it first checks that the two paths choose the same entries (the fused path
must not change a token), then times each path's selection compiled (torch.compile, default mode)
and replayed as a CUDA graph (`common.graph_time_ms`: 20 calls per graph, the median of 15
replays). The old path is the same policy with the fused kernels taking no rows (its choice is
then the grouped bound, torch masks and `select_top`, as before issue 38) and the Gaussian
threshold in one program per row, and CommunityKV's choice the sort of its reference; the new path
is the library as it is. CommunityKV's communities are runs of 10 tokens split along their keys
(parts of 2-3 tokens, as the sweep's ``community-kv0.1-runs10``), made once per copy of the layer
from random queries. Then:

- ``threshold``: the Gaussian threshold alone (`kernels.gaussian_entmax_threshold` over ``[1, 32,
  P]`` pages), with float64 steps in one program per row against the split rows, then EntmaxKV's
  call (float32 steps, split) against those float64 steps, its distance from their root in units
  of the pool's scale;
- ``attention``: decode attention over the policy's selection, with its bandwidth on the bytes it
  selects (the kept tokens' keys and values), beside dense attention's.

With ``--tune`` it times launch parameters instead (each config checked against the default's
result first): the box selection (`SelectPagesConfig`) beside what bounds it from below (the
grouped page bound alone, and the selection from given scores), decode attention
(`AttentionConfig`) over every page and over the box selection, and CommunityKV's selection
(`CommunityChoiceConfig`), at each context; the fastest correct config of each case is printed
last::

    python -m benchmarks.select_bench --tune --contexts 4096,32768,131072

With ``--breakdown`` it times the fused selections stopped after each of their steps (scoring,
histogram tally, arrival, the choice's bin, the choice), to say which step a target waits on, and
the choice made by a row's last scoring program against a launch of its own; the box selection's
calls cycle through copies of the summaries past the L2 cache (`common.ROTATED_BYTES`).
The default section's and ``--tune``'s timed calls cycle through copies of the layer as well
(``--copies``; by default enough that the summaries and key sketches span that many bytes): at 128K
one layer's summaries (33.5 MB) and a selection's keys and values (54 MB at keep 0.1) are about the
size of an L2 cache, so one copy would time warmer reads than a decode step's.

Without a GPU it runs as a smoke test at toy sizes (kernels in the Triton interpreter when
``TRITON_INTERPRET=1 POLICYZOO_TRITON=1`` are set, eager, wall-clock timings that mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import os
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable, Iterator
from unittest import mock

import torch

from policyzoo import CommunityKV, EntmaxKV, Quest, inductor_compat, kernels
from policyzoo.kernels import AttentionConfig, CommunityChoiceConfig, EntmaxThresholdConfig, SelectPagesConfig
from policyzoo.kernels.config import override
from policyzoo.kernels.ops import select_pages as select_op
from policyzoo.kv.base import KVState
from policyzoo.kv.choose import choose_topk_steps
from policyzoo.selection import Selection

from . import common
from .probes import D, H, H_KV, PAGE, filled_cache, prefill_communities

CONTEXTS = (32768, 131072)
TINY_CONTEXTS = (256,)


def policies(keep: float = 0.1) -> dict[str, Callable[[], object]]:
    """The policies of issue 38, as the select probe makes them (a window of 64 tokens)."""
    return {
        f"quest{keep}": lambda: Quest(keep, page=PAGE, window=64),
        f"quest{keep}-sketch": lambda: Quest(keep, page=PAGE, window=64, bound="sketch"),
        f"quest{keep}-nominate4": lambda: Quest(keep, page=PAGE, window=64, bound="sketch", nominate=4),
        f"entmax-kv{keep}": lambda: EntmaxKV(keep, page=PAGE, window=64),
        # Communities forced to runs of 10 tokens (`common.runs_partition`), split into parts of 2-3.
        f"community-kv{keep}-runs10": lambda: CommunityKV(keep, window=64, partition=functools.partial(common.runs_partition, size=10),
                                                          workers=1),
    }


def prepared(policy, states: list[KVState], q: torch.Tensor):
    """``policy`` ready to select on each of ``states``: a `CommunityKV` gets its communities there
    (`probes.prefill_communities`); the page policies need nothing. On the CPU (a smoke test) the
    prefill takes the torch references: it is not what the probe times, and its graph kernel takes
    seconds per copy in Triton's interpreter."""
    if isinstance(policy, CommunityKV):
        with mock.patch.dict(os.environ, {"POLICYZOO_TRITON": "0"}) if common.DEVICE == "cpu" else nullcontext():
            for state in states:
                prefill_communities(policy, state, q)
    return policy


@contextmanager
def old_path() -> Iterator[None]:
    """The steps as before issue 38: the fused kernels take no rows (`kv.choose.fused_rows`), the
    Gaussian threshold runs one program per row, and CommunityKV's choice is the sort (the reference
    of `kernels.community_choice`). Kept on while a path is compiled and captured: the compiled code
    guards on the first, and each launch reads the second."""
    sort = kernels.community_choice.reference

    def sorted_choice(*args, workspace=None):
        return sort(*args)

    with (mock.patch.object(select_op, "MAX_ROW", 0), override(entmax_threshold=EntmaxThresholdConfig(split=1)),
          mock.patch.object(kernels, "community_choice", sorted_choice)):
        yield


def same_choice(a: Selection, b: Selection) -> tuple[bool, int]:
    """Whether two selections keep the same entries (as sets: the order of a selection's entries is
    not part of its contract), and how many valid entries differ."""
    if not torch.equal(a.count, b.count) or a.block != b.block:
        return False, int((a.count != b.count).sum())
    big = torch.iinfo(torch.int32).max  # past every entry: the invalid ones sort last
    ids_a = a.indices.masked_fill(~a.entry_valid(), big).sort(-1).values
    ids_b = b.indices.masked_fill(~b.entry_valid(), big).sort(-1).values
    differ = int((ids_a != ids_b).sum())
    return differ == 0, differ


def compiled(call: Callable[[KVState], Selection]) -> Callable[[KVState], Selection]:
    """``call`` compiled as the select probe compiles it (eager off CUDA: a smoke test)."""
    if common.DEVICE != "cuda":
        return call
    torch._dynamo.reset()
    inductor_compat.apply()
    return torch.compile(call, dynamic=False)


def warm(fn: Callable[[KVState], object], states: list[KVState]) -> None:
    """The first call of a compiled path on each copy of the layer (its compile, and a recompile
    wherever Dynamo tells the copies apart), outside the timing; nothing to warm off CUDA."""
    if common.DEVICE == "cuda":
        for state in states:
            fn(state)


def rotating(fn: Callable[[KVState], object], states: list[KVState]) -> Callable[[], object]:
    """``fn`` on the next copy of the layer at each call (`common.rotating`)."""
    return common.rotating([functools.partial(fn, s) for s in states])


def layer_copies(n: int, copies: int | None) -> list[KVState]:
    """The states of ``copies`` caches of one layer at context ``n``, sharing one workspace (None:
    enough copies that their summaries and key sketches, what a selection reads, span
    `common.ROTATED_BYTES`)."""
    first = filled_cache(n)
    if copies is None:
        read = sum(t.numel() * t.element_size() for t in (first.page_min[0], first.page_max[0], first.key_sketch[0]))
        copies = common.rotated_copies(read)
    workspace = kernels.Workspace(common.DEVICE)
    caches = [first] + [filled_cache(n) for _ in range(copies - 1)]
    return [KVState(c, 0, D**-0.5, workspace=workspace) for c in caches]


def call_and_time_us(call: Callable[[], object]) -> tuple[object, float]:
    """`common.call_and_time_ms` in microseconds."""
    out, ms = common.call_and_time_ms(call)
    return out, ms * 1e3


def selected_and_timed(call: Callable[[KVState], Selection], states: list[KVState]) -> tuple[Selection, float]:
    """The selection ``call`` makes on the first copy of the layer (eager), and the time of ``call``
    compiled, cycling through ``states``. On the CPU, a smoke test whose timings mean nothing, the
    eager call's own time (`call_and_time_us`): each call there takes seconds in the interpreter."""
    if common.DEVICE != "cuda":
        return call_and_time_us(lambda: call(states[0]))
    sel = call(states[0])
    fn = compiled(call)
    warm(fn, states)
    return sel, time_us(rotating(fn, states))


def selected_bytes(sel: Selection, cache, dtype_bytes: int = 2) -> float:
    """Bytes of keys and values the selection's visible tokens hold."""
    tokens = float(sel.kept_tokens(cache.token_valid()).sum())
    return tokens * D * 2 * dtype_bytes


def time_us(fn: Callable[[], object]) -> float:
    return common.graph_time_ms(fn) * 1e3


def bench_context(n: int, names: list[str], rows: list[dict], copies: int | None = None) -> None:
    """The policies' selections and the attention over them at context ``n``, each timed call on the
    next of ``copies`` copies of the layer (`layer_copies`), so that it reads the layer from memory."""
    dev = common.DEVICE
    states = layer_copies(n, copies)
    state, cache = states[0], states[0].cache
    q = torch.randn(1, H, D, device=dev, dtype=torch.bfloat16)
    print(f"n={n:>7} timed over {len(states)} copies of the layer", flush=True)

    def attend(sel: Selection) -> Callable[[], object]:
        return rotating(lambda s: kernels.decode_attention(q, s.keys, s.values, sel, s.cache.start, s.cache.length, s.scale),
                        states)

    pages = math.ceil(n / PAGE)
    dense = Selection(torch.arange(cache.num_pages, device=dev, dtype=torch.int32).expand(1, H_KV, -1).contiguous(),
                      torch.full((1, H_KV), pages, device=dev, dtype=torch.int32), block=PAGE)
    dense_us = time_us(attend(dense))
    dense_tbs = selected_bytes(dense, cache) / dense_us / 1e6
    rows.append({"context": n, "setting": "dense", "attention_us": dense_us, "attention_TB/s": dense_tbs, "copies": len(states)})
    print(f"n={n:>7} dense attention {dense_us:7.1f} us, {dense_tbs:5.2f} TB/s of its {selected_bytes(dense, cache) / 1e6:.1f} MB",
          flush=True)

    made = policies()
    for name in names:
        row = {"context": n, "setting": name, "copies": len(states)}
        with common.recorded(row, f"select_bench {name}@{n}"), torch._dynamo.config.patch(recompile_limit=64):
            policy = prepared(made[name](), states, q)
            call = lambda s: policy.select(s, q)  # noqa: E731
            with old_path():
                old, old_us = selected_and_timed(call, states)
            new, new_us = selected_and_timed(call, states)
            same, differ = same_choice(old, new)
            row.update({"same": same, "entries_differing": differ})
            attn_us = time_us(attend(new))
            nbytes = selected_bytes(new, cache)
            row.update({"old_select_us": old_us, "new_select_us": new_us, "speedup": old_us / new_us,
                        "kv_keep": float(new.kept_tokens(cache.token_valid()).mean()) / n,
                        "attention_us": attn_us, "selected_MB": nbytes / 1e6, "attention_TB/s": nbytes / attn_us / 1e6})
            print(f"n={n:>7} {name:<22} {'same' if same else f'DIFFER ({differ} entries)'}: select old {old_us:7.1f} us, "
                  f"new {new_us:7.1f} us (x{old_us / new_us:4.2f}); attention {attn_us:6.1f} us, "
                  f"{row['attention_TB/s']:5.2f} TB/s of {row['selected_MB']:.1f} MB", flush=True)
        rows.append(row)

    # The Gaussian threshold alone, at EntmaxKV's shape: [1, 32, P] pages.
    row = {"context": n, "setting": "gaussian threshold"}
    with common.recorded(row, f"select_bench threshold@{n}"):
        g = torch.Generator(device=dev).manual_seed(2)
        m = torch.randn(1, H, cache.num_pages, device=dev, generator=g)
        s = torch.rand(1, H, cache.num_pages, device=dev, generator=g) * 0.3
        counts = cache.page_counts()[:, None, :].expand_as(m)
        cap = m + 2.0

        def threshold():
            return kernels.gaussian_entmax_threshold(m, s, counts, cap, 12, workspace=state.workspace)

        with override(entmax_threshold=EntmaxThresholdConfig(split=1)):
            one, one_us = call_and_time_us(threshold)
        split, split_us = call_and_time_us(threshold)
        err = float(((one - split).abs() / (1 + one.abs())).max())
        row.update({"old_select_us": one_us, "new_select_us": split_us, "speedup": one_us / split_us, "rel_diff": err})
        print(f"n={n:>7} gaussian threshold [1, {H}, {cache.num_pages}]: one program a row {one_us:7.1f} us, "
              f"split {split_us:7.1f} us (x{one_us / split_us:4.2f}), results within {err:.1e}", flush=True)
    rows.append(row)

    # EntmaxKV's own call: every Newton step in float32 (`EntmaxKV.float64_steps`), against the float64 steps.
    row = {"context": n, "setting": "gaussian threshold, float32 steps"}
    with common.recorded(row, f"select_bench threshold-f32@{n}"):
        steps = EntmaxKV().float64_steps
        fast, fast_us = call_and_time_us(
            lambda: kernels.gaussian_entmax_threshold(m, s, counts, cap, 12, steps, workspace=state.workspace))
        err = float(((fast - split).abs() / kernels.reference.pool_scale(m, s)).max())
        row.update({"old_select_us": split_us, "new_select_us": fast_us, "speedup": split_us / fast_us,
                    "float64_steps": steps, "scaled_diff": err})
        print(f"n={n:>7} gaussian threshold, float64_steps={steps}: {fast_us:7.1f} us against the float64 steps' "
              f"{split_us:7.1f} us (x{split_us / fast_us:4.2f}), within {err:.1e} of their root (pool scale)", flush=True)
    rows.append(row)


# A `SelectPagesConfig.finish_min_row` no row reaches: every row chosen by its last scoring program.
NEVER = 1 << 30
SELECT_GRID = [dict(block_p=p, num_warps=w) for p in (32, 64, 128, 256) for w in (2, 4, 8, 16)] + [
    dict(group=g) for g in (16, 64)] + [dict(finish_min_row=0), dict(finish_min_row=NEVER)] + [
    dict(finish_warps=w) for w in (8, 32)]
COMMUNITY_GRID = [dict(chunk=c, num_warps=w) for c in (128, 256, 512, 1024, 2048) for w in (2, 4, 8)
                  if (c, w) != (512, 4)] + [dict(width=w) for w in (2, 8)]
ATTENTION_GRID = [dict(block_t=t, num_warps=w, num_stages=s, target_programs=tp, min_chunk_tokens=mc)
                  for t in (32, 64) for w in (4, 8) for s in (2, 3)
                  for tp, mc in ((256, 128), (512, 128), (512, 64), (1024, 64), (1024, 32), (2048, 32))]


def _tune(rows: list[dict], case: str, n: int, kind, grid: list[dict], call: Callable[[], object],
          same: Callable[[object, object], bool]) -> None:
    """Time ``call`` under the default `kind` config and each override of ``grid`` (fields over the
    defaults), each checked first against the default's result (``same``); a row per config."""
    if common.DEVICE != "cuda":
        grid = grid[:2]  # a smoke test: the code path, not the timings
    want, default_us = call_and_time_us(call)
    best = ("default", default_us)
    rows.append({"section": "tune", "case": case, "context": n, "config": "default", "us": default_us})
    for fields in grid:
        label = " ".join(f"{k}={v}" for k, v in fields.items())
        row = {"section": "tune", "case": case, "context": n, "config": label}
        try:
            with override(**{kind.keyword: kind(**fields)}):
                got, us = call_and_time_us(call)
                ok = same(got, want)
            row.update({"us": us, "correct": ok})
            if ok and us < best[1]:
                best = (label, us)
        except Exception as e:  # a config that does not compile (registers, shared memory) is a row too
            row["error"] = f"{type(e).__name__}: {e}"[:200]
        rows.append(row)
    rows.append({"section": "tune", "case": case, "context": n, "config": f"best: {best[0]}", "us": best[1]})
    print(f"tune n={n:>7} {case:<28} default {default_us:7.1f} us, best {best[1]:7.1f} us: {best[0]}",
          flush=True)


def tune_context(n: int, rows: list[dict], copies: int | None = None) -> None:
    """The launch-parameter grids at context ``n`` (see the module's ``--tune``), each timed call on
    the next of ``copies`` copies of the layer (`layer_copies`)."""
    dev = common.DEVICE
    states = layer_copies(n, copies)
    state, cache = states[0], states[0].cache
    q = torch.randn(1, H, D, device=dev, dtype=torch.bfloat16)
    policy = policies()["quest0.1"]()
    box = policy.select(state, q)
    print(f"tune n={n:>7} timed over {len(states)} copies of the layer", flush=True)
    bound = rotating(lambda s: kernels.quest_page_bound_grouped(q, s.cache.page_min[0], s.cache.page_max[0], s.scale), states)

    scores = bound()
    forced = torch.zeros_like(scores, dtype=torch.bool)
    forced[..., -1] = True
    count = box.count.clone()
    if kernels.select_pages_takes(scores.shape[-1]):
        rows.append({"section": "tune", "case": "grouped bound alone", "context": n, "config": "default",
                     "us": time_us(bound)})
        rows.append({"section": "tune", "case": "select_scores alone", "context": n, "config": "default",
                     "us": time_us(lambda: kernels.select_scores(scores, forced, count, box.k_max,
                                                                 workspace=state.workspace))})
        print(f"tune n={n:>7} grouped bound alone {rows[-2]['us']:7.1f} us; select from its scores "
              f"{rows[-1]['us']:7.1f} us", flush=True)
        _tune(rows, "box selection", n, SelectPagesConfig, SELECT_GRID, rotating(lambda s: policy.select(s, q), states),
              lambda a, b: same_choice(a, b)[0])

    def attention(sel: Selection) -> Callable[[], object]:
        return rotating(lambda s: kernels.decode_attention(q, s.keys, s.values, sel, s.cache.start, s.cache.length,
                                                           s.scale)[0], states)

    def close(a, b) -> bool:
        return bool(((a.float() - b.float()).norm() / b.float().norm()) < 2e-2)

    pages = math.ceil(n / PAGE)
    dense = Selection(torch.arange(cache.num_pages, device=dev, dtype=torch.int32).expand(1, H_KV, -1).contiguous(),
                      torch.full((1, H_KV), pages, device=dev, dtype=torch.int32), block=PAGE)
    _tune(rows, "attention, every page", n, AttentionConfig, ATTENTION_GRID, attention(dense), close)
    _tune(rows, "attention, box selection", n, AttentionConfig, ATTENTION_GRID, attention(box), close)
    tune_communities(n, rows, states, q)


def tune_communities(n: int, rows: list[dict], states: list[KVState], q: torch.Tensor) -> None:
    """CommunityKV's selection (its centroids' logits, then `kernels.community_choice`) at context
    ``n`` under the choice's launch parameters (`COMMUNITY_GRID`), on ``states`` in turn."""
    community = prepared(policies()["community-kv0.1-runs10"](), states, q)
    _tune(rows, "community selection", n, CommunityChoiceConfig, COMMUNITY_GRID,
          rotating(lambda s: community.select(s, q), states), lambda a, b: same_choice(a, b)[0])


STAGE_NAMES = {1: "score and store the keys", 2: "+ the histogram tally", 3: "+ the arrival counter",
               4: "+ the choice's bin", 5: "+ the choice (the op)"}


def breakdown_context(n: int, rows: list[dict]) -> None:
    """Where the fused selection's time goes at context ``n``: each launch of the box selection
    (`kernels.select_pages`) and of the selection from given scores (`kernels.select_scores`) stopped
    after each of its steps (the kernels' ``STAGES``). Stages 2 and 3 leave the histograms dirty, so
    their timed call zeroes the workspace first; the zeroing alone is timed too and subtracted."""
    from policyzoo.kernels.ops.quest_page_bound import page_score_config
    from policyzoo.kernels.ops.select_top import tiles

    if not select_op.HAS_TRITON or not kernels.select_pages_takes(math.ceil(n / PAGE)):
        print(f"breakdown n={n}: no fused kernel here (Triton: {select_op.HAS_TRITON})", flush=True)
        return
    kernel = select_op.kernel
    dev = common.DEVICE
    cache = filled_cache(n)
    state = KVState(cache, 0, D**-0.5, workspace=kernels.Workspace(dev))
    q = torch.randn(1, H, D, device=dev, dtype=torch.bfloat16)
    box = policies()["quest0.1"]().select(state, q)
    page_min, page_max = cache.page_min[0], cache.page_max[0]
    n_pages = page_min.shape[2]
    scores = kernels.quest_page_bound_grouped(q, page_min, page_max, state.scale)
    forced = torch.zeros_like(scores, dtype=torch.bool)
    forced[..., -1] = True
    count = box.count.clone()
    scratch = torch.zeros(kernel.workspace_entries(H_KV), dtype=torch.int32, device=dev)
    cfg = select_op.select_pages_config(n_pages)

    # The box selection reads the summaries (33.5 MB at 128K, which an L2 cache may hold): its timed
    # calls cycle through copies of them, as a decode step reads each layer's from memory.
    copies = common.rotated_copies(2 * page_min.numel() * page_min.element_size())
    summaries = itertools.cycle([(page_min, page_max)] + [(page_min.clone(), page_max.clone()) for _ in range(copies - 1)])

    def pages(stages: int, cfg=cfg):
        lo, hi = next(summaries)
        return kernel.select_pages(q, lo, hi, cache.start, cache.length, state.scale, box.k_max, count,
                                   PAGE, 0, 0, 0.0, 0, scratch, cfg, page_score_config(D), tiles(n_pages), stages)

    def given(stages: int, cfg=cfg):
        return kernel.select_scores(scores, forced, count, box.k_max, scratch, cfg, tiles(n_pages), stages)

    zero_us = time_us(scratch.zero_)
    rows.append({"section": "breakdown", "context": n, "case": "zero the workspace", "us": zero_us})

    def timed(launch, stages: int) -> tuple[float, float | None]:
        """``(net, with_zeroing)``: stages 2 and 3 leave the workspace dirty, so their calls zero it
        first, and it is zeroed again after them: a later stage's arrival counter must start at 0, or
        no program would find itself last and the choice would never run."""
        if stages not in (2, 3):
            return time_us(lambda: launch(stages)), None
        us = time_us(lambda: (scratch.zero_(), launch(stages)))
        scratch.zero_()
        return us - zero_us, us

    cases = (("box selection", pages, kernel._select_pages_kernel),
             ("selection from given scores", given, kernel._select_scores_kernel))
    for case, launch, fn in cases:
        for stages, what in STAGE_NAMES.items():
            known = compiled_kernels(fn)
            net, with_zeroing = timed(launch, stages)
            used = resources(fn, known)
            rows.append({"section": "breakdown", "context": n, "case": case, "stages": stages, "what": what,
                         "us": net, "us_with_zeroing": with_zeroing, "copies": copies if launch is pages else 1, **used})
            print(f"breakdown n={n:>7} {case:<28} {stages}: {what:<38} {net:7.1f} us {used or ''}", flush=True)
    # The choice's cost under other launch shapes: the op against its stage 3 (with a launch of its
    # own, the scoring launch stops at the tally).
    for case, launch, fn in cases:
        want = launch(kernel.ALL_STAGES)
        for fields in CHOICE_GRID[case]:
            other = dataclasses.replace(cfg, **fields)
            call = functools.partial(launch, cfg=other)
            known = compiled_kernels(fn)
            same = all(torch.equal(a, b) for a, b in zip(call(kernel.ALL_STAGES), want))
            arrived, _ = timed(call, 3)
            chosen, _ = timed(call, kernel.ALL_STAGES)
            assert int(scratch.abs().sum()) == 0, "the op left the workspace dirty"
            label = " ".join(f"{k}={v}" for k, v in fields.items())
            rows.append({"section": "breakdown", "context": n, "case": case, "what": label, "same": same,
                         "us_arrived": arrived, "us": chosen, **resources(fn, known)})
            print(f"breakdown n={n:>7} {case:<28} {label:<52} after arrival {arrived:6.1f} us, with the choice "
                  f"{chosen:6.1f} us {rows[-1].get('regs') or ''}{'' if same else ' CHOSE OTHER ENTRIES'}", flush=True)
    # The given scores through the public op (custom op, workspace, config lookup) beside the bare launch.
    op_us = time_us(lambda: kernels.select_scores(scores, forced, count, box.k_max, workspace=state.workspace))
    rows.append({"section": "breakdown", "context": n, "case": "selection from given scores", "what": "kernels.select_scores",
                 "us": op_us})
    print(f"breakdown n={n:>7} selection from given scores through kernels.select_scores {op_us:6.1f} us", flush=True)
    # ... and through the steps that rows longer than `MAX_SCORES_ROW` take (compiled, as in a step).
    steps = compiled(lambda s: choose_topk_steps(scores, forced, box.k_max, count, workspace=s.workspace))
    warm(steps, [state])
    steps_us = time_us(lambda: steps(state))
    rows.append({"section": "breakdown", "context": n, "case": "selection from given scores", "what": "choose_topk_steps",
                 "us": steps_us})
    print(f"breakdown n={n:>7} selection from given scores through choose_topk_steps {steps_us:6.1f} us", flush=True)


# Launch shapes of the choice's grid (`SelectPagesConfig` fields over the defaults), per case: the
# choice by the row's last scoring program (`NEVER`) under two program shapes, or by a launch of its
# own (``finish_min_row=0``) with its own warps.
CHOICE_GRID = {
    "box selection": [dict(finish_min_row=NEVER), dict(finish_min_row=NEVER, num_warps=8)] + [
        dict(finish_min_row=0, finish_warps=w) for w in (4, 8, 16, 32)],
    "selection from given scores": [dict(finish_min_row=NEVER), dict(finish_min_row=NEVER, num_warps=8)] + [
        dict(finish_min_row=0, finish_warps=w) for w in (8, 16, 32)],
}


def compiled_kernels(fn) -> set[int]:
    """The ids of a Triton function's compiled variants so far (`resources` names the newer ones)."""
    return {id(k) for k in _variants(fn)}


def _variants(fn) -> list:
    caches = getattr(fn, "device_caches", {})
    return [k for cache in caches.values() for k in (cache[0] if isinstance(cache, tuple) else cache).values()]


def resources(fn, known: set[int]) -> dict:
    """Registers and spills per thread of the variants of ``fn`` compiled since ``known`` (empty where
    none was, or off CUDA, where the interpreter compiles nothing)."""
    new = [k for k in _variants(fn) if id(k) not in known]
    for k in new:
        try:
            k._init_handles()
        except Exception:  # the attributes below stay unknown then
            pass
    if not new:
        return {}
    return {"regs": [getattr(k, "n_regs", None) for k in new], "spills": [getattr(k, "n_spills", None) for k in new]}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default=None, help="comma-separated contexts (default 32768,131072; --tiny: 256)")
    p.add_argument("--policies", default=",".join(policies()), help=f"of: {', '.join(policies())}")
    p.add_argument("--tiny", action="store_true", help="toy contexts (a CPU smoke test)")
    p.add_argument("--tune", action="store_true", help="time launch-parameter grids instead (see the module doc)")
    p.add_argument("--breakdown", action="store_true",
                   help="time the fused selections stopped after each of their steps instead (see breakdown_context)")
    p.add_argument("--copies", type=int, default=None,
                   help="copies of the layer the default and --tune sections' timed calls cycle through (default: enough to span "
                        "common.ROTATED_BYTES of what a selection reads)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    if args.copies is not None and args.copies < 1:
        p.error(f"--copies must be 1 or more, got {args.copies}")
    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else (TINY_CONTEXTS if args.tiny else CONTEXTS)
    names = [n for n in args.policies.split(",") if n]
    unknown = sorted(set(names) - set(policies()))
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; known: {', '.join(policies())}")
    rows: list[dict] = []
    meta = {"device": torch.cuda.get_device_name() if common.DEVICE == "cuda" else "cpu", "torch": torch.__version__,
            "source": common.source_digest(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    for n in contexts:
        if args.breakdown:
            breakdown_context(n, rows)
        elif args.tune:
            tune_context(n, rows, args.copies)
        else:
            bench_context(n, names, rows, args.copies)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()

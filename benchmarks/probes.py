"""Device probes behind the sweep's targets: why a step costs what it costs.

Sections (``python -m benchmarks.sweep --only variants,tune,gemv,select,profile``):
  variants each kernel's alternatives (select_top's method and warps, the attention merge's width
           and warps, the page bound's method and tiles, the sparse GEMV's split-K epilogue), each a
           `kernels.config` override, checked against the reference and timed; the merge's and the
           page bound's fastest correct ones, and select_top's rule by row length, stay in force for
           the rest of the run (the sweep's run-long overrides); and the cache-append kernel, checked and timed next
           to its torch reference
  tune     launch parameters of the split-K decode-attention kernel against torch SDPA, one layer
  gemv     the projection branch's pieces per shape: cuBLAS GEMV (both weight layouts), the sparse
           GEMV at keep 0.5 from an index list and from a threshold, and the top-k that names the kept
           features
  gemvfused  the threshold GEMV as the Decoder runs it (q|k|v and gate|up in one pass, per-column
           thresholds) at batch 1, 4 and 16, against cuBLAS on the same shapes and batch: the union
           fraction of the rows' kept inputs, the bandwidth on the weight rows read, and a grid of
           launch parameters (weights rotated over copies larger than the L2 cache)
  select   each KV policy's selection cost, separately from the attention it feeds, on one layer
           (32 q / 8 KV heads, head dim 128, pages of 16), with the selection compiled
           (torch.compile, default mode) and captured in a CUDA graph
  profile  per-kernel GPU time of a compiled decode step (few layers, no CUDA graphs so the profiler
           sees every kernel), grouped by kernel name; written as a table per setting

Every figure is a median of CUDA-event timings after warm-up (`common.cuda_time_ms`, `graph_time_ms`).
"""

from __future__ import annotations

import math
import time
import traceback
from contextlib import ExitStack
from typing import Callable
from dataclasses import replace
from functools import partial

import torch
import torch.nn.functional as F

from policyzoo import SSA, AttentionTopK, CommunityKV, EntmaxKV, Forecast, Quest, inductor_compat, kernels
from policyzoo.cache import SKETCH, SUMMARIES, PagedKVCache
from policyzoo.kernels import AttentionConfig, GemvConfig, PageScoreConfig, SelectTopConfig, SketchScoreConfig
from policyzoo.kernels.config import current, override
from policyzoo.kv import ForecastHeads
from policyzoo.kv.base import KVState
from policyzoo.selection import Selection

from . import common

H, H_KV, D, PAGE = 32, 8, 128, 16
HIDDEN = 4096  # the 8B model's hidden size: Forecast's heads read the hidden state

def _dense_selection(b: int, pages: int, device) -> Selection:
    idx = torch.arange(pages, device=device, dtype=torch.int32).expand(b, H_KV, -1).contiguous()
    return Selection(idx, torch.full((b, H_KV), pages, device=device, dtype=torch.int32), block=PAGE)


def _dense_layer(n: int):
    """One layer's random bf16 decode inputs at context ``n`` with every page selected:
    ``(q, keys, values, start, length, selection)``."""
    dev = common.DEVICE
    q = torch.randn(1, H, D, device=dev, dtype=torch.bfloat16)
    keys = torch.randn(1, H_KV, n, D, device=dev, dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    start, length = torch.zeros(1, dtype=torch.long, device=dev), torch.tensor(n, device=dev)
    return q, keys, values, start, length, _dense_selection(1, n // PAGE, dev)


# ------------------------------------------------------------------------------------------ tune
# Launch parameters the tune section tries: (BLOCK_T, warps, stages, target programs, min chunk tokens).
TUNE_GRID = [(bt, w, st, tp, mc) for bt, w, st in ((32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 8, 2),
                                                   (128, 8, 3))
             for tp, mc in ((512, 128), (1056, 128), (1056, 64), (1056, 32), (512, 256), (2112, 32))]


def section_tune(contexts, rows, grid=None):
    """Time the dense split-K kernel over launch-parameter variants; SDPA on the same caches. Each
    timing cycles through copies of the layer that together exceed the L2 cache (`common.ROTATED_BYTES`)."""
    dev = common.DEVICE
    grid = grid or TUNE_GRID
    if dev == "cpu":  # smoke test under the interpreter: one variant
        grid = grid[:1]
    for n in contexts:
        kv_bytes = 2 * H_KV * n * D * 2
        copies = common.rotated_copies(kv_bytes)
        layers = [_dense_layer(n) for _ in range(copies)]
        q, keys, values, start, length, sel = layers[0]
        scale = D**-0.5
        ref = F.scaled_dot_product_attention(q[:, :, None], keys, values, scale=scale, enable_gqa=True)[:, :, 0]
        t_sdpa = common.graph_time_ms(common.rotating([
            partial(F.scaled_dot_product_attention, l[0][:, :, None], l[1], l[2], scale=scale, enable_gqa=True) for l in layers]))
        rows.append({"section": "tune", "setting": "torch SDPA", "context": n, "us": t_sdpa * 1e3,
                     "TB/s": kv_bytes / (t_sdpa * 1e-3) / 1e12, "copies": copies})
        kernel_calls = common.rotating([
            partial(torch.ops.policyzoo.decode_attention, l[0], l[1], l[2], l[5].indices, l[5].count, None, PAGE, l[3], l[4], scale)
            for l in layers])
        for bt, w, st, tp, mc in grid:
            row = {"section": "tune", "setting": f"BLOCK_T={bt} warps={w} stages={st} programs={tp} min_chunk={mc}", "context": n,
                   "copies": copies}
            try:
                cfg = replace(current(AttentionConfig), block_t=bt, num_warps=w, num_stages=st, target_programs=tp,
                              min_chunk_tokens=mc)
                with override(attention=cfg):
                    out, _ = torch.ops.policyzoo.decode_attention(q, keys, values, sel.indices, sel.count, None, PAGE,
                                                                  start, length, scale)
                    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                    t = common.graph_time_ms(kernel_calls)
                row.update({"us": t * 1e3, "TB/s": kv_bytes / (t * 1e-3) / 1e12, "vs_sdpa": t_sdpa / t, "rel_err": err})
                print(f"tune n={n} {row['setting']:<60} {t*1e3:7.1f} us  x{t_sdpa/t:4.2f} of SDPA  err {err:.1e}", flush=True)
            except Exception as e:  # a variant that does not compile (too many registers) is a row too
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(row)
        del layers


# ------------------------------------------------------------------------------------------ gemv
GEMV_SHAPES = {"q|k|v 4096->6144": (4096, 6144), "o 4096->4096": (4096, 4096),
               "gate|up 4096->28672": (4096, 28672), "down 14336->4096": (14336, 4096)}


def section_gemv(rows, keep: float = 0.5):
    dev = common.DEVICE
    for label, (d_in, d_out) in GEMV_SHAPES.items():
        if dev == "cpu":  # smoke test: the same code at toy sizes
            d_in, d_out = d_in // 64, d_out // 64
        x = torch.randn(1, d_in, device=dev, dtype=torch.bfloat16)
        w = torch.randn(d_out, d_in, device=dev, dtype=torch.bfloat16) * 0.02
        w_t = w.t().contiguous()
        k = math.ceil(keep * d_in)
        idx = x.abs().topk(k, dim=-1, sorted=False).indices
        count = torch.full((1,), k, dtype=torch.int32, device=dev)
        t = x.abs().float().kthvalue(d_in - k + 1, dim=-1).values.reshape(())
        wbytes = d_in * d_out * 2
        variants = {
            "cuBLAS x@W^T (W out-major)": (lambda: F.linear(x, w), 1.0),
            "cuBLAS x@w_t (input-major view)": (lambda: F.linear(x, w_t.t()), 1.0),
            f"sparse GEMV index keep {keep}": (lambda: kernels.sparse_gemv_index(x, idx, w_t), keep),
            f"sparse GEMV threshold keep {keep}": (lambda: kernels.sparse_gemv_threshold(x, t, w_t), keep),
            f"topk of |x| (k={k})": (lambda: x.abs().topk(k, dim=-1, sorted=False), 0.0),
            "topk + sparse GEMV index": (lambda: kernels.sparse_gemv_index(x, x.abs().topk(k, dim=-1, sorted=False).indices, w_t), keep),
            f"select_top of |x| (k={k})": (lambda: kernels.select_top(x, count, k, absolute=True), 0.0),
            "select_top + sparse GEMV index": (lambda: kernels.sparse_gemv_index(x, kernels.select_top(x, count, k, absolute=True), w_t), keep),
        }
        dense_us = None
        for name, (fn, frac) in variants.items():
            us = common.graph_time_ms(fn) * 1e3
            dense_us = dense_us or us
            row = {"section": "gemv", "shape": label, "setting": name, "us": us,
                   "TB/s": wbytes * frac / (us * 1e-6) / 1e12 if frac else float("nan"), "vs_cublas": dense_us / us}
            rows.append(row)
            print(f"gemv {label:<22} {name:<36} {us:7.1f} us  {row['TB/s']:5.2f} TB/s  x{dense_us/us:4.2f}", flush=True)


def section_gemv_tune(rows, keep: float = 0.5):
    """The index GEMV at keep 0.5 over launch parameters: outputs per program (up to whole 2 KB rows
    of the weight), rows per tile, warps and the split-K's program target. Combinations whose fp32
    accumulator would take over 128 registers per thread are skipped."""
    dev = common.DEVICE
    workspace = kernels.Workspace(dev)  # the arrival counters, as a Decoder makes them
    grid = [(bn, bk, w, tp) for bn in (64, 256, 1024) for bk in (8, 16, 32, 128) for w in (4, 8) for tp in (512, 1024)
            if bn * bk <= 128 * 32 * w and bn * bk >= 32 * w * 8]
    if dev == "cpu":
        grid = grid[:1]
    for label, (d_in, d_out) in GEMV_SHAPES.items():
        if dev == "cpu":
            d_in, d_out = d_in // 64, d_out // 64
        x = torch.randn(1, d_in, device=dev, dtype=torch.bfloat16)
        w_t = torch.randn(d_in, d_out, device=dev, dtype=torch.bfloat16) * 0.02
        idx = kernels.select_top(x, torch.full((1,), math.ceil(keep * d_in), dtype=torch.int32, device=dev),
                                 math.ceil(keep * d_in), absolute=True)
        ref = kernels.reference.sparse_gemv_index(x.float(), idx, w_t.float())
        wbytes = d_in * d_out * 2 * keep
        for bn, bk, w, tp in grid:
            row = {"section": "gemvtune", "shape": label, "setting": f"BLOCK_N={bn} BLOCK_K={bk} warps={w} programs={tp}"}
            try:
                with override(gemv=replace(current(GemvConfig), block_n=bn, block_k=bk, num_warps=w, target_programs=tp)):
                    y = kernels.sparse_gemv_index.triton(x, idx, w_t, workspace=workspace)
                    err = ((y.float() - ref).norm() / ref.norm()).item()
                    us = common.graph_time_ms(lambda: kernels.sparse_gemv_index.triton(x, idx, w_t, workspace=workspace)) * 1e3
                row.update({"us": us, "TB/s": wbytes / (us * 1e-6) / 1e12, "rel_err": err})
                print(f"gemvtune {label:<22} {row['setting']:<50} {us:7.1f} us {row['TB/s']:5.2f} TB/s err {err:.1e}", flush=True)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(row)


# The projections as the Decoder runs them on Llama-3.1-8B: d_in and the members' d_out.
GROUP_SHAPES = {"q|k|v": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate|up": (4096, (14336, 14336)),
                "down": (14336, (4096,))}


def gemv_grid(batch: int, full: bool = True) -> list[dict]:
    """Tile shapes the fused-threshold probe tries first. At batch 1: the scanning loop with 8 to
    64 fp32 accumulators per thread (``block_k x block_n`` products over the warps' threads), and the
    row-block kernel through tl.dot with the one row in a block (`GemvConfig.dot_from_rows` 1),
    whose weight tiles Triton pipelines as dot operands. (TEAL's layout, `tile_sum` and
    `atomic_sum`, was 13-20% slower than the loop at best on every 8B group: no longer tried.)
    The tl.dot tiles at batch > 1. Without ``full``, batch 1 tries the tl.dot tiles alone (the loop's
    tiles were measured in H200 run 10: `GemvConfig`'s shape rule follows them)."""
    dot = [dict(block_n=bn, block_k=bk, num_warps=w) for bn in (64, 128, 256) for bk in (16, 32, 64) for w in (4, 8)
           if bn * bk // (32 * w) <= 64]
    if batch == 1:
        one_row_dot = [dict(c, dot_from_rows=1, num_stages=st) for c in dot for st in (3, 5)]
        if not full:
            return one_row_dot
        loop = [dict(block_n=bn, block_k=bk, num_warps=w) for bn in (64, 128, 256, 512) for bk in (8, 16, 32, 64, 128)
                for w in (2, 4, 8) if 8 <= bn * bk // (32 * w) <= 64]
        return one_row_dot + loop
    return dot


def gemv_refinements(best: dict) -> list[dict]:
    """Second pass around the best tile shape: activations loaded a tile ahead, or the slice's
    activations asked for in L1 before the loop (`GemvConfig.warm_x`), a register cap for more
    programs an SM (`GemvConfig.max_registers`), pipelining depth and the split of the features."""
    return [dict(best, prefetch=True, num_stages=st) for st in (1, 2, 3)] + [dict(best, warm_x=True)] + [
        dict(best, max_registers=r) for r in (128, 168)] + [
        dict(best, num_stages=st) for st in (1, 2, 4, 5)] + [
        dict(best, target_programs=tp, min_tiles_per_split=mt) for tp in (256, 1024, 2048) for mt in (1, 4)]


def section_gemv_fused(rows, deadline: float, keep: float = 0.5, batches=(1, 4, 16), tune: bool = True,
                       full_grid: bool = True):
    """Per projection group and batch: cuBLAS ``x @ W^T`` and the threshold GEMV (per-column
    thresholds where the group has several members), each member keeping about ``keep`` of every
    row's inputs. ``union`` is the fraction of weight rows some row keeps, what the kernel reads;
    TB/s counts those rows only."""
    dev = common.DEVICE
    workspace = kernels.Workspace(dev)  # the arrival counters, as a Decoder makes them

    def gemv(x, t, w, seg):
        return kernels.sparse_gemv_threshold.triton(x, t, w, None, seg, workspace=workspace)

    g = torch.Generator(device=dev).manual_seed(0)
    for label, (d_in, sizes) in GROUP_SHAPES.items():
        if dev == "cpu":  # smoke test: the same code at toy sizes
            d_in, sizes = d_in // 64, tuple(max(16, n // 64) for n in sizes)
        d_out, segment = sum(sizes), math.gcd(*sizes)
        wbytes = d_in * d_out * 2
        copies = common.weight_copies(wbytes)
        ws = [torch.randn(d_in, d_out, device=dev, dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(copies)]
        for b in batches:
            if time.perf_counter() > deadline:
                raise common.Deadline
            x = torch.randn(b, d_in, device=dev, dtype=torch.bfloat16, generator=g)
            mags = x.abs().float()
            # Each member its own threshold near the keep quantile, as calibration gives.
            member_t = [torch.quantile(mags[0], 1 - keep).item() * (1 + 0.05 * j) for j in range(len(sizes))]
            t = torch.tensor(member_t, device=dev).repeat_interleave(torch.tensor(sizes, device=dev))[None, :]
            seg = segment if len(sizes) > 1 else 0
            if len(sizes) == 1:
                t = t[:, :1].reshape(())
            kept_rows = (mags[:, None, :] >= torch.tensor(member_t, device=dev)[None, :, None]).any(0).any(0)
            union = kept_rows.float().mean().item()
            read = union * wbytes
            ref = kernels.reference.sparse_gemv_threshold(x.float(), t, ws[0].float(), None, seg)
            y = gemv(x, t, ws[0], seg)
            err = ((y.float() - ref).norm() / ref.norm()).item()
            dense_us = common.graph_time_ms(common.rotating([lambda w=w: F.linear(x, w.t()) for w in ws])) * 1e3
            base = {"section": "gemvfused", "shape": label, "batch": b, "union": union, "cublas_us": dense_us,
                    "cublas_TB/s": wbytes / (dense_us * 1e-6) / 1e12}
            def run_config(name: str, c: dict) -> None:
                if time.perf_counter() > deadline:  # a group's grid is long: stop between configs
                    raise common.Deadline
                row = dict(base, setting=f"threshold GEMV {name}", config=c)
                try:
                    with override(gemv=replace(current(GemvConfig), **c)):
                        yc, ms = common.call_and_time_ms(lambda: gemv(x, t, ws[0], seg),
                                                         timed=common.rotating([lambda w=w: gemv(x, t, w, seg) for w in ws]))
                        e = ((yc.float() - ref).norm() / ref.norm()).item()
                        us = ms * 1e3
                    row.update({"us": us, "TB/s": read / (us * 1e-6) / 1e12, "vs_cublas": dense_us / us, "rel_err": e})
                    print(f"gemvfused {label:<8} B={b:<3} union {union:.3f} {name:<46} {us:7.1f} us {row['TB/s']:5.2f} TB/s "
                          f"(cuBLAS {dense_us:6.1f} us {base['cublas_TB/s']:4.2f} TB/s) x{dense_us/us:4.2f} err {e:.1e}", flush=True)
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"[:200]
                    print(f"gemvfused {label} B={b} {name}: FAILED {row['error']}", flush=True)
                rows.append(row)

            run_config("default", {})
            if tune:
                first = len(rows)
                for c in gemv_grid(b, full_grid)[: 1 if dev == "cpu" else None]:
                    run_config(" ".join(f"{k}={v}" for k, v in c.items()), c)
                timed = [r for r in rows[first:] if "us" in r]
                if timed:
                    best = min(timed, key=lambda r: r["us"])["config"]
                    for c in gemv_refinements(best)[: 1 if dev == "cpu" else None]:
                        run_config(" ".join(f"{k}={v}" for k, v in c.items()), c)
            assert err < 2e-2, f"gemvfused {label} B={b}: rel err {err:.1e}"


# -------------------------------------------------------------------------------------- variants
def _pick(rows, section, label, fn, check, candidates: dict[str, dict]) -> tuple[str, dict]:
    """Run ``check`` (an error string, "" when correct) and time ``fn`` under each candidate
    (name -> `kernels.config.override` keywords), record every row and the fastest correct one, and
    return that one's ``(name, keywords)``: the caller keeps it for the run or not.
    """
    best = None
    for name, configs in candidates.items():
        row = {"section": section, "shape": label, "setting": name}
        try:
            with override(**configs):
                problem, ms = common.call_and_time_ms(check, timed=fn)
                us = ms * 1e3
            row.update({"us": us, "correct": not problem})
            if problem:
                row["error"] = problem[:200]
            elif best is None or us < best[1]:
                best = (name, us)
            print(f"{section} {label:<34} {name:<28} {us:8.2f} us {'ok' if not problem else 'WRONG: ' + problem}", flush=True)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:200]
            print(f"{section} {label} {name}: FAILED {row['error']}", flush=True)
        rows.append(row)
    if best is None:
        raise RuntimeError(f"{section} {label}: no variant ran correctly")
    rows.append({"section": section, "shape": label, "setting": f"chosen: {best[0]}", "us": best[1]})
    print(f"{section} {label}: chose {best[0]}", flush=True)
    return best[0], candidates[best[0]]


def _attention_case(q, keys, values, start, length, sel):
    """``(call, check)`` for the split-K decode-attention kernel over ``sel``: the check compares
    with the fp32 torch reference and returns an error string ("" when correct)."""
    ref, _ = kernels.reference.decode_attention(q.float(), keys.float(), values.float(), sel, start, length, D**-0.5)

    def call():
        return torch.ops.policyzoo.decode_attention(q, keys, values, sel.indices, sel.count, None, PAGE, start, length,
                                                    D**-0.5)

    def check():
        err = ((call()[0].float() - ref).norm() / ref.norm()).item()
        return "" if err < 1e-2 else f"rel err {err:.1e}"

    return call, check


VARIANT_GROUPS = ("select_top", "merge", "page_bound", "sketch_bound", "attention_pages", "epilogue", "append")


def section_variants(rows, run: ExitStack, groups=VARIANT_GROUPS):
    """The alternatives a kernel's config offers, timed against each other and checked against the
    torch reference, and printed, so the defaults in `kernels.config` can follow the measurement;
    some are kept for the rest of the run: their overrides enter ``run``, which the sweep holds open
    until it ends. The kernels' scratch buffers (histograms, arrival counters) are one `kernels.Workspace`,
    as a Decoder on CUDA makes one."""

    def keep_for_run(**configs) -> None:
        run.enter_context(override(**configs))

    dev = common.DEVICE
    workspace = kernels.Workspace(dev)
    small = dev == "cpu"  # smoke test: toy sizes
    # select_top's search and warps on rows of activations (bf16 |x|, keep 0.5) and of pages (fp32,
    # keep 0.1, 8 KV heads), one just over a power of two (tile and tail), one with forced pages.
    shapes = {"|x| 4096 bf16 keep 0.5": (1, 4096, torch.bfloat16, True, 0.5),
              "|x| 14336 bf16 keep 0.5": (1, 14336, torch.bfloat16, True, 0.5),
              "pages 8192 fp32 x8 keep 0.1": (8, 8192, torch.float32, False, 0.1),
              "pages 8203 fp32 x8 keep 0.1": (8, 8203, torch.float32, False, 0.1),
              "pages 8192 fp32 x8 keep 0.1, 12 forced": (8, 8192, torch.float32, False, 0.1)}
    hist_from = None  # (entries, chunk) of the shortest bf16 row the histograms won
    base = current(SelectTopConfig)
    for label, (r, n, dtype, absolute, keep) in shapes.items() if "select_top" in groups else ():
        n = n // 64 if small else n
        s = torch.randn(r, n, device=dev).to(dtype)
        if "forced" in label:  # as Quest forces its sink and window pages: +inf above finite bounds
            s[:, :4] = s[:, -8:] = torch.inf
        k = math.ceil(keep * n)
        count = torch.full((r,), k, dtype=torch.int32, device=dev)
        want = kernels.reference.select_top(s, count, k, absolute)

        def check():
            got = kernels.select_top.triton(s, count, k, absolute, workspace=workspace)
            return "" if torch.equal(got, want) else f"{int((got != want).sum())} positions differ"

        fn = lambda: kernels.select_top.triton(s, count, k, absolute, workspace=workspace)  # noqa: E731
        # The warps (by entries held, or fixed; 1-2 warps measured 1.7-4x slower on 4,096 entries).
        # The search interpolates: halving only measured slower on every row.
        counts = (0, 4) if small else (0, 4, 8) if n <= 4096 else (0, 8, 16)
        candidates = {f"interp_steps={base.interp_steps} warps={w or 'by size'}":
                      {"select_top": replace(base, method="program", num_warps=w)} for w in counts}
        if dtype == torch.bfloat16:  # the row spread over programs of `hist_chunk` entries, four launches
            for chunk in ((64,) if small else (512, 1024, 2048)):
                hist = replace(base, method="histogram", hist_chunk=chunk)
                candidates[f"histogram chunk={chunk}"] = {"select_top": hist}
        chosen, configs = _pick(rows, "variants", f"select_top {label}", fn, check, candidates)
        if chosen.startswith("histogram") and (hist_from is None or n < hist_from[0]):
            hist_from = (n, configs["select_top"].hist_chunk)
    if "select_top" in groups:
        # One fixed choice would not suit every row: a rule by row length, with bf16 rows as long as
        # the shortest one the histograms won by histograms (in that chunk), or the default rule.
        if hist_from is not None:
            keep_for_run(select_top=replace(base, method="auto", hist_min_n=hist_from[0], hist_chunk=hist_from[1]))
        cfg = current(SelectTopConfig)
        rule = f"METHOD={cfg.method}" + (
            f" HIST_MIN_N={cfg.hist_min_n} HIST_CHUNK={cfg.hist_chunk}" if cfg.method == "auto" else "")
        rows.append({"section": "variants", "shape": "select_top", "setting": f"rule for the rest of the run: {rule}"})
        print(f"variants select_top: {rule} for the rest of the run", flush=True)

    # The attention merge, a launch of its own: in fixed steps of 32 chunk partials or all of them in
    # one step, with 1-8 warps. The winner at the longest context is kept.
    merge_winner = None
    for n in ((256,) if small else (32768, 131072)) if "merge" in groups else ():
        fn, check = _attention_case(*_dense_layer(n))
        base = current(AttentionConfig)
        merges = {f"merge launch BLOCK_C={bc or 'all'} warps={w}": {"attention": replace(base, block_c=bc, merge_warps=w)}
                  for bc in (32, 0) for w in ((2,) if small else (1, 2, 4, 8))}
        _, merge_winner = _pick(rows, "variants", f"attention dense {n // 1024}K", fn, check, merges)
    if merge_winner is not None:
        keep_for_run(**merge_winner)

    # Quest page bound over a 128K context, folded over the group: method, tile and warps, on bf16
    # summaries (the cache keeps its extremes in its own dtype). The winner is kept.
    if "page_bound" in groups:
        pages = 8192 // (64 if small else 1)
        q = torch.randn(1, H, D, device=dev, dtype=torch.bfloat16)
        centre = torch.randn(1, H_KV, pages, D, device=dev)
        mn, mx = (centre - 0.5).to(torch.bfloat16), (centre + 0.5).to(torch.bfloat16)
        want = kernels.reference.quest_page_bound_grouped(q, mn, mx, D**-0.5, "max")

        def check():
            got = kernels.quest_page_bound_grouped.triton(q, mn, mx, D**-0.5, "max")
            err = ((got - want).abs().max() / want.abs().max()).item()
            return "" if err < 1e-5 else f"max rel err {err:.1e}"

        fn = lambda: kernels.quest_page_bound_grouped.triton(q, mn, mx, D**-0.5, "max")  # noqa: E731
        base = current(PageScoreConfig)
        tiles = {f"{m} BLOCK_P={bp} warps={w}": {"page_score": replace(base, method=m, block_p=bp, num_warps=w)}
                 for m in PageScoreConfig.METHODS for bp in (16, 32, 64) for w in (2, 4, 8)}
        if small:
            tiles = dict(list(tiles.items())[::9])
        _, chosen = _pick(rows, "variants", "page bound 128K bfloat16", fn, check, tiles)
        keep_for_run(**chosen)

    # The key-sketch page bound over a whole 128K cache, group-folded as Quest ranks by it: the
    # method (fp32 sums, a dot per page, decoded fp16 keys through one dot), pages per program and
    # warps. Each is checked as an upper bound of the reference within 0.05 of it (per unit of the
    # logit's scale); the fastest correct one is kept for the run.
    if "sketch_bound" in groups:
        n = 64 if small else 131072  # 4 pages: the interpreter takes seconds a page for half2
        cache = filled_cache(n)
        q = torch.randn(1, H, D, device=dev, dtype=torch.bfloat16)
        args = (q, cache.key_sketch[0], cache.page_min[0], cache.page_max[0], cache.start, cache.length, D**-0.5, "max")
        want = kernels.reference.sketch_page_bound(*args)
        live = want.isfinite()

        # The "half2" method's bound may sit up to twice its slack above the reference's.
        slack = 2 * kernels.reference.half2_slack(q, *args[2:4], D**-0.5, "max")[live]

        def check():
            got = kernels.sketch_page_bound.triton(*args)
            if not torch.equal(got.isfinite(), live):
                return "other pages are empty"
            over = (got - want)[live]
            if bool((over < -1e-3 * (1 + want[live].abs())).any()):
                return f"under the reference by {-over.min().item():.1e}"
            if current(SketchScoreConfig).method == "half2":
                over = over - slack
            return "" if over.max().item() < 0.05 else f"over the reference by {over.max().item():.2f}"

        fn = lambda: kernels.sketch_page_bound.triton(*args)  # noqa: E731
        base = current(SketchScoreConfig)
        tiles = {f"{m} BLOCK_P={bp} warps={w}": {"sketch_score": replace(base, method=m, block_p=bp, num_warps=w)}
                 for m in SketchScoreConfig.METHODS if m not in ("rows", "half2") for bp in (2, 4, 8) for w in (2, 4, 8)}
        # "half2" gives each thread a run of 4 code words of one page: 8 pages a warp at head dim 128.
        tiles |= {f"half2 BLOCK_P={bp} warps={w}": {"sketch_score": replace(base, method="half2", block_p=bp, num_warps=w)}
                  for w in (1, 2, 4) for bp in (4 * w, 8 * w)}
        # "rows" spreads a program's pages over its threads, a few tokens of one page each: wider tiles.
        tiles |= {f"rows BLOCK_P={bp} warps={w} words={vw}":
                  {"sketch_score": replace(base, method="rows", block_p=bp, num_warps=w, words=vw)}
                  for bp in (8, 16, 32) for w in (1, 2, 4) for vw in (1, 2, 4)}
        if small:  # one tile a method: the interpreter runs each config several times
            tiles = {k: v for k, v in tiles.items()
                     if k.endswith(("BLOCK_P=4 warps=4", "BLOCK_P=8 warps=1 words=4", "half2 BLOCK_P=8 warps=1"))}
        _, chosen = _pick(rows, "variants", "sketch bound 128K bfloat16", fn, check, tiles)
        keep_for_run(**chosen)

    # Decode attention over a sparse page selection (1/10 of the pages at 128K, as Quest(0.1) picks):
    # the split's size and the tile. Reported only (the compiled rows compare dense and sparse steps
    # through one set of parameters).
    if "attention_pages" in groups:
        n = 4096 if small else 131072
        q, keys, values, start, length, _ = _dense_layer(n)
        pages = n // PAGE
        k10 = math.ceil(pages / 10)
        perm = torch.stack([torch.randperm(pages, device=dev)[:k10].sort().values for _ in range(H_KV)]).int()[None]
        sel = Selection(perm.contiguous(), torch.full((1, H_KV), k10, device=dev, dtype=torch.int32), block=PAGE)
        fn, check = _attention_case(q, keys, values, start, length, sel)
        base = current(AttentionConfig)
        knobs = {f"programs={tp} BLOCK_T={bt} warps={w} stages={st}":
                 {"attention": replace(base, target_programs=tp, block_t=bt, num_warps=w, num_stages=st)}
                 for tp in (512, 1024, 2048) for bt in (32, 64) for w in (4,) for st in (2, 3)}
        if small:
            knobs = dict(list(knobs.items())[::6])
        _pick(rows, "variants", "attention 1/10 pages 128K", fn, check, knobs)

    # The sparse GEMV's split-K epilogue: summed by the last program of each output block (an
    # arrival counter), or by a launch of its own; the four Llama-8B shapes at keep 0.5. Reported
    # only: one shape's winner need not suit the others.
    if "epilogue" in groups:
        base = current(GemvConfig)
        modes = {"epilogue in the last program": {"gemv": replace(base, fuse_epilogue=True, min_fused_split=2)},
                 "epilogue launch": {"gemv": replace(base, fuse_epilogue=False)}}
        for label, (d_in, d_out) in GEMV_SHAPES.items():
            d_in, d_out = (d_in // 32, d_out // 32) if small else (d_in, d_out)
            x = torch.randn(1, d_in, device=dev, dtype=torch.bfloat16)
            w_t = torch.randn(d_in, d_out, device=dev, dtype=torch.bfloat16) * d_in**-0.5
            k = math.ceil(0.5 * d_in)
            idx = kernels.select_top(x, torch.full((1,), k, dtype=torch.int32, device=dev), k, absolute=True)
            want = kernels.reference.sparse_gemv_index(x.float(), idx, w_t.float())

            def check(x=x, idx=idx, w_t=w_t, want=want):
                got = kernels.sparse_gemv_index.triton(x, idx, w_t, workspace=workspace)
                err = ((got.float() - want).norm() / want.norm()).item()
                return "" if err < 1e-2 else f"rel err {err:.1e}"

            fn = lambda x=x, idx=idx, w_t=w_t: kernels.sparse_gemv_index.triton(x, idx, w_t, workspace=workspace)  # noqa: E731
            _pick(rows, "variants", f"sparse GEMV {label} keep 0.5", fn, check, modes)

    # The decode-step cache append (key, value, the touched page's summaries) as one kernel, checked
    # against the torch reference and timed next to it (eager torch: in a compiled step Inductor fuses
    # the key's copy with its RoPE, so this is the kernel's cost, not the step's saving).
    if "append" in groups:
        n = 4096 if small else 32768
        for page in (PAGE, 64):
            for kept in ((), ("page_min", "page_max"), SUMMARIES):
                cache = PagedKVCache(1, 1, H_KV, D, n + 2 * page, page_size=page, dtype=torch.bfloat16, device=dev,
                                     summaries=kept)
                cache.keys[0].normal_()
                cache.reset(torch.zeros(1, dtype=torch.long, device=dev), n + page // 2)
                cache.summarise(0, slice(0, cache.num_pages))
                k, v = (torch.randn(1, H_KV, 1, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
                dest = lambda c: tuple(getattr(c, s)[0] if c.keeps(s) else None for s in SUMMARIES)  # noqa: E731
                args = lambda c: (k, v, c.keys[0], c.values[0], dest(c), c.start, c.length, page)  # noqa: E731
                twin = PagedKVCache(1, 1, H_KV, D, n + 2 * page, page_size=page, dtype=torch.bfloat16, device=dev,
                                    summaries=kept)
                for a, b in zip(cache.tensors(), twin.tensors()):
                    b.copy_(a)
                kernels.cache_append.triton(*args(cache))
                kernels.reference.cache_append(*args(twin))
                # Mean and std are rounded to the cache's dtype from fp32 sums taken in another order: an ulp apart.
                rounded = {id(t) for s in ("page_mean", "page_std") if cache.keeps(s) for t in getattr(cache, s)}
                tol = lambda t: torch.finfo(t.dtype).eps if id(t) in rounded else 1e-5  # noqa: E731
                problem = "" if all(torch.allclose(a.float(), b.float(), rtol=tol(a), atol=tol(a))
                                    for a, b in zip(cache.tensors(), twin.tensors())) else "differs from the reference"
                label = f"cache append page {page}, {len(kept)} summaries"
                for name, fn in (("kernel", lambda: kernels.cache_append.triton(*args(cache))),
                                 ("torch reference (eager)", lambda: kernels.reference.cache_append(*args(twin)))):
                    us = common.graph_time_ms(fn) * 1e3
                    rows.append({"section": "variants", "shape": label, "setting": name, "us": us, "correct": not problem})
                    print(f"variants {label:<34} {name:<28} {us:8.2f} us {'ok' if not problem else 'WRONG: ' + problem}",
                          flush=True)


# ---------------------------------------------------------------------------------------- select
def select_policies(keep: float = 0.1) -> dict:
    return {
        f"quest{keep}": lambda: Quest(keep, page=PAGE, window=64),
        f"attn-topk{keep}": lambda: AttentionTopK(keep, window=64),
        f"ssa{keep / 2}+{keep / 2}": lambda: SSA(keep / 2, keep / 2, page=PAGE, window=64),
        f"entmax-kv{keep} (softmax)": lambda: EntmaxKV(keep, page=PAGE, window=64),
        # Two stages: the candidates' exact logits (`kernels.gathered_logits`), then tokens.
        f"quest{keep}-rescore3": lambda: Quest(keep, page=PAGE, window=64, rescore=3),
        # Pages ranked by the 4-bit key sketch's bound (`kernels.sketch_page_bound`).
        f"quest{keep}-sketch": lambda: Quest(keep, page=PAGE, window=64, bound="sketch"),
        # Two levels: the box nominates 2 or 4 times the pages; only their codes are read.
        f"quest{keep}-nominate2": lambda: Quest(keep, page=PAGE, window=64, bound="sketch", nominate=2),
        f"quest{keep}-nominate4": lambda: Quest(keep, page=PAGE, window=64, bound="sketch", nominate=4),
        f"ssa{keep / 2}+{keep / 2}-rescore5": lambda: SSA(keep / 2, keep / 2, page=PAGE, window=64, rescore=5),
        # One head per KV group scores one mean key per page: the next layer's blocks of 64.
        f"forecast{keep}": lambda: Forecast(keep, heads=ForecastHeads(1, HIDDEN, H_KV, D, rank=128)),
        # Communities forced to runs of 10 tokens (`common.runs_partition`); its step's append included.
        f"community-kv{keep}-runs10 (+append)": lambda: CommunityKV(keep, partition=partial(common.runs_partition, size=10), workers=1),
    }


def prefill_communities(policy: CommunityKV, state: KVState, q: torch.Tensor) -> None:
    """``policy``'s communities of ``state``'s layer, from random queries (shaped as ``q``) at every
    visible slot."""
    n = int(state.cache.length)
    policy.prefill(state, torch.randn(q.shape[0], q.shape[1], n, q.shape[2], device=q.device, dtype=q.dtype), None, None)
    policy.finish_prefill([state])


def select_call(policy, state: KVState, q: torch.Tensor) -> Callable:
    """The call that makes ``policy``'s selection of one layer. Forecast's is made from the hidden
    state of the layer below (a random one here) and needs its page means first; CommunityKV's needs
    its communities (a prefill from random queries at every slot) and includes the step's append;
    the others' from ``q``."""
    if isinstance(policy, CommunityKV):
        prefill_communities(policy, state, q)
        n = int(state.cache.length)
        k = state.keys[:, :, n - 1 : n]

        def step():
            policy.append(state, k, None)
            return policy.select(state, q)

        return step
    if not isinstance(policy, Forecast):
        return lambda: policy.select(state, q)
    heads = policy.predictor.to(device=q.device, dtype=q.dtype)
    policy.prefill(state, q[:, :, None], None, None)
    hidden = torch.randn(q.shape[0], heads.down.shape[1], device=q.device, dtype=q.dtype)
    angle = torch.rand(q.shape[0], D, device=q.device)
    rotary = (angle.cos().to(q.dtype), angle.sin().to(q.dtype))
    return lambda: policy.choose(state, 0, hidden, rotary)


def filled_cache(n: int, margin: int = 64) -> PagedKVCache:
    dev = common.DEVICE
    cache = PagedKVCache(1, 1, H_KV, D, n + margin, page_size=PAGE, dtype=torch.bfloat16, device=dev,
                         summaries=SUMMARIES + (SKETCH,))
    cache.reset(torch.zeros(1, dtype=torch.long, device=dev), n)
    g = torch.Generator(device=dev).manual_seed(1)
    cache.keys[0][:, :, :n].normal_(generator=g)
    cache.values[0][:, :, :n].normal_(generator=g)
    cache.summarise(0, slice(0, math.ceil(n / PAGE)))
    return cache


def section_select(contexts, rows, deadline: float, keep: float = 0.1, names: list[str] | None = None):
    """Per layer: selection time, attention time over it, and dense attention, for each policy (of
    ``names``, matched up to the first space of `select_policies`' names; all by default)."""
    policies = {name: make for name, make in select_policies(keep).items() if not names or name.split()[0] in names}
    if names and len(policies) < len(set(names)):
        known = sorted(name.split()[0] for name in select_policies(keep))
        raise ValueError(f"unknown select policies {sorted(set(names) - {n.split()[0] for n in policies})}; known: {known}")
    dev = common.DEVICE
    for n in contexts:
        if time.perf_counter() > deadline:
            raise common.Deadline
        cache = filled_cache(n)
        state = KVState(cache, 0, D**-0.5, workspace=kernels.Workspace(dev))
        q = torch.randn(1, H, D, device=dev, dtype=torch.bfloat16)
        dense = _dense_selection(1, cache.num_pages, dev)
        dense.count = torch.full_like(dense.count, math.ceil(n / PAGE))

        def attend(sel):
            return kernels.decode_attention(q, state.keys, state.values, sel, cache.start, cache.length, state.scale)

        dense_us = common.graph_time_ms(lambda: attend(dense)) * 1e3
        rows.append({"section": "select", "setting": "dense", "context": n, "attention_us": dense_us, "total_us": dense_us})
        for name, make in policies.items():
            row = {"section": "select", "setting": name, "context": n}
            try:
                policy = make()
                call = select_call(policy, state, q)
                call()  # eager first: lazily made state (SSA's generator) exists before tracing
                torch._dynamo.reset()
                inductor_compat.apply()  # as `Decoder.compile` does
                t0 = time.perf_counter()
                try:
                    select = torch.compile(call, dynamic=False)
                    sel = select()
                except Exception as e:  # Triton 3.6 rejects some very wide persistent reductions
                    print(f"select {name}@{n}: compile failed ({type(e).__name__}); retrying without persistent reductions")
                    row["note"] = "compiled without persistent reductions"
                    torch._dynamo.reset()
                    select = torch.compile(call, dynamic=False,
                                           options={"triton.persistent_reductions": False})
                    sel = select()
                compile_s = time.perf_counter() - t0
                kept = float((sel.count.float() * sel.block).mean()) / n
                # On the CPU (a smoke test) the first compiled call, compile included, stands for the timing.
                sel_us = common.graph_time_ms(select) * 1e3 if dev == "cuda" else compile_s * 1e6
                attn_us = common.graph_time_ms(lambda: attend(sel)) * 1e3
                total = sel_us + attn_us
                row.update({"kv_keep": kept, "select_us": sel_us, "attention_us": attn_us, "total_us": total,
                            "attention_speedup": dense_us / attn_us, "speedup": dense_us / total,
                            "bound": 1 / kept, "compile_s": compile_s})
                print(f"select n={n:>7} {name:<24} keep {kept:5.3f} select {sel_us:6.1f} us + attention {attn_us:6.1f} us "
                      f"vs dense {dense_us:6.1f} us: x{dense_us/total:4.2f} (attention alone x{dense_us/attn_us:4.2f}, bound {1/kept:4.1f})",
                      flush=True)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                print(f"select n={n} {name}: FAILED {row['error']}", flush=True)
                traceback.print_exc()
            rows.append(row)


# --------------------------------------------------------------------------------------- profile
def section_profile(model, items, rows, out, deadline: float, steps: int = 5):
    """Per-kernel GPU time of compiled decode steps; ``items`` are ``(setting, context)`` pairs."""
    for name, n in items:
        if time.perf_counter() > deadline:
            raise common.Deadline
        try:
            _profile_one(model, name, n, rows, out, steps)
        except Exception as e:
            rows.append({"section": "profile", "setting": name, "context": n, "error": f"{type(e).__name__}: {e}"[:300]})
            print(f"profile {name}@{n}: FAILED {e}", flush=True)
            traceback.print_exc()


def _profile_one(model, name, n, rows, out, steps):
    from torch.profiler import ProfilerActivity, profile

    dev = common.DEVICE
    layers = len(model.model.layers)
    out.mkdir(parents=True, exist_ok=True)
    activity = ProfilerActivity.CUDA if dev == "cuda" else ProfilerActivity.CPU  # cpu: smoke test
    torch._dynamo.reset()
    dec = common.decoder(model, name)
    # No CUDA graphs: the profiler then sees each kernel.
    dec.compile(cuda_graphs=False)
    session = dec.session
    common.fill_cache(dec, 1, n, n + 64)
    for _ in range(3):
        session.step()
    session.rewind(n)
    common.sync()
    with profile(activities=[activity]) as prof:
        for _ in range(steps):
            session.step()
        common.sync()
    events = [e for e in prof.key_averages() if e.device_type.name == dev.upper() and e.device_time_total > 0]
    total_us = sum(e.device_time_total for e in events) / steps
    launches = sum(e.count for e in events) / steps
    lines = [f"## {name} @ {n} ({layers} layers): {total_us:.0f} us of kernels per step, {launches:.0f} kernels per step", "",
             "| kernel | per step (us) | calls per step | share |", "|---|---|---|---|"]
    for e in sorted(events, key=lambda e: -e.device_time_total)[:40]:
        per = e.device_time_total / steps
        lines.append(f"| `{e.key[:90]}` | {per:.1f} | {e.count / steps:.0f} | {per / total_us:.1%} |")
    (out / f"profile-{common.file_stem(name)}-{n}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:25]), flush=True)
    rows.append({"section": "profile", "setting": name, "context": n, "layers": layers,
                 "kernel_us_per_step": total_us, "kernels_per_step": launches})
    dec = None
    if dev == "cuda":
        torch.cuda.empty_cache()

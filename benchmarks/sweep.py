"""Device sweep: decode speed of policyzoo settings, against the byte account.

Run on a CUDA machine (random bf16 weights: speed does not depend on weight values at fixed budgets):

    python -m benchmarks.sweep --out benchmarks/results/RUN              # the default sections
    python -m benchmarks.sweep --only kernel --contexts 32768,131072     # one section
    python -m benchmarks.sweep --only generate --model smollm2-135m --generate dense@2048
    python -m benchmarks.sweep --deadline 500     # start nothing new after 500 s (results so far are kept)
    python -m benchmarks.sweep --only compile --compile-context 32768   # compile time per policy, cold cache

Sections (each writes its rows into one JSON and one markdown table, plus PNG plots):
  bandwidth  device-to-device copy bandwidth: the byte floor's denominator
  check      the fast `generate` (compiled, CUDA-graph replays) against eager decoding on a toy model
             of the same structure, fp32 and bf16, per --settings item: same tokens, same on replay,
             reproducible sampling, rows stopping at EOS ids at different steps
  generate   `Decoder.generate` end to end as a user calls it (an EOS id set, a streamer attached;
             per-token time from the streamer's timestamps, prefill excluded), the compiled step
             alone beside it, at the --generate setting@context[xB] items (`benchmarks.e2e`)
  kernel     one layer's decode attention (32 q / 8 KV heads, head dim 128, pages of 16): policyzoo's
             split-K kernel in dense mode, with 1/16 of the pages selected, and torch SDPA on the same cache
  step       the whole decode step per setting and context, its eager kernels captured in a CUDA graph
             (`graph`: no Inductor fusion), next to its byte floor and ideal bound, and its speedup over
             dense decoding through the same kernel
  compiled   the same step compiled (Inductor) and replayed as a CUDA graph by the session, at the
             --compiled setting@context pairs (setting@contextxB: batch B); with --dynamic-capacity
             each (setting, batch) compiles once for all its contexts
  batch      dense and KV keep 0.2 at 32K for batch 1/4/16
  hf         Hugging Face `generate` of the same model: eager (dynamic cache) and static cache compiled
  compile    compile time of the first compiled `generate` per --compile-policies item and --compile-modes
             (regional: one compiled layer for every layer; whole: the whole step), each in a fresh
             process with a cold Inductor cache (`benchmarks.compile_time`), split into Dynamo /
             AOTAutograd / Inductor seconds, with the graph size and the compiled step's ms
  variants, tune, gemv, gemvtune, gemvfused, select, profile   the probes of `benchmarks.probes` (kernel launch
             configs, the projection branch's pieces, per-policy selection cost, per-kernel profile)

Step rows start from random keys and values (`synthetic.fill_random`: no prefill; timing does not
depend on the values at fixed budgets); generate rows prefill a random prompt, as users do.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import platform
import statistics
import time
import traceback
from contextlib import ExitStack
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from policyzoo import Offload, timing
from policyzoo.bytes import BUILTIN, ByteAccount
from policyzoo.decoder import dynamic_capacity_refused
from policyzoo.kernels import config
from policyzoo.proj.base import uninstall as uninstall_projections
from policyzoo.selection import Selection

from . import common, compile_time, e2e, probes
from .common import DEVICE, PAGE, Deadline, cuda_time_ms, free_memory, graph_time_ms, settings

CONTEXTS = [2048, 4096, 8192, 16384, 32768, 65536, 131072]


def copy_bandwidth() -> float:
    """Bytes/s of a 4 GiB device-to-device copy (bytes read + written)."""
    n = 1 << 30 if DEVICE == "cuda" else 1 << 24
    src = torch.randn(n // 2, device=DEVICE, dtype=torch.bfloat16).view(torch.uint8)
    src = torch.cat([src, src])
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), steps=5, reps=10)
    return 2 * src.numel() / (ms * 1e-3)


def host_link_bandwidth() -> float:
    """Bytes/s a kernel reads from pinned host memory in place (`policyzoo.offload.host_tensor`): a
    1 GiB sum over a host-backed CUDA tensor, what an offloaded layer's reads run at."""
    from policyzoo.offload import host_tensor

    n = 1 << 29 if DEVICE == "cuda" else 1 << 20
    src = host_tensor((n,), torch.bfloat16, torch.device(DEVICE))
    ms = cuda_time_ms(lambda: src.sum(), steps=2, reps=5)
    return 2 * n / (ms * 1e-3)


# ------------------------------------------------------------------------------------- steps
def time_step(dec, batch: int, n: int, steps: int, reps: int, mode: str, rewind: bool = True,
              backend: str = "inductor") -> tuple[float, float, float | None]:
    """(ms per decode step, seconds spent compiling and capturing, page-cache hit rate of the timed
    steps or None) at context ``n``, as `timing.time_step` times it (CUDA events);
    ``rewind=False``: the timed steps follow each other, as `timing.time_step` says (offload's
    page caches see consecutive steps).

    ``graph``: the eager step's kernels captured in a CUDA graph (torch.compile's ``eager``
    backend: no fusion); ``compiled``: the Inductor-compiled step replayed as a CUDA graph;
    ``compiled-dynamic``: the same, compiled once with a dynamic cache capacity for every context.
    On CPU every mode is a smoke test of the logic; ``backend`` is the compiled modes' (the CPU smoke
    tests use ``aot_eager``: the same graphs, without Inductor's code generation).
    """
    session = dec.session
    if mode == "graph":
        dec.compile(backend="eager", cuda_graphs=DEVICE == "cuda")
    elif mode == "compiled":
        dec.compile(backend=backend)
    t0 = time.perf_counter()
    for _ in range(3):  # compile, warm up, capture
        session.step()
    common.sync()
    setup_s = time.perf_counter() - t0
    session.rewind(n)
    before = session.cache.page_cache_counts()
    if DEVICE == "cpu":
        ms = cuda_time_ms(session.step)
    else:
        ms = timing.time_step(session, calls=steps, reps=reps, warmup=1, rewind=rewind)
    timed = session.cache.page_cache_counts() - before
    return ms, setup_s, timed.hit_rate if timed.lookups else None


# ------------------------------------------------------------------------------------- sections
def section_kernel(contexts, rows, check=True):
    """One layer's decode attention: split-K kernel dense and over 1/16 of the pages (of the sweep's page
    size and of 64 tokens), and torch SDPA."""
    import torch.nn.functional as F

    from policyzoo import kernels
    from policyzoo.kernels import reference

    b, h, h_kv, d = 1, 32, 8, 128
    for n in contexts:
        q = torch.randn(b, h, d, device=DEVICE, dtype=torch.bfloat16)
        keys = torch.randn(b, h_kv, n, d, device=DEVICE, dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        start = torch.zeros(b, dtype=torch.long, device=DEVICE)
        length = torch.tensor(n, device=DEVICE)
        scale = d**-0.5
        kv_bytes = 2 * h_kv * n * d * 2
        timed: list[tuple[str, float, float]] = []
        for page in dict.fromkeys((PAGE, 64)):  # the sweep's pages, and pages of 64 (4x longer reads)
            pages = n // page
            dense = Selection(torch.arange(pages, device=DEVICE, dtype=torch.int32).expand(b, h_kv, -1).contiguous(),
                              torch.full((b, h_kv), pages, device=DEVICE, dtype=torch.int32), block=page)
            k16 = max(1, pages // 16)  # a short test context still selects a page
            perm = torch.stack([torch.randperm(pages, device=DEVICE)[:k16].sort().values for _ in range(h_kv)]).int()[None]
            sparse = Selection(perm.contiguous(), torch.full((b, h_kv), k16, device=DEVICE, dtype=torch.int32), block=page)
            if check:
                for sel in (dense, sparse):
                    out, lse = kernels.decode_attention(q, keys, values, sel, start, length, scale)
                    ref, ref_lse = reference.decode_attention(q.float(), keys.float(), values.float(), sel, start, length, scale)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    assert err < 2e-2 and torch.isfinite(out).all(), f"decode attention mismatch at n={n}, page {page}: {err}"
            tag = "" if page == PAGE else f" (page {page})"
            if page == PAGE:
                timed.append(("split-K dense", graph_time_ms(lambda: kernels.decode_attention(q, keys, values, dense, start, length, scale)), 1.0))
            timed.append((f"split-K 1/16 pages{tag}",
                          graph_time_ms(lambda: kernels.decode_attention(q, keys, values, sparse, start, length, scale)), 1 / 16))
        qs = q[:, :, None, :]
        t_sdpa = graph_time_ms(lambda: F.scaled_dot_product_attention(qs, keys, values, scale=scale, enable_gqa=True))
        timed.append(("torch SDPA", t_sdpa, 1.0))
        t_dense = timed[0][1]
        for name, t, frac in timed:
            rows.append({"section": "kernel", "setting": name, "context": n, "us": t * 1e3,
                         "TB/s": kv_bytes * frac / (t * 1e-3) / 1e12, "vs_dense_kernel": t_dense / t, "vs_sdpa": t_sdpa / t})
            print(f"kernel n={n:>7} {name:<30} {t*1e3:8.1f} us  {kv_bytes*frac/(t*1e-3)/1e12:5.2f} TB/s  x{t_dense/t:5.2f} dense kernel"
                  f"  x{t_sdpa/t:5.2f} SDPA", flush=True)


def section_step(model, contexts, names, rows, bw, acct, save, deadline, batch=1, steps=8, reps=10,
                 section="step", mode="graph", dense_ms=None, offload=0, host_bw=None, offload_cache=0.0, prefetch=True,
                 backend="inductor"):
    """One row per (setting, context): ms, tok/s, byte floor, ideal bound, speedup over dense.
    ``offload``: the last that many layers' keys and values in pinned host memory (`policyzoo.Offload`),
    with page caches of ``offload_cache`` of their pages; the floor then reads their selected KV,
    less the hits measured over the timed steps, at ``host_bw``; ``prefetch``: a policy that predicts
    the next layer's selection fetches its pages ahead (`Offload(prefetch=...)`; the row records whether
    any layer did). Offloaded rows time consecutive steps (no rewind), as generation runs them."""
    dense_ms = {} if dense_ms is None else dense_ms
    for name in names:
        _, _, r_p, r_kv = settings()[name]
        shared = None  # compiled-dynamic: one Decoder, compiled once, for every context of the setting
        for n in contexts:
            if time.perf_counter() > deadline:
                raise Deadline
            row = {"section": section, "mode": mode, "setting": name, "context": n, "batch": batch}
            with common.recorded(row, f"{section}/{mode} b={batch} n={n} {name}"):
                if shared is None:
                    torch._dynamo.reset()
                    dec = common.decoder(model, name, offload=Offload(offload, cache=offload_cache, prefetch=prefetch) if offload else None)
                    if mode == "compiled-dynamic":
                        shared = dec.compile(dynamic_capacity=True, backend=backend)
                else:
                    dec = shared
                common.fill_cache(dec, batch, n, n + steps * (reps + 3) + 64)
                graphs = counters["stats"]["unique_graphs"]
                ms, setup_s, hit = time_step(dec, batch, n, steps, reps, mode, rewind=not offload, backend=backend)
                if mode != "graph":  # graphs Dynamo compiled for this row (0: it reused a compiled step)
                    row["new_graphs"] = counters["stats"]["unique_graphs"] - graphs
                if name == "dense":
                    dense_ms[n] = ms
                union = None if batch == 1 or r_p == 1 else 1.0  # batched TopK: assume the union is all columns
                sel = common.selection_ratio(name)  # summaries and second-stage keys read to choose
                floor = acct.floor_ms(n, bw, r_p, r_kv, batch=batch, union_keep=union, r_select=sel)
                if offload:
                    floor = acct.offload_floor_ms(n, bw, host_bw, offload, r_p, r_kv, batch, union, sel, hit_rate=hit or 0.0)
                    row.update({"host_layers": offload, "host_GB": acct.host_bytes(n, r_kv, offload, batch, hit or 0.0) / 1e9,
                                "host_link_GBps": host_bw / 1e9, "page_cache": offload_cache, "hit_rate": hit,
                                "prefetch": prefetched(dec)})
                bound = acct.bound(n, r_p, r_kv, batch=batch, union_keep=union, r_select=sel)
                speedup = dense_ms.get(n, float("nan")) / ms
                row.update({"ms": ms, "tok/s": batch * 1e3 / ms, "r_select": sel, "floor_ms": floor, "ms/floor": ms / floor,
                            "bound": bound, "speedup": speedup, "speedup/bound": speedup / bound, "setup_s": setup_s})
                row["capacity"] = dec.session.cache.capacity  # the kernels' grids follow it, not the context
                if DEVICE == "cuda":
                    row["gpu_GB"] = torch.cuda.memory_allocated() / 1e9  # weights + this row's cache and graph
                hits = f"  hits {hit:.2f}" if hit is not None else ""
                print(f"{section}/{mode} b={batch} n={n:>7} {name:<22} {ms:7.2f} ms (floor {floor:5.2f}, x{ms/floor:4.2f}) "
                      f"speedup {speedup:5.2f} / bound {bound:5.2f}  setup {setup_s:5.1f}s{hits}", flush=True)
            rows.append(row)
            save()
            dec = None
            free_memory()


def prefetched(dec) -> bool:
    """Whether ``dec``'s offloaded layers have their pages fetched ahead by the layer below."""
    cache = dec.session.cache
    return cache.prefetch and any(dec.session.policy.predicts_layer(layer) for layer in cache.page_caches)


def compiled_items(spec: str, known: set[str], flag: str = "--compiled") -> list[tuple[str, int, int]]:
    """``(setting, context, batch)`` from ``"dense@32768,quest0.2@32768x16"`` (batch 1 unless
    ``xB`` follows the context)."""
    items = []
    for item in spec.split(","):
        name, _, where = item.strip().partition("@")
        context, times, batch = where.partition("x")
        batch = batch if times else "1"
        if name not in known or not context.isdigit() or not batch.isdigit() or int(batch) < 1:
            raise ValueError(f"{flag}: {item!r} is not setting@context or setting@contextxB "
                             f"with a known setting ({', '.join(sorted(known))})")
        items.append((name, int(context), int(batch)))
    return items


def section_hf(model, contexts, rows, bw, acct, save, deadline, new_tokens=64):
    """HF generate on the same model, two ways:

    - ``streamer``: as users run it, an EOS id set and a streamer attached (HF then copies each
      token to the host, a sync per step); per-token time from the streamer's timestamps, the
      first `e2e.SKIP` left out, as for `Decoder.generate` in the generate section;
    - ``processor``: per-step wall time from a logits processor that syncs the device (the figure
      earlier sweeps reported).

    Each runs twice (the first compiles the static cache's step); the second is timed.
    """
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        def __init__(self):
            self.t = []

        def __call__(self, input_ids, scores):
            common.sync()
            self.t.append(time.perf_counter())
            return scores

    uninstall_projections(model)  # the plain HF model: no wrappers a previous setting left on it
    vocab = int(model.config.vocab_size)
    for n in contexts:
        ids = e2e.random_prompt(1, n, vocab, DEVICE)
        for label, kwargs in (("HF eager (dynamic cache)", {}), ("HF static cache compiled", {"cache_implementation": "static"})):
            for how in ("streamer", "processor"):
                if time.perf_counter() > deadline:
                    raise Deadline
                row = {"section": "hf", "mode": how, "setting": label, "context": n, "batch": 1}
                with common.recorded(row, f"hf n={n} {label} {how}"):
                    t0 = time.perf_counter()
                    for _ in range(2):  # the first run compiles
                        if how == "streamer":
                            streamer = e2e.StampStreamer()
                            model.generate(ids, max_new_tokens=new_tokens, do_sample=False, streamer=streamer,
                                           eos_token_id=vocab - 1, pad_token_id=0, **kwargs)
                            stamps = streamer.times[1 + e2e.SKIP :]
                        else:
                            stamp = Stamp()
                            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                           logits_processor=LogitsProcessorList([stamp]), pad_token_id=0, **kwargs)
                            stamps = stamp.t[1:]
                    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
                    # streamer: the mean over the steady deliveries, as `e2e.time_generate` reports ours
                    ms = (sum(gaps) / len(gaps) if how == "streamer" else statistics.median(gaps)) * 1e3
                    floor = acct.floor_ms(n, bw)
                    row.update({"ms": ms, "tok/s": 1e3 / ms, "floor_ms": floor, "ms/floor": ms / floor,
                                "setup_s": time.perf_counter() - t0})
                    print(f"hf n={n:>7} {label:<26} {how:<9} {ms:7.2f} ms (floor {floor:5.2f}, x{ms/floor:4.2f})", flush=True)
                rows.append(row)
                save()
                free_memory()


def section_check(rows, names, dtypes=("float32", "bfloat16")) -> None:
    """The fast `generate` (compiled, CUDA-graph replays, no per-step sync) against eager decoding
    on a toy model of the same structure, per setting and weight dtype (`e2e.check_generate`)."""
    for dtype in dtypes:
        model = common.random_model("llama-3.1-8b", tiny=True).to(getattr(torch, dtype))
        for name in names:
            row = {"section": "check", "setting": name, "dtype": dtype}
            with common.recorded(row, f"check {dtype} {name}"):
                torch._dynamo.reset()
                row.update(e2e.check_generate(lambda: common.decoder(copy.deepcopy(model), name)))
                print(f"check {dtype:<8} {name:<18} " + " ".join(f"{k}={v:.2g}" if isinstance(v, float) else f"{k}={v}"
                                                             for k, v in row.items() if k not in ("section", "setting", "dtype")), flush=True)
            rows.append(row)
        free_memory()


def generate_items(spec: str, known: set[str]) -> list[tuple[str, int, int]]:
    """`compiled_items` for --generate."""
    return compiled_items(spec, known, flag="--generate")


def section_generate(model, items, rows, bw, acct, save, deadline, new_tokens=64, backend="inductor"):
    """`Decoder.generate` per-token time as users see it, beside the compiled step alone, per
    ``(setting, context, batch)``: one compile per (setting, batch), with a dynamic cache capacity
    (two-stage settings: a fixed one, `Decoder.compile` refuses them a dynamic one on CUDA)."""
    decoders: dict[tuple[str, int], object] = {}
    for name, n, b in items:
        if time.perf_counter() > deadline:
            raise Deadline
        _, _, r_p, r_kv = settings()[name]
        row = {"section": "generate", "mode": "compiled", "setting": name, "context": n, "batch": b, "new_tokens": new_tokens}
        with common.recorded(row, f"generate b={b} n={n} {name}"):
            key = (name, b)
            if key not in decoders:
                decoders.clear()  # one Decoder (and cache) at a time
                free_memory()
                dec = common.decoder(model, name)
                decoders[key] = dec.compile(dynamic_capacity=dynamic_capacity_refused(dec, backend) is None, backend=backend)
            dec = decoders[key]
            row["dynamic_capacity"] = dynamic_capacity_refused(dec) is None
            graphs = counters["stats"]["unique_graphs"]
            label = f"generate b={b} n={n:>7} {name}"
            row.update(e2e.measure(dec, b, n, new_tokens,
                                   log=lambda line: print(f"{label}: {time.strftime('%H:%M:%S')} {line}", flush=True)))
            row["new_graphs"] = counters["stats"]["unique_graphs"] - graphs
            union = None if b == 1 or r_p == 1 else 1.0
            row.update(common.community_report(dec))
            sel = row.get("r_select", common.selection_ratio(name))
            floor = acct.floor_ms(n, bw, r_p, r_kv, batch=b, union_keep=union, r_select=sel)
            row.update({"r_select": sel, "floor_ms": floor, "ms/floor": row["generate_ms"] / floor, "tok/s": b * 1e3 / row["generate_ms"]})
            print(f"generate b={b} n={n:>7} {name:<16} generate {row['generate_ms']:7.3f} ms/token (median {row['generate_median_ms']:.3f}), "
                  f"step {row['step_ms']:7.3f} ms, x{row['generate/step']:.3f}; floor {floor:.3f} ms; {row['tokens']} tokens; "
                  f"setup {row['setup_s']:.1f}s" + (f"; clustering per 1K tokens: graph {row['clustering_graph_s_per_1k']:.2f}s "
                  f"leiden {row['clustering_leiden_s_per_1k']:.2f}s split {row['clustering_split_s_per_1k']:.2f}s (cpu), waited {row['clustering_wait_s_per_1k']:.2f}s, "
                  f"{row['communities']} communities, r_select {sel:.3f}" if "communities" in row else ""), flush=True)
        rows.append(row)
        save()
    decoders.clear()
    free_memory()


def section_compile(rows, save, deadline, *, policies, modes, shape, context, layers=None, tiny=False, backend="inductor",
                    new_tokens=8, timeout=900.0):
    """Compile time of the first compiled `generate` per policy and compile mode (``regional``: one
    compiled layer for every layer, ``whole``: the whole step in one graph), each in a fresh process
    with a cold Inductor and Triton cache (`compile_time.run_isolated`): the first call less a second,
    identical one, Dynamo / AOTAutograd / Inductor seconds, graph size, and the compiled step's ms.
    A child that fails or outlives its timeout (at most the time left to the deadline) is a row with
    its ``error``."""
    for name in policies:
        for mode in modes:
            left = deadline - time.perf_counter()
            if left < 30:
                raise Deadline
            row = {"section": "compile", "setting": name, "mode": mode, "context": context}
            with common.recorded(row, f"compile {name} {mode}"):
                got = compile_time.run_isolated(name, shape=shape, context=context, new_tokens=new_tokens, layers=layers, tiny=tiny,
                                                backend=backend, regional=mode == "regional", timeout=min(timeout, left))
                got.pop("policy", None)
                if got.get("regional") != (mode == "regional") and "error" not in got:
                    row["note"] = f"asked for {mode}, compiled {'regional' if got.get('regional') else 'whole'}"
                row.update({k: v for k, v in got.items() if k != "context"})
                parts = " ".join(f"{k} {got[k]:.1f}s" for k in ("dynamo_s", "aot_s", "inductor_s") if isinstance(got.get(k), float))
                print(f"compile {name:<20} {mode:<8} " + (f"{got['compile_s']:7.1f} s ({parts}) {got.get('fx_calls')} FX calls, "
                      f"{got.get('kernels')} kernels, step {got.get('step_ms', float('nan')):.2f} ms" if "error" not in got
                      else f"FAILED {got['error']}"), flush=True)
            rows.append(row)
            save()


# ------------------------------------------------------------------------------------- output
def kernel_knobs() -> dict:
    """The kernels' launch configs in force (`kernels.config`: the defaults, or the overrides the
    variants section keeps for the run), by kernel, as dicts; ``"overridden"`` names the kernels
    not at their defaults."""
    import dataclasses

    knobs = {name: dataclasses.asdict(config.current(kind)) for name, kind in config.known_kernels().items()}
    return {**knobs, "overridden": sorted(config.active())}


def write_outputs(out: Path, meta: dict, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# policyzoo device sweep — {meta['gpu']}, {meta['date']}", "",
             f"torch {meta['torch']}, triton {meta['triton']}, transformers {meta['transformers']}; "
             f"model shape {meta['model']} (random bf16 weights); copy bandwidth {meta['bandwidth_TBps']:.2f} TB/s; "
             "byte floor = step bytes (policyzoo.bytes) / copy bandwidth; bound = ideal speedup from bytes.", ""]
    for section in ("check", "compile", "variants", "kernel", "tune", "gemv", "gemvtune", "gemvfused", "select", "profile", "generate", "step",
                    "compiled", "batch", "hf"):
        sec = [r for r in rows if r["section"] == section]
        if not sec:
            continue
        cols = list(dict.fromkeys(k for r in sec for k in r if k != "section"))
        lines += [f"## {section}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in sec:
            cells = (r.get(c, "") for c in cols)
            lines.append("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in cells) + " |")
        lines.append("")
    (out / "sweep.md").write_text("\n".join(lines))
    step = [r for r in rows if r["section"] == "step" and r["setting"] != "dense" and "speedup" in r]
    if step:
        common.plot_speedups(step, out / "sweep.png",
                             f"{meta['model']} shape, batch 1, {meta['gpu']}: measured (solid) vs byte bound (dashed)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--only", default="kernel,step,batch,compiled,hf", help="sections, run in this order")
    p.add_argument("--deadline", type=float, default=540.0, help="seconds after which no new row starts")
    p.add_argument("--model", default="llama-3.1-8b", choices=sorted(BUILTIN), help="model shape (random weights)")
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    p.add_argument("--offload", type=int, default=0,
                   help="step section: keep the last N layers' keys and values in pinned host memory (policyzoo.Offload)")
    p.add_argument("--offload-cache", type=float, default=0.0,
                   help="with --offload: each offloaded layer's page cache, as a share of its pages (Offload(cache=...))")
    p.add_argument("--no-prefetch", action="store_true",
                   help="with --offload-cache: fetch each offloaded layer's pages at its own lookup, even where the "
                        "policy predicts them a layer ahead (Offload(prefetch=False))")
    p.add_argument("--settings", default="dense,attn-topk0.1,attn-topk0.3,quest0.1,quest0.3,topk0.5,topk0.5+attn-topk0.2,topk0.5+quest0.2")
    p.add_argument("--hf-contexts", default="4096")
    p.add_argument("--generate", default="dense@4096,dense@32768,dense@131072,dense@32768x16",
                   help="setting@context[xB] items of the generate section")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per generate call (generate section)")
    p.add_argument("--compiled", default="dense@32768,topk0.5@32768,quest0.2@32768,topk0.5+quest0.2@32768,"
                   "dense@131072,quest0.1@131072,dense@4096,topk0.5@4096",
                   help="setting@context pairs for the compiled section, setting@contextxB for batch B "
                        "(dense first: speedups divide by its row of the same context and batch)")
    p.add_argument("--backend", default="inductor",
                   help="torch.compile backend of the compiled and generate sections (CPU smoke tests: aot_eager)")
    p.add_argument("--dynamic-capacity", action="store_true",
                   help="compiled section: compile each setting once with a dynamic cache capacity "
                        "(`Decoder.compile(dynamic_capacity=True)`) and time all its contexts with it")
    p.add_argument("--profile", default="dense@32768,topk0.5@4096,dense@4096,topk0.5+quest0.2@32768",
                   help="setting@context pairs for the profile section")
    p.add_argument("--profile-layers", type=int, default=4, help="layers of the profiled model")
    p.add_argument("--variants", default="select_top,merge,page_bound,attention_pages", help="groups of the variants section")
    p.add_argument("--gemv-batches", default="1,4,16", help="batch sizes of the gemvfused section")
    p.add_argument("--gemv-dot-only", action="store_true",
                   help="gemvfused at batch 1: try only the tl.dot row-block tiles, not the scanning loop's grid")
    p.add_argument("--tune-contexts", default="4096,32768,131072", help="contexts of the tune section")
    p.add_argument("--select-contexts", default="32768,65536,131072", help="contexts of the select section")
    p.add_argument("--select-policies", default="", help="select section: these policies only (names up to the first space; default all)")
    p.add_argument("--compile-policies", default=",".join(compile_time.policies()),
                   help="policies of the compile section (benchmarks.compile_time.policies)")
    p.add_argument("--compile-modes", default="regional,whole", help="compile section: regional (one compiled layer for all) and/or whole")
    p.add_argument("--compile-context", type=int, default=32768, help="prompt tokens of the compile section")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compile section")
    p.add_argument("--compile-timeout", type=float, default=900.0, help="seconds per compile-section child (a timeout is a row)")
    p.add_argument("--layers", type=int, default=None, help="fewer layers for a quick check (bounds use the shape's)")
    p.add_argument("--tiny", action="store_true", help="a toy model of the same structure (smoke tests)")
    p.add_argument("--override", action="append", default=[], metavar="KERNEL.FIELD=VALUE",
                   help="a kernel launch setting for the whole run (repeatable; `kernels.config.parse_overrides`), "
                        "e.g. --override select_pages.finish_min_row=0; recorded in the output's knobs")
    args = p.parse_args(argv)
    try:
        overrides = config.parse_overrides(args.override)
    except ValueError as err:
        p.error(f"--override: {err}")
    contexts = [int(c) for c in args.contexts.split(",")]
    import transformers
    import triton

    meta = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke test)", "date": dt.date.today().isoformat(), "torch": torch.__version__,
            "triton": triton.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "model": args.model, "layers": args.layers or BUILTIN[args.model][2], "source": common.source_digest()}
    rows: list[dict] = []
    out = Path(args.out)
    deadline = time.perf_counter() + args.deadline

    def save():
        meta["knobs"] = kernel_knobs()  # as they stand at this save (the variants section may change them)
        write_outputs(out, meta, rows)

    bw = copy_bandwidth()
    meta["bandwidth_TBps"] = bw / 1e12
    print(f"copy bandwidth {bw/1e12:.2f} TB/s", flush=True)
    acct = ByteAccount.from_config(args.model)
    if args.tiny:
        acct = ByteAccount.from_config(common.random_model(args.model, args.layers, tiny=True).config, dtype=torch.float32)
    elif args.layers:
        acct = ByteAccount(**{**acct.__dict__, "layers": args.layers})
    names = args.settings.split(",")

    compiled_dense: dict[int, dict[int, float]] = {}  # dense ms per batch and context, for the compiled rows
    dynamic_dense: dict[int, dict[int, float]] = {}  # the same for --dynamic-capacity
    model = None

    def full_model():
        nonlocal model
        model = model if model is not None else common.random_model(args.model, args.layers, args.tiny)
        return model

    def run_profile():
        small = common.random_model(args.model, args.profile_layers, args.tiny)
        items = [(i.split("@")[0], int(i.split("@")[1])) for i in args.profile.split(",")]
        probes.section_profile(small, items, rows, out, deadline)

    def run_batch():
        for b in (1, 4, 16):
            section_step(full_model(), [32768], ["dense", "quest0.2", "attn-topk0.2"], rows, bw, acct, save, deadline,
                         batch=b, section="batch")

    def run_compiled():
        items = compiled_items(args.compiled, set(settings()))
        if args.dynamic_capacity:  # one compile per (setting, batch), its contexts in the order given
            contexts_of: dict[tuple[str, int], list[int]] = {}
            for name, n, b in items:
                contexts_of.setdefault((name, b), []).append(n)
            for (name, b), ns in contexts_of.items():
                section_step(full_model(), ns, [name], rows, bw, acct, save, deadline, batch=b, section="compiled",
                             mode="compiled-dynamic", dense_ms=dynamic_dense.setdefault(b, {}), backend=args.backend)
            return
        for name, n, b in items:
            section_step(full_model(), [n], [name], rows, bw, acct, save, deadline, batch=b, section="compiled",
                         mode="compiled", dense_ms=compiled_dense.setdefault(b, {}), backend=args.backend)

    run = ExitStack()  # the kernel configs the variants section keeps for the rest of the run
    sections = {
        "check": lambda: section_check(rows, names),
        "generate": lambda: section_generate(full_model(), generate_items(args.generate, set(settings())), rows, bw, acct, save,
                                             deadline, new_tokens=args.new_tokens, backend=args.backend),
        "kernel": lambda: section_kernel(contexts, rows),
        "variants": lambda: probes.section_variants(rows, run, args.variants.split(",")),
        "tune": lambda: probes.section_tune([int(c) for c in args.tune_contexts.split(",")], rows),
        "gemv": lambda: probes.section_gemv(rows),
        "gemvtune": lambda: probes.section_gemv_tune(rows),
        "gemvfused": lambda: probes.section_gemv_fused(rows, deadline, batches=[int(b) for b in args.gemv_batches.split(",")],
                                                       full_grid=not args.gemv_dot_only),
        "select": lambda: probes.section_select([int(c) for c in args.select_contexts.split(",")], rows, deadline,
                                                names=[x for x in args.select_policies.split(",") if x]),
        "profile": run_profile,
        "step": lambda: section_step(full_model(), contexts, names, rows, bw, acct, save, deadline,
                                     offload=args.offload, host_bw=host_link_bandwidth() if args.offload else None,
                                     offload_cache=args.offload_cache, prefetch=not args.no_prefetch),
        "batch": run_batch,
        "compiled": run_compiled,
        "hf": lambda: section_hf(full_model(), [int(c) for c in args.hf_contexts.split(",")], rows, bw, acct, save, deadline),
    }
    sections["compile"] = lambda: section_compile(
        rows, save, deadline, policies=args.compile_policies.split(","), modes=args.compile_modes.split(","), shape=args.model,
        context=args.compile_context, layers=args.layers, tiny=args.tiny, backend=args.compile_backend, timeout=args.compile_timeout)
    unknown = [name for name in args.only.split(",") if name not in sections]
    if unknown:
        p.error(f"--only: unknown sections {unknown}; known: {', '.join(sections)}")
    if "compile" in args.only.split(","):
        bad = [n for n in args.compile_policies.split(",") if n not in compile_time.policies()]
        bad += [m for m in args.compile_modes.split(",") if m not in ("regional", "whole")]
        if bad:
            p.error(f"--compile-policies / --compile-modes: unknown {bad}; policies: {', '.join(compile_time.policies())}; "
                    "modes: regional, whole")
    for section, spec, flag in (("compiled", args.compiled, "--compiled"), ("generate", args.generate, "--generate")):
        if section in args.only.split(","):
            try:  # a typo should stop the run now, not after the sections before it
                compiled_items(spec, set(settings()), flag)
            except ValueError as err:
                p.error(str(err))
    with run:
        run.enter_context(config.override(**overrides))
        try:
            for name in args.only.split(","):  # in the order given: the first ones matter most under a deadline
                try:
                    sections[name]()
                except Deadline:
                    raise
                except Exception as err:  # one broken section must not cost the device call's later ones
                    rows.append({"section": name, "error": f"{type(err).__name__}: {err}"[:300]})
                    print(f"section {name}: FAILED", flush=True)
                    traceback.print_exc()
                save()
        except Deadline:
            print("deadline reached: later rows not run", flush=True)
            meta["stopped_at_deadline"] = True
        finally:
            save()


if __name__ == "__main__":
    main()

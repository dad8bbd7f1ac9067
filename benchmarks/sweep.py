"""Device sweep: decode speed of policyzoo settings on the Llama-3.1-8B shape, against the byte account.

Run on a CUDA machine (random bf16 weights: speed does not depend on weight values at fixed budgets):

    python benchmarks/sweep.py --out benchmarks/results            # everything
    python benchmarks/sweep.py --only kernel --contexts 32768,131072  # one section
    python benchmarks/sweep.py --deadline 500     # start nothing new after 500 s (results so far are kept)

Sections (each writes its rows into one JSON and one markdown table, plus PNG plots):
  bandwidth  device-to-device copy bandwidth: the byte floor's denominator
  kernel     one layer's decode attention (32 q / 8 KV heads, head dim 128, pages of 16): policyzoo's
             split-K kernel in dense mode, with 1/16 of the pages selected, and torch SDPA on the same cache
  step       the whole decode step per setting and context, captured in a CUDA graph (`graph`: the
             eager step, policyzoo's kernels, no torch.compile), next to its byte floor and ideal
             bound, and its speedup over dense decoding through the same kernel
  compiled   the same step under torch.compile (reduce-overhead: fused and CUDA-graphed) at the
             --compiled setting@context pairs (setting@contextxB: batch B); with --dynamic-capacity
             each (setting, batch) compiles once for all its contexts (`Decoder.compile(dynamic_capacity=True)`)
  batch      dense and KV keep 0.2 at 32K for batch 1/4/16 (batch 32 at 32K needs 137 GB of KV
             beside 16 GB of weights: it does not fit one H200)
  hf         Hugging Face decoding of the same model: eager (dynamic cache) and static cache compiled
  tune, gemv, select, profile   the probes of `benchmarks/probes.py` (kernel launch parameters, the
             projection branch's pieces, per-policy selection cost, per-kernel profile of a step)

The cache is filled with random keys and values (no prefill: timing does not depend on the values for
fixed budgets, and a 128K prefill would cost more device time than the sweep itself).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402  (benchmarks/, the script's folder)
from policyzoo import SSA, AttentionTopK, Decoder, EntmaxKV, Quest, TopK, kernels  # noqa: E402
from policyzoo._compat import attn_implementation  # noqa: E402
from policyzoo.attention import ATTN_IMPLEMENTATION  # noqa: E402
from policyzoo.bytes import ByteAccount  # noqa: E402
from policyzoo.proj.base import uninstall as uninstall_projections  # noqa: E402
from policyzoo.selection import Selection  # noqa: E402

MODEL = "llama-3.1-8b"
CONTEXTS = [2048, 4096, 8192, 16384, 32768, 65536, 131072]
PAGE = 16
DEVICE = "cuda"  # --device cpu runs a smoke test of the sweep's logic (eager steps, wall-clock timing)


def settings() -> dict[str, tuple]:
    """name -> (kv policy factory, proj factory, r_p, r_kv)."""
    return {
        "dense": (None, None, 1.0, 1.0),
        "topk0.5": (None, lambda: TopK(0.5), 0.5, 1.0),
        "attn-topk0.1": (lambda: AttentionTopK(0.1, window=64), None, 1.0, 0.1),
        "attn-topk0.3": (lambda: AttentionTopK(0.3, window=64), None, 1.0, 0.3),
        "quest0.1": (lambda: Quest(0.1, page=PAGE, window=64), None, 1.0, 0.1),
        "quest0.3": (lambda: Quest(0.3, page=PAGE, window=64), None, 1.0, 0.3),
        # Pages of 64: a quarter of the pages to bound and rank, at coarser granularity.
        "quest0.1p64": (lambda: Quest(0.1, page=64, window=64), None, 1.0, 0.1),
        "attn-topk0.2": (lambda: AttentionTopK(0.2, window=64), None, 1.0, 0.2),
        "quest0.2": (lambda: Quest(0.2, page=PAGE, window=64), None, 1.0, 0.2),
        "topk0.5+attn-topk0.2": (lambda: AttentionTopK(0.2, window=64), lambda: TopK(0.5), 0.5, 0.2),
        "topk0.5+quest0.2": (lambda: Quest(0.2, page=PAGE, window=64), lambda: TopK(0.5), 0.5, 0.2),
        "ssa0.05+0.05": (lambda: SSA(0.05, 0.05, page=PAGE, window=64), None, 1.0, 0.1),
        "entmax-kv0.1": (lambda: EntmaxKV(0.1, page=PAGE, window=64), None, 1.0, 0.1),
    }


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def free_memory() -> None:
    """Release the last row's Decoder and graphs. It, its runtime and the model's wrappers reference
    each other, so only the cycle collector frees them (the Decoder frees a replaced cache itself;
    before it did, the fourth session's first call ran out of memory on the H200)."""
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------- timing
def cuda_time_ms(fn, steps: int = 10, reps: int = 15, warmup: int = 3) -> float:
    """Median over ``reps`` of the mean time of ``steps`` back-to-back calls, by CUDA events.

    On CPU (a smoke test of the sweep's logic, kernels in the Triton interpreter) one call is timed:
    the figure means nothing there, and the interpreter is slow.
    """
    if DEVICE == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(steps):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / steps)
    return statistics.median(times)


def graph_time_ms(fn, calls: int = 20) -> float:
    """Per-call time of ``fn`` captured ``calls`` times in one CUDA graph (no launch overhead)."""
    if DEVICE == "cpu":
        return cuda_time_ms(fn, steps=calls)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # Triton JIT and allocator warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return cuda_time_ms(graph.replay, steps=1, reps=15, warmup=2) / calls


def copy_bandwidth() -> float:
    """Bytes/s of a 4 GiB device-to-device copy (bytes read + written)."""
    n = 1 << 30 if DEVICE == "cuda" else 1 << 24
    src = torch.randn(n // 2, device=DEVICE, dtype=torch.bfloat16).view(torch.uint8)
    src = torch.cat([src, src])
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), steps=5, reps=10)
    return 2 * src.numel() / (ms * 1e-3)


# ------------------------------------------------------------------------------------- model
def llama8b(layers: int | None = None, tiny: bool = False):
    return common.llama8b(DEVICE, layers, tiny)


def fill_cache(dec: Decoder, batch: int, n: int, margin: int) -> None:
    """Allocate the Decoder's cache for ``n + margin`` tokens and fill ``n`` with random K/V."""
    common.fill_cache(dec, batch, n, n + margin, torch.Generator(device=DEVICE).manual_seed(1))


def time_step(dec: Decoder, batch: int, n: int, steps: int, reps: int, mode: str) -> tuple[float, float]:
    """(ms per decode step, seconds spent compiling or capturing) at context ``n``.

    ``graph``: the eager step captured once in a CUDA graph and replayed (launch overhead gone, no
    fusion); ``compiled``: the Decoder's torch.compile step (reduce-overhead); ``compiled-dynamic``:
    the same, compiled once with a dynamic cache capacity and reused across contexts. Each step appends a
    token, so ``length`` is reset to ``n`` before timing and the cache has room for every step.
    """
    cache = dec.runtime.cache
    token = torch.randint(1, 1000, (batch, 1), device=DEVICE)
    dec.runtime.phase = "decode"
    t0 = time.perf_counter()
    if mode == "graph" and DEVICE == "cpu":  # smoke test: no graphs on CPU

        def run():
            dec._decode_step(token)

    elif mode == "graph":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: Triton JIT, cuBLAS handles
            for _ in range(2):
                dec._decode_step(token)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            dec._decode_step(token)
        run = graph.replay
    else:
        if mode == "compiled":
            dec.compile()
        # "compiled-dynamic": the Decoder was compiled once for every context (`section_step`)
        for _ in range(3):  # compile (or not), record the CUDA graph, replay once
            dec._step(token)

        def run():
            dec._step(token)

    if DEVICE == "cuda":
        torch.cuda.synchronize()
    setup_s = time.perf_counter() - t0
    cache.length.fill_(n)
    ms = cuda_time_ms(run, steps=steps, reps=reps, warmup=2)
    dec.runtime.phase = "idle"
    return ms, setup_s


# ------------------------------------------------------------------------------------- sections
def section_kernel(contexts, rows, check=True):
    """One layer's decode attention: split-K kernel dense and 1/16 pages, and torch SDPA."""
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
        pages = n // PAGE
        dense = Selection(torch.arange(pages, device=DEVICE, dtype=torch.int32).expand(b, h_kv, -1).contiguous(),
                          torch.full((b, h_kv), pages, device=DEVICE, dtype=torch.int32), block=PAGE)
        k16 = pages // 16
        perm = torch.stack([torch.randperm(pages, device=DEVICE)[:k16] for _ in range(h_kv)]).int()[None]
        sparse = Selection(perm.contiguous(), torch.full((b, h_kv), k16, device=DEVICE, dtype=torch.int32), block=PAGE)
        scale = d**-0.5
        if check:
            for sel in (dense, sparse):
                out, lse = kernels.decode_attention(q, keys, values, sel, start, length, scale)
                ref, ref_lse = reference.decode_attention(q.float(), keys.float(), values.float(), sel, start, length, scale)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                assert err < 2e-2 and torch.isfinite(out).all(), f"decode attention mismatch at n={n}: {err}"
        kv_bytes = 2 * h_kv * n * d * 2
        t_dense = graph_time_ms(lambda: kernels.decode_attention(q, keys, values, dense, start, length, scale))
        t_sparse = graph_time_ms(lambda: kernels.decode_attention(q, keys, values, sparse, start, length, scale))
        qs = q[:, :, None, :]
        t_sdpa = graph_time_ms(lambda: F.scaled_dot_product_attention(qs, keys, values, scale=scale, enable_gqa=True))
        for name, t, frac in (("split-K dense", t_dense, 1.0), ("split-K 1/16 pages", t_sparse, 1 / 16), ("torch SDPA", t_sdpa, 1.0)):
            rows.append({"section": "kernel", "setting": name, "context": n, "us": t * 1e3,
                         "TB/s": kv_bytes * frac / (t * 1e-3) / 1e12, "vs_dense_kernel": t_dense / t})
            print(f"kernel n={n:>7} {name:<20} {t*1e3:8.1f} us  {kv_bytes*frac/(t*1e-3)/1e12:5.2f} TB/s  x{t_dense/t:5.2f}", flush=True)


class Deadline(Exception):
    pass


def section_step(model, contexts, names, rows, bw, acct, save, deadline, batch=1, steps=8, reps=10,
                 section="step", mode="graph", dense_ms=None):
    """One row per (setting, context): ms, tok/s, byte floor, ideal bound, speedup over dense."""
    dense_ms = {} if dense_ms is None else dense_ms
    for name in names:
        kv_f, proj_f, r_p, r_kv = settings()[name]
        shared = None  # compiled-dynamic: one Decoder, compiled once, for every context of the setting
        for n in contexts:
            if time.perf_counter() > deadline:
                raise Deadline
            row = {"section": section, "mode": mode, "setting": name, "context": n, "batch": batch}
            try:
                if shared is None:
                    torch._dynamo.reset()
                    dec = Decoder(model, kv=kv_f() if kv_f else None, proj=proj_f() if proj_f else None)
                    if mode == "compiled-dynamic":
                        shared = dec.compile(dynamic_capacity=True)
                else:
                    dec = shared
                with attn_implementation(model, ATTN_IMPLEMENTATION):
                    fill_cache(dec, batch, n, margin=steps * (reps + 3) + 64)
                    graphs = counters["stats"]["unique_graphs"]
                    ms, setup_s = time_step(dec, batch, n, steps, reps, mode)
                if mode != "graph":  # graphs Dynamo compiled for this row (0: it reused a compiled step)
                    row["new_graphs"] = counters["stats"]["unique_graphs"] - graphs
                if name == "dense":
                    dense_ms[n] = ms
                union = None if batch == 1 or r_p == 1 else 1.0  # batched TopK: assume the union is all columns
                floor = acct.floor_ms(n, bw, r_p, r_kv, batch=batch, union_keep=union)
                bound = acct.bound(n, r_p, r_kv, batch=batch, union_keep=union)
                speedup = dense_ms.get(n, float("nan")) / ms
                row.update({"ms": ms, "tok/s": batch * 1e3 / ms, "floor_ms": floor, "ms/floor": ms / floor,
                            "bound": bound, "speedup": speedup, "speedup/bound": speedup / bound, "setup_s": setup_s})
                row["capacity"] = dec.runtime.cache.capacity  # the kernels' grids follow it, not the context
                if DEVICE == "cuda":
                    row["gpu_GB"] = torch.cuda.memory_allocated() / 1e9  # weights + this row's cache and graph
                print(f"{section}/{mode} b={batch} n={n:>7} {name:<22} {ms:7.2f} ms (floor {floor:5.2f}, x{ms/floor:4.2f}) "
                      f"speedup {speedup:5.2f} / bound {bound:5.2f}  setup {setup_s:5.1f}s", flush=True)
            except Exception as err:  # keep the sweep going; the row says what failed
                row["error"] = f"{type(err).__name__}: {err}"[:300]
                print(f"{section}/{mode} b={batch} n={n} {name}: FAILED {row['error']}", flush=True)
                traceback.print_exc()
            rows.append(row)
            save()
            dec = None
            free_memory()


def compiled_items(spec: str, known: set[str]) -> list[tuple[str, int, int]]:
    """``(setting, context, batch)`` from ``"dense@32768,quest0.2@32768x16"`` (batch 1 unless
    ``xB`` follows the context)."""
    items = []
    for item in spec.split(","):
        name, _, where = item.strip().partition("@")
        context, times, batch = where.partition("x")
        batch = batch if times else "1"
        if name not in known or not context.isdigit() or not batch.isdigit() or int(batch) < 1:
            raise ValueError(f"--compiled: {item!r} is not setting@context or setting@contextxB "
                             f"with a known setting ({', '.join(sorted(known))})")
        items.append((name, int(context), int(batch)))
    return items


def section_hf(model, contexts, rows, bw, acct, save, deadline, new_tokens=24):
    """HF generate: per-step wall time from a logits processor's timestamps (HF syncs every step)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        def __init__(self):
            self.t = []

        def __call__(self, input_ids, scores):
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            self.t.append(time.perf_counter())
            return scores

    uninstall_projections(model)  # the plain HF model: no wrappers a previous setting left on it
    for n in contexts:
        ids = torch.randint(1, 1000, (1, n), device=DEVICE)
        for label, kwargs in (("HF eager (dynamic cache)", {}), ("HF static cache compiled", {"cache_implementation": "static"})):
            if time.perf_counter() > deadline:
                raise Deadline
            row = {"section": "hf", "mode": "hf", "setting": label, "context": n, "batch": 1}
            try:
                t0 = time.perf_counter()
                for _ in range(2):  # the first run compiles
                    stamp = Stamp()
                    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                   logits_processor=LogitsProcessorList([stamp]), pad_token_id=0, **kwargs)
                per_step = [b - a for a, b in zip(stamp.t[1:], stamp.t[2:])]
                ms = statistics.median(per_step) * 1e3
                floor = acct.floor_ms(n, bw)
                row.update({"ms": ms, "tok/s": 1e3 / ms, "floor_ms": floor, "ms/floor": ms / floor,
                            "setup_s": time.perf_counter() - t0})
                print(f"hf n={n:>7} {label:<26} {ms:7.2f} ms (floor {floor:5.2f}, x{ms/floor:4.2f})", flush=True)
            except Exception as err:
                row["error"] = f"{type(err).__name__}: {err}"[:300]
                print(f"hf n={n} {label}: FAILED {row['error']}", flush=True)
                traceback.print_exc()
            rows.append(row)
            save()
            free_memory()


# ------------------------------------------------------------------------------------- output
def kernel_knobs() -> dict:
    """The kernel modules' launch choices that the variants section can change (none on CPU without
    the interpreter: no kernel modules)."""
    from policyzoo.kernels import dispatch

    picks = {"_attn": ("FUSE_MERGE", "FUSED_BLOCK_C", "BLOCK_C", "MERGE_WARPS"),
             "_select": ("METHOD", "HIST_MIN_N", "HIST_CHUNK", "NUM_WARPS", "BF16_BITS"),
             "_gemv": ("FUSE_EPILOGUE", "MIN_FUSED_SPLIT"), "_page": ("METHOD", "BLOCK_P", "NUM_WARPS")}
    return {f"{mod[1:]}.{a}": getattr(getattr(dispatch, mod), a)
            for mod, names in picks.items() if getattr(dispatch, mod, None) is not None for a in names}


def write_outputs(out: Path, meta: dict, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# policyzoo device sweep — {meta['gpu']}, {meta['date']}", "",
             f"torch {meta['torch']}, triton {meta['triton']}, transformers {meta['transformers']}; "
             f"model shape {MODEL} (random bf16 weights); copy bandwidth {meta['bandwidth_TBps']:.2f} TB/s; "
             "byte floor = step bytes (policyzoo.bytes) / copy bandwidth; bound = ideal speedup from bytes.", ""]
    for section in ("variants", "kernel", "tune", "gemv", "gemvtune", "select", "profile", "step", "compiled", "batch", "hf"):
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
                             f"{MODEL} shape, batch 1, {meta['gpu']}: measured (solid) vs byte bound (dashed)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--only", default="kernel,step,batch,compiled,hf", help="sections, run in this order")
    p.add_argument("--deadline", type=float, default=540.0, help="seconds after which no new row starts")
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    p.add_argument("--settings", default="dense,attn-topk0.1,attn-topk0.3,quest0.1,quest0.3,topk0.5,topk0.5+attn-topk0.2,topk0.5+quest0.2")
    p.add_argument("--hf-contexts", default="32768")
    p.add_argument("--compiled", default="dense@32768,topk0.5@32768,quest0.2@32768,topk0.5+quest0.2@32768,"
                   "dense@131072,quest0.1@131072,dense@4096,topk0.5@4096",
                   help="setting@context pairs for the compiled section, setting@contextxB for batch B "
                        "(dense first: speedups divide by its row of the same context and batch)")
    p.add_argument("--dynamic-capacity", action="store_true",
                   help="compiled section: compile each setting once with a dynamic cache capacity "
                        "(`Decoder.compile(dynamic_capacity=True)`) and time all its contexts with it")
    p.add_argument("--profile", default="dense@32768,topk0.5@4096,dense@4096,topk0.5+quest0.2@32768",
                   help="setting@context pairs for the profile section")
    p.add_argument("--profile-layers", type=int, default=4, help="layers of the profiled model")
    p.add_argument("--variants", default="select_top,merge,page_bound,attention_pages", help="groups of the variants section")
    p.add_argument("--select-contexts", default="32768,65536,131072", help="contexts of the select section")
    p.add_argument("--layers", type=int, default=None, help="fewer layers for a quick check (bounds use 32)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test of the logic")
    p.add_argument("--tiny", action="store_true", help="a toy model of the same structure (smoke tests)")
    args = p.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    contexts = [int(c) for c in args.contexts.split(",")]
    import transformers
    import triton

    meta = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke test)", "date": dt.date.today().isoformat(), "torch": torch.__version__,
            "triton": triton.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "model": MODEL, "layers": args.layers or 32, "source": common.source_digest()}
    rows: list[dict] = []
    out = Path(args.out)
    deadline = time.perf_counter() + args.deadline

    def save():
        meta["knobs"] = kernel_knobs()  # as they stand at this save (the variants section may change them)
        write_outputs(out, meta, rows)

    if DEVICE == "cuda":  # the kernels' counters and histograms, as a Decoder on CUDA reserves them
        kernels.scratch.reserve(DEVICE)
    bw = copy_bandwidth()
    meta["bandwidth_TBps"] = bw / 1e12
    print(f"copy bandwidth {bw/1e12:.2f} TB/s", flush=True)
    acct = ByteAccount.from_config(MODEL)
    if args.tiny:
        acct = ByteAccount.from_config(llama8b(args.layers or 2, tiny=True).config, dtype=torch.float32)
    elif args.layers:
        acct = ByteAccount(**{**acct.__dict__, "layers": args.layers})
    names = args.settings.split(",")
    sys.modules.setdefault("sweep", sys.modules[__name__])  # the probes read this module's DEVICE
    import probes

    compiled_dense: dict[int, dict[int, float]] = {}  # dense ms per batch and context, for the compiled rows
    dynamic_dense: dict[int, dict[int, float]] = {}  # the same for --dynamic-capacity
    model = None

    def full_model():
        nonlocal model
        model = model if model is not None else llama8b(args.layers, args.tiny)
        return model

    def run_profile():
        small = llama8b(args.profile_layers, args.tiny)
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
                             mode="compiled-dynamic", dense_ms=dynamic_dense.setdefault(b, {}))
            return
        for name, n, b in items:
            section_step(full_model(), [n], [name], rows, bw, acct, save, deadline, batch=b, section="compiled",
                         mode="compiled", dense_ms=compiled_dense.setdefault(b, {}))

    sections = {
        "kernel": lambda: section_kernel(contexts, rows),
        "variants": lambda: probes.section_variants(rows, args.variants.split(",")),
        "tune": lambda: probes.section_tune([c for c in contexts if c >= 32768] or contexts[-1:], rows),
        "gemv": lambda: probes.section_gemv(rows),
        "gemvtune": lambda: probes.section_gemv_tune(rows),
        "select": lambda: probes.section_select([int(c) for c in args.select_contexts.split(",")], rows, deadline),
        "profile": run_profile,
        "step": lambda: section_step(full_model(), contexts, names, rows, bw, acct, save, deadline),
        "batch": run_batch,
        "compiled": run_compiled,
        "hf": lambda: section_hf(full_model(), [int(c) for c in args.hf_contexts.split(",")], rows, bw, acct, save, deadline),
    }
    unknown = [name for name in args.only.split(",") if name not in sections]
    if unknown:
        p.error(f"--only: unknown sections {unknown}; known: {', '.join(sections)}")
    if "compiled" in args.only.split(","):
        try:  # a typo in --compiled should stop the run now, not after the sections before it
            compiled_items(args.compiled, set(settings()))
        except ValueError as err:
            p.error(str(err))
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

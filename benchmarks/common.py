"""What the device benchmarks share: the device, random-weight models of a named shape, the setting
registry, a session started from random keys and values, and the timers (`policyzoo.timing.time_ms`
for steps, `graph_time_ms` for single kernels)."""

from __future__ import annotations

import functools
import gc
import hashlib
import itertools
import re
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import torch

import inspect

from policyzoo import SSA, AttentionTopK, CommunityKV, Decoder, EntmaxKV, Forecast, Offload, PrHS, Quest, Threshold, TopK, Window
from policyzoo.bytes import BUILTIN
from policyzoo.kernels import DenseGemvConfig
from policyzoo.kernels.config import override
from policyzoo.synthetic import fill_random
from policyzoo.timing import time_ms

ROOT = Path(__file__).resolve().parents[1]
# CUDA where there is one; elsewhere the sections run as CPU smoke tests of their logic (kernels in
# the Triton interpreter, wall-clock timings that mean nothing).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
T = TypeVar("T")
PAGE = 16
TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1024)


class Deadline(Exception):
    """A section reached the run's deadline: later rows are not started."""


@contextmanager
def recorded(row: dict, label: str) -> Iterator[dict]:
    """Measure one row: an exception (other than `Deadline`) becomes the row's ``error`` and is
    printed, and the sweep goes on to the next row (a device call's later rows are worth more than
    one broken row)."""
    try:
        yield row
    except Deadline:
        raise
    except Exception as err:
        row["error"] = f"{type(err).__name__}: {err}"[:300]
        print(f"{label}: FAILED {row['error']}", flush=True)
        traceback.print_exc()


def _groups(size: int, layers: int) -> tuple[int, ...]:
    """PrHS layer groups of ``size`` adjacent layers (a forced schedule: random weights calibrate nothing)."""
    return tuple(i // size for i in range(layers))


def gpu_state() -> dict:
    """The GPU's SM and memory clocks (MHz), temperature (C), power draw (W) and active clock-event
    reasons (a bit mask: power cap, thermal, ...) as ``nvidia-smi`` reads them now, under
    ``gpu_state`` as one string too; empty off CUDA or where ``nvidia-smi`` fails."""
    import subprocess

    if DEVICE != "cuda":
        return {}
    fields = ("clocks.sm", "clocks.mem", "temperature.gpu", "power.draw", "clocks_event_reasons.active")
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", "-i",
                              str(torch.cuda.current_device())], capture_output=True, text=True, timeout=10).stdout
        sm, mem, temp, power, reasons = (v.strip() for v in out.strip().splitlines()[0].split(","))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {}
    return {"sm_mhz": sm, "mem_mhz": mem, "temp_c": temp, "power_w": power, "clock_reasons": reasons,
            "gpu_state": f"sm {sm} MHz, mem {mem} MHz, {temp} C, {power} W, reasons {reasons}"}


def settings() -> dict[str, tuple]:
    """Benchmark setting name -> (KV policy factory, projection factory, r_p, r_kv). A KV factory
    may take the model's ``layers`` (PrHS's layer groups)."""
    quest = lambda keep: Quest(keep, page=PAGE, window=64)  # noqa: E731
    return {
        "dense": (None, None, 1.0, 1.0),
        "topk0.5": (None, lambda: TopK(0.5), 0.5, 1.0),
        "attn-topk0.1": (lambda: AttentionTopK(0.1, window=64), None, 1.0, 0.1),
        "attn-topk0.3": (lambda: AttentionTopK(0.3, window=64), None, 1.0, 0.3),
        "quest0.1": (lambda: Quest(0.1, page=PAGE, window=64), None, 1.0, 0.1),
        "quest0.3": (lambda: Quest(0.3, page=PAGE, window=64), None, 1.0, 0.3),
        # The first 4 and the last 512 tokens: its share of the context is `kv_ratio`'s, per context.
        "window4+512": (lambda: Window(4, 512), None, 1.0, 1.0),
        # Pages of 64: a quarter of the pages to bound and rank, at coarser granularity.
        "quest0.1p64": (lambda: Quest(0.1, page=64, window=64), None, 1.0, 0.1),
        # Pages ranked by the 4-bit key sketch's bound (about a nat over a page's best key, not 13).
        "quest0.1-sketch": (lambda: Quest(0.1, page=PAGE, window=64, bound="sketch"), None, 1.0, 0.1),
        "quest0.2-sketch": (lambda: Quest(0.2, page=PAGE, window=64, bound="sketch"), None, 1.0, 0.2),
        # Two levels: the box nominates 2 or 4 times the pages, the sketch ranks only those.
        "quest0.1-nominate2": (lambda: Quest(0.1, page=PAGE, window=64, bound="sketch", nominate=2), None, 1.0, 0.1),
        "quest0.1-nominate4": (lambda: Quest(0.1, page=PAGE, window=64, bound="sketch", nominate=4), None, 1.0, 0.1),
        "attn-topk0.2": (lambda: AttentionTopK(0.2, window=64), None, 1.0, 0.2),
        "quest0.2": (lambda: Quest(0.2, page=PAGE, window=64), None, 1.0, 0.2),
        # Two stages: 3 or 5 times the pages as candidates, their keys scored exactly.
        "quest0.1-rescore3": (lambda: Quest(0.1, page=PAGE, window=64, rescore=3), None, 1.0, 0.1),
        "quest0.1-rescore5": (lambda: Quest(0.1, page=PAGE, window=64, rescore=5), None, 1.0, 0.1),
        "ssa0.05+0.05-rescore5": (lambda: SSA(0.05, 0.05, page=PAGE, window=64, rescore=5), None, 1.0, 0.1),
        "quest0.1p64-rescore3": (lambda: Quest(0.1, page=64, window=64, rescore=3), None, 1.0, 0.1),
        "quest0.1p64-rescore5": (lambda: Quest(0.1, page=64, window=64, rescore=5), None, 1.0, 0.1),
        # PrHS around Quest: along time (the cosine threshold SmolLM2's calibration chose; every fresh
        # selection is still made, static shapes), certified (eps), and layers shared in groups of 2 or 4
        # (uncertified: a follower layer skips its selection).
        "prhs-quest0.1-time": (lambda: PrHS(quest(0.1), time=0.9), None, 1.0, 0.1),
        "prhs-quest0.1-time-eps": (lambda: PrHS(quest(0.1), time=0.9, eps=0.05), None, 1.0, 0.1),
        "prhs-quest0.1-layers2": (lambda layers=32: PrHS(quest(0.1), layer=_groups(2, layers)), None, 1.0, 0.1),
        "prhs-quest0.1-layers4": (lambda layers=32: PrHS(quest(0.1), layer=_groups(4, layers)), None, 1.0, 0.1),
        "prhs-quest0.2-layers2": (lambda layers=32: PrHS(quest(0.2), layer=_groups(2, layers)), None, 1.0, 0.2),
        "prhs-quest0.2-layers4": (lambda layers=32: PrHS(quest(0.2), layer=_groups(4, layers)), None, 1.0, 0.2),
        # Forecast (SparDA): blocks of 64 chosen one layer ahead by a learned head (heads started from
        # the model's query projections: random weights train nothing), the first and last 64 tokens kept.
        "forecast0.1": (lambda: Forecast(0.1), None, 1.0, 0.1),
        "forecast0.2": (lambda: Forecast(0.2), None, 1.0, 0.2),
        # The forecast nominating three times the blocks, the layer's own query keeping the best of them.
        "forecast0.1-rescore3": (lambda: Forecast(0.1, rescore=3), None, 1.0, 0.1),
        # CommunityKV: Leiden communities of the prefill's attention graph (of a random prompt on
        # random weights: the speed of its decode, and what the prefill's clustering costs).
        "community-kv0.1": (lambda: CommunityKV(0.1), None, 1.0, 0.1),
        # Its decode with the partition forced to runs of 10 tokens (SmolLM2's communities average
        # 9-10 tokens): a random model's attention graph has no communities and every edge distinct
        # (5x a real graph's), so Leiden on it costs minutes per graph at 128K. The prefill still finds
        # each query's best key on the GPU and builds the graph; with the partition forced, the graph's
        # shape (`top`, `mix`) changes nothing the decode reads, so it is the cheapest one.
        "community-kv0.1-runs10": (lambda: CommunityKV(0.1, top=1, mix=0.0, partition=functools.partial(runs_partition, size=10)),
                                   None, 1.0, 0.1),
        # The same with Leiden's communities scored whole (`split=0`), as before `split`: runs of 10
        # split into parts of 2-3 tokens (the default `split=4`) are about 4x as many units to score.
        "community-kv0.1-runs10-whole": (lambda: CommunityKV(0.1, top=1, mix=0.0, split=0,
                                                             partition=functools.partial(runs_partition, size=10)), None, 1.0, 0.1),
        "topk0.5+attn-topk0.2": (lambda: AttentionTopK(0.2, window=64), lambda: TopK(0.5), 0.5, 0.2),
        "topk0.5+quest0.2": (lambda: Quest(0.2, page=PAGE, window=64), lambda: TopK(0.5), 0.5, 0.2),
        "ssa0.05+0.05": (lambda: SSA(0.05, 0.05, page=PAGE, window=64), None, 1.0, 0.1),
        "entmax-kv0.1": (lambda: EntmaxKV(0.1, page=PAGE, window=64), None, 1.0, 0.1),
        # The threshold's last Newton steps in float64 (the default before 2026-12-07).
        "entmax-kv0.1-f64": (lambda: EntmaxKV(0.1, page=PAGE, window=64, float64_steps=3), None, 1.0, 0.1),
        # Calibrated by `decoder` on the model it wraps (random text: about half the inputs kept).
        "threshold0.5": (None, lambda: Threshold(0.5), 0.5, 1.0),
        "topk-fast0.5": (None, lambda: TopK(0.5, mode="fast"), 0.5, 1.0),
        "threshold0.5+quest0.2": (lambda: Quest(0.2, page=PAGE, window=64), lambda: Threshold(0.5), 0.5, 0.2),
        "topk-fast0.5+quest0.2": (lambda: Quest(0.2, page=PAGE, window=64), lambda: TopK(0.5, mode="fast"), 0.5, 0.2),
        # The same settings with their dense decode projections through the dense GEMV kernel
        # (`DENSE_GEMV`) instead of cuBLAS.
        "dense-gemv": (None, None, 1.0, 1.0),
        "threshold0.5-gemv": (None, lambda: Threshold(0.5), 0.5, 1.0),
        "quest0.1-gemv": (lambda: Quest(0.1, page=PAGE, window=64), None, 1.0, 0.1),
    }


# What a setting named ``...-gemv`` builds its Decoder under (`kernels.config.override`).
DENSE_GEMV = {"dense_gemv": DenseGemvConfig(decode_rows=4)}


def kernel_overrides(name: str) -> dict:
    """The launch configs setting ``name``'s Decoder is built under (`kernels.config.override`)."""
    return DENSE_GEMV if name.endswith("-gemv") else {}


def runs_partition(n: int, lo, hi, weight, gamma: float, seed: int, size: int) -> torch.Tensor:
    """A `CommunityKV` partition function for timing: runs of ``size`` consecutive tokens, whatever
    the graph (module level: the policy's worker processes import it)."""
    return torch.arange(n) // size


def kv_ratio(name: str, context: int) -> float:
    """``r_kv`` of setting ``name`` at ``context`` tokens: the table's, but for a `Window` policy,
    whose share of the context falls as the context grows."""
    kv_f, _, _, r_kv = settings()[name]
    policy = kv_f() if kv_f else None
    if isinstance(policy, Window):
        return min(1.0, (policy.sinks + policy.window) / context)
    return r_kv


def selection_ratio(name: str) -> float:
    """``r_select`` of setting ``name`` for the byte account (`policyzoo.bytes.selection_overhead`):
    page summaries and a second stage's keys for page policies, every key for exact scorers."""
    kv_f, _, _, r_kv = settings()[name]
    policy = kv_f() if kv_f else None
    if isinstance(policy, PrHS):
        # Uncertified layer sharing: only a group's first layer chooses. A certified reuse reads the
        # reused selection's keys besides the fresh choice (half the KV bytes of r_kv of the tokens).
        leaders = len(set(policy.layer)) / len(policy.layer) if policy.layer and policy.eps is None else 1.0
        certify = 0.5 * r_kv if policy.eps is not None else 0.0
        return leaders * _selection_ratio_of(policy.policy, r_kv) + certify
    return _selection_ratio_of(policy, r_kv)


def _selection_ratio_of(policy, r_kv: float) -> float:
    from policyzoo.bytes import selection_overhead
    from policyzoo.kv import Certified

    while isinstance(policy, Certified):
        policy = policy.policy
    if isinstance(policy, Forecast):  # one mean key per page, in the cache's dtype: half of min and max
        return selection_overhead(policy.stride, summary_bytes=0.5)
    if policy is None or not policy.summaries:
        exact = isinstance(policy, AttentionTopK) or (isinstance(policy, SSA) and policy.proxy == "exact")
        return selection_overhead(None, rescore=1 / r_kv, r_kv=r_kv) if exact else 0.0
    # mean and std (EntmaxKV's Gaussian) weigh as much as min and max
    wide = 1.0 + (1.0 if "page_mean" in policy.summaries else 0.0)
    sketch = "key_sketch" in policy.summaries
    return selection_overhead(policy.page_size, getattr(policy, "rescore", 0.0), r_kv, summary_bytes=wide, sketch=sketch,
                              nominate=getattr(policy, "nominate", 0.0))


def community_report(dec: Decoder) -> dict:
    """For a Decoder whose policy is `CommunityKV`, after its requests: the prefills' clustering time
    per 1,000 prompt tokens (graph and Leiden seconds summed over the worker processes, and the
    wall time the session waited for them after the forward), and ``r_select`` as read: every
    unit's padded table of centroids in the cache's dtype (half a token's key and value bytes per
    community), which decode scores, against the cache's keys and values; ``communities`` counts the
    parts decode scores (the communities after `CommunityKV.split`). Empty for other policies."""
    policy = dec.session.policy
    if not isinstance(policy, CommunityKV):
        return {}
    c = policy.clustering
    per = 1000 / max(c.tokens, 1)
    layer, cache = dec.session.backends[0].state.layer_state_of(policy), dec.session.cache
    _, units, slots, _ = layer.centroid_key.shape
    n = int(cache.length - cache.start.max())
    per_centroid = layer.centroid_key.element_size() / (2 * cache.keys[0].element_size())  # of a token's key and value
    return {"clustering_graph_s_per_1k": c.graph_seconds * per, "clustering_leiden_s_per_1k": c.leiden_seconds * per,
            "clustering_split_s_per_1k": c.split_seconds * per,
            "clustering_wait_s_per_1k": c.wait_seconds * per, "communities": int((layer.size > 0).sum(-1).float().mean()),
            "r_select": units * slots * per_centroid / (cache.num_kv_heads * n)}


def decoder(model, name: str, offload: Offload | None = None) -> Decoder:
    """A Decoder of setting ``name`` (`settings`) on ``model`` (``offload``: `Decoder`'s)."""
    kv_f, proj_f, _, _ = settings()[name]
    proj = proj_f() if proj_f else None
    layers = model.config.num_hidden_layers
    kv = None if kv_f is None else kv_f(layers=layers) if "layers" in inspect.signature(kv_f).parameters else kv_f()
    with override(**kernel_overrides(name)):
        return Decoder(model, kv=kv, proj=calibrated(proj, model), offload=offload)


def calibrated(proj, model):
    """``proj``, calibrated on 512 random tokens first where it needs calibrated values and has none
    (`Threshold`, `TopK(mode="fast")`): speed does not depend on which inputs set the thresholds."""
    if (isinstance(proj, Threshold) and not proj.thresholds) or (isinstance(proj, TopK) and proj.mode == "fast" and not proj.ratios):
        vocab = model.get_output_embeddings().weight.shape[0]
        text = torch.randint(vocab, (1, 512), generator=torch.Generator().manual_seed(0))
        proj.calibrate(model, [text])
    return proj


def source_digest(root: Path = ROOT) -> str:
    """A short hash of the code a benchmark ran (every ``.py`` under ``policyzoo/`` and
    ``benchmarks/``, by path and content). The device machine's copy of ``.git`` can be stale, so
    the sweep records this (``meta.source``): a checkout of the commit that ran gives the same digest."""
    h = hashlib.sha256()
    for path in sorted(p for folder in ("policyzoo", "benchmarks") for p in (root / folder).rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def random_config(shape: str = "llama-3.1-8b", layers: int | None = None, tiny: bool = False):
    """The Llama config of a `policyzoo.bytes.BUILTIN` shape, or of a toy of the same structure
    (``tiny``, for CPU smoke tests); ``layers`` defaults to the shape's (2 when tiny)."""
    from transformers import LlamaConfig

    d, ff, n_layers, h, h_kv, hd, vocab, tied = BUILTIN[shape]
    dims = dict(hidden_size=d, intermediate_size=ff, num_attention_heads=h, num_key_value_heads=h_kv, head_dim=hd, vocab_size=vocab)
    if tiny:
        dims, tied = TINY, False
    return LlamaConfig(**dims, num_hidden_layers=layers or (2 if tiny else n_layers), max_position_embeddings=262144,
                       rope_theta=500000.0, tie_word_embeddings=tied, pad_token_id=0, eos_token_id=None,
                       bos_token_id=None)  # fmt: skip


def random_model(shape: str = "llama-3.1-8b", layers: int | None = None, tiny: bool = False, device: str = DEVICE):
    """A Llama-architecture model of `random_config` with random weights (bf16 on CUDA; speed does
    not depend on the weight values)."""
    from transformers import LlamaForCausalLM

    cfg = random_config(shape, layers, tiny)
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if device == "cuda" else torch.float32)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.generation_config.eos_token_id = None
    return model.eval()


def llama8b(device: str = DEVICE, layers: int | None = None, tiny: bool = False):
    """The Llama-3.1-8B shape with random weights (`random_model`)."""
    return random_model("llama-3.1-8b", layers, tiny, device)


def fill_cache(dec: Decoder, batch: int, n: int, capacity: int, generator: torch.Generator | None = None) -> None:
    """Start ``dec``'s session from ``n`` random keys and values per row in a cache of exactly
    ``capacity`` tokens (`synthetic.fill_random`). Exactly: the kernels' grids follow the
    capacity (empty pages still cost programs), so a short context timed on a cache left by a longer
    one would read slow."""
    fill_random(dec.session, n, batch=batch, capacity=capacity, generator=generator)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def free_memory() -> None:
    """Release the last row's Decoder, cache and graphs (they reference each other: only the cycle
    collector frees them)."""
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def cuda_time_ms(fn: Callable[[], object], steps: int = 10, reps: int = 15, warmup: int = 3) -> float:
    """`policyzoo.timing.time_ms` on the benchmark device; on CPU (a smoke test, kernels in the
    Triton interpreter) one call is timed: the figure means nothing there."""
    if DEVICE == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return time_ms(fn, calls=steps, reps=reps, warmup=warmup, device=DEVICE)


# A GPU's L2 cache (50 MB on an H100 and an H200). A probe that times one copy of inputs smaller
# than it times warm reads; a decode step reads each layer's from memory.
L2_BYTES = 50 << 20
# Bytes that a probe's rotated inputs span at least (`rotated_copies`): five L2 caches.
ROTATED_BYTES = 256 * 2**20


def rotated_copies(nbytes: int, calls: int = 20) -> int:
    """How many copies of inputs of ``nbytes`` bytes a probe cycles through (`ROTATED_BYTES`, at most
    one per call of a `graph_time_ms` graph; one on the CPU)."""
    if DEVICE == "cpu":
        return 1
    return max(1, min(calls, -(-ROTATED_BYTES // max(nbytes, 1))))


def file_stem(text: str) -> str:
    """``text`` (a setting such as ``threshold0.5+quest0.2``) as a file name's stem: every character
    but letters, digits, ``.``, ``_`` and ``-`` becomes ``_``. Tools that copy results back from a
    machine leave out names with other characters."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)


def weight_copies(nbytes: int) -> int:
    """How many copies of a weight of ``nbytes`` bytes a GEMV probe cycles through: three L2 caches'
    worth, two at least (one on the CPU)."""
    if DEVICE == "cpu":
        return 1
    return max(2, -(-3 * L2_BYTES // max(nbytes, 1)))


def rotating(fns: list[Callable[[], object]]) -> Callable[[], object]:
    """One call of each of ``fns`` per call, in turn (so a captured graph cycles through copies)."""
    turn = itertools.cycle(fns)
    return lambda: next(turn)()


def call_and_time_ms(fn: Callable[[], T], timed: Callable[[], object] | None = None) -> tuple[T, float]:
    """``(fn(), ms)``: the result of one call of ``fn`` and then the per-call time of ``timed`` (default
    ``fn``) by `graph_time_ms`. On the CPU, a smoke test with the kernels in Triton's interpreter
    (each call takes seconds, and the figure means nothing), the time of that one call instead."""
    t0 = time.perf_counter()
    out = fn()
    if DEVICE != "cuda":
        return out, (time.perf_counter() - t0) * 1e3
    return out, graph_time_ms(timed or fn)


def graph_time_ms(fn: Callable[[], object], calls: int = 20) -> float:
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


def plot_speedups(rows: list[dict], path: Path, title: str) -> None:
    """Speedup over dense against context, one solid line per setting (a colour and marker of its
    own), its byte bound dashed in the same colour (marked x, so a single context shows too). ``rows``: dicts with ``setting``,
    ``context``, ``speedup`` and ``bound``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    names = sorted({r["setting"] for r in rows})
    # Matplotlib's default cycle repeats after 10 colours: past that, settings would share one.
    colours = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    markers = "os^Dv<>p*h"
    for i, name in enumerate(names):
        rs = sorted((r for r in rows if r["setting"] == name), key=lambda r: r["context"])
        xs = [r["context"] / 1024 for r in rs]
        colour = colours(i % colours.N)
        ax.plot(xs, [r["speedup"] for r in rs], marker=markers[i % len(markers)], color=colour, label=name)
        ax.plot(xs, [r["bound"] for r in rs], linestyle="--", marker="x", color=colour, alpha=0.6)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (K tokens)")
    ax.set_ylabel("speedup over dense (same kernel)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

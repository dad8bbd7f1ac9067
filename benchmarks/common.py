"""What the device benchmarks share: the Llama-3.1-8B-shaped model with random weights, and a cache
filled with random keys and values (speed does not depend on the values at fixed budgets)."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch

from policyzoo import Decoder

ROOT = Path(__file__).resolve().parents[1]


def source_digest(root: Path = ROOT) -> str:
    """A short hash of the code a benchmark ran (every ``.py`` under ``policyzoo/`` and
    ``benchmarks/``, by path and content). The device machine's copy of ``.git`` can be stale (run 7
    logged an older commit than the tree it ran), so the sweep records this (``meta.source``): a
    checkout of the commit that ran gives the same digest."""
    h = hashlib.sha256()
    for path in sorted(p for folder in ("policyzoo", "benchmarks") for p in (root / folder).rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def llama8b(device: str, layers: int | None = None, tiny: bool = False):
    """Llama-3.1-8B shape with random weights (bf16 on CUDA), or a toy model of the same structure
    (``tiny``, for CPU smoke tests); ``layers`` defaults to 32 (2 when tiny)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dims = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, vocab_size=128256)  # fmt: skip
    if tiny:
        dims = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=32, vocab_size=1024)  # fmt: skip
    cfg = LlamaConfig(**dims, num_hidden_layers=layers or (2 if tiny else 32), max_position_embeddings=262144,
                      rope_theta=500000.0, tie_word_embeddings=False, pad_token_id=0, eos_token_id=None,
                      bos_token_id=None)  # fmt: skip
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


def fill_cache(dec: Decoder, batch: int, n: int, capacity: int, generator: torch.Generator) -> None:
    """Give the Decoder a cache of exactly ``capacity`` tokens (rounded up to whole pages; reused only
    when it already has that size) and fill its first ``n`` slots with random keys and values,
    summaries included (no prefill).

    A larger cache would not do: the kernels' grids follow the capacity (empty pages still cost
    programs), so a short context timed on a cache left by a longer one reads slow (run 6, call 1:
    `TopK(0.5)` at 2K-16K on a 32K cache, about 0.5 ms per step)."""
    old = dec.runtime.cache
    if old is not None and old.capacity != math.ceil(capacity / old.page_size) * old.page_size:
        dec.runtime.cache, dec.runtime.states = None, []  # `_prepare_cache` would keep a larger one
    dec._prepare_cache(batch, capacity, torch.zeros(batch, dtype=torch.long, device=dec.device), n)
    cache = dec.runtime.cache
    for layer in range(cache.num_layers):
        cache.keys[layer][:, :, :n].normal_(generator=generator)
        cache.values[layer][:, :, :n].normal_(generator=generator)
        cache._summarise(layer, slice(0, math.ceil(n / cache.page_size)))


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

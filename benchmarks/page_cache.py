"""How often offload's page caches find the pages a step selects, on a real model and real text (CPU).

`Offload(layers, cache=share)` keeps device copies of each offloaded layer's recently selected pages
(`policyzoo.offload.PageCache`); a step fetches only the pages it misses over the host link, so the
link's bytes are ``1 - hit rate`` of the synchronous form's. The hit rate depends on how much
consecutive steps' selections overlap, which random weights and random keys (the H200 sweep's
1M-token rows) do not show. This measures it on the embedded model: every layer offloaded, each
prompt a window of the essays, ``--new-tokens`` greedy tokens decoded, per KV policy, context and
page-cache share. On CPU the "host" is the same memory, so only the hit rate means anything here.

Run:

    python -m benchmarks.page_cache --kv quest:0.1 --contexts 1024,2048,4096 --shares 0.15,0.2,0.3 \\
        --out benchmarks/results/smollm2-page-cache
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from policyzoo import Decoder, Offload
from policyzoo.assets import essays_text, load_model
from policyzoo.spec import parse_kv


def prompts(tokenizer, n: int, count: int) -> list[torch.Tensor]:
    """``count`` windows of ``n`` essay tokens, spread over the essays."""
    ids = tokenizer(essays_text(), return_tensors="pt").input_ids[0]
    if ids.numel() < n:
        raise ValueError(f"the essays hold {ids.numel()} tokens; a context of {n} does not fit")
    starts = torch.linspace(0, ids.numel() - n, count).long().tolist()
    return [ids[s : s + n][None] for s in starts]


def measure(model, tokenizer, kv: str, contexts: list[int], shares: list[float], new_tokens: int, count: int) -> list[dict]:
    layers = model.config.num_hidden_layers
    rows = []
    cells = [(n, share) for n in contexts for share in shares]
    for n, share in tqdm(cells, desc=f"page cache {kv}"):
        hits = torch.zeros(layers, dtype=torch.long)
        lookups = torch.zeros(layers, dtype=torch.long)
        row = {"kv": kv, "context": n, "share": share, "new_tokens": new_tokens, "prompts": count}
        try:
            for ids in prompts(tokenizer, n, count):
                dec = Decoder(model, kv=parse_kv(kv), offload=Offload(layers, cache=share))
                dec.generate(ids, new_tokens)
                cache = dec.session.cache
                for layer, pc in cache.page_caches.items():
                    counts = pc.counts()
                    hits[layer] += counts.lookups - counts.fetched  # pages the link did not carry
                    lookups[layer] += counts.lookups
        except ValueError as e:  # a selection wider than the cache
            row["error"] = str(e)
            rows.append(row)
            continue
        per_layer = (hits.double() / lookups.clamp(min=1).double()).tolist()
        row.update({"hit_rate": float(hits.sum() / lookups.sum().clamp(min=1)), "layer_min": min(per_layer),
                    "layer_max": max(per_layer), "per_layer": per_layer})
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| KV policy | context | cache share | hit rate | lowest layer | highest layer |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| `{r['kv']}` | {r['context']} | {r['share']} | too small: {r['error'][:60]}… | | |")
        else:
            lines.append(f"| `{r['kv']}` | {r['context']} | {r['share']} | {r['hit_rate']:.3f} | {r['layer_min']:.3f} | {r['layer_max']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (kv, n) in sorted({(r["kv"], r["context"]) for r in rows}):
        pts = [(r["share"], r["hit_rate"]) for r in rows if r["kv"] == kv and r["context"] == n and "hit_rate" in r]
        if pts:
            ax.plot(*zip(*sorted(pts)), marker="o", label=f"{kv} @ {n}")
    ax.set_xlabel("page cache (share of each layer's pages)")
    ax.set_ylabel("hit rate (pages found on the device)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kv", nargs="+", default=["quest:0.1"], help="KV policy specs (policyzoo.spec)")
    p.add_argument("--contexts", default="1024,2048,4096")
    p.add_argument("--shares", default="0.15,0.2,0.3", help="page-cache shares (Offload(cache=...))")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=2, help="essay windows per cell")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default="benchmarks/results/smollm2-page-cache")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model()
    contexts = [int(c) for c in args.contexts.split(",")]
    shares = [float(s) for s in args.shares.split(",")]
    t0 = time.perf_counter()
    rows = [r for kv in args.kv for r in measure(model, tokenizer, kv, contexts, shares, args.new_tokens, args.prompts)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": "smollm2-135m", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "wall_s": time.perf_counter() - t0, "command": "python -m benchmarks.page_cache " + " ".join(argv or [])}
    (out / "page_cache.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "page_cache.md").write_text(table(rows))
    plot(rows, out / "page_cache.png")
    print(table(rows))


if __name__ == "__main__":
    main()

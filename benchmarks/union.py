"""The union fraction of a batch's kept projection inputs, on real text (CPU, the embedded model).

At batch > 1 the sparse GEMV reads a weight row when any row of the batch keeps its input, so the
bytes it saves shrink as the batch grows. This measures that fraction on real activations: B essay
passages decode side by side (each row its own passage), and at every position the kept sets of
the B rows are OR-ed, per projection group as the kernel reads it (q|k|v and gate|up: a row counts
when any member keeps it). Run:

    python -m benchmarks.union --proj topk:0.5 threshold:path=FILE topk:mode=fast,path=FILE \\
        --out benchmarks/results/smollm2-projection

It writes ``union.json`` and ``union.md`` (one row per sparsifier, group and batch).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from policyzoo._compat import PROJECTIONS, SHARED_INPUT, decoder_layers
from policyzoo.assets import essays_text, load_model
from policyzoo.spec import parse_proj

BATCHES = (1, 4, 16)


@torch.no_grad()
def kept_inputs(model, ids: torch.Tensor, proj, positions: slice) -> dict[str, torch.Tensor]:
    """``{"<layer>.<group>": bool[rows, positions, d_in]}``: inputs the sparsifier keeps, OR-ed over
    the members of each group of one input (a single projection is a group of one)."""
    kept: dict[str, torch.Tensor] = {}
    hooks = []
    groups = [g for g in SHARED_INPUT] + [(t,) for t in PROJECTIONS if not any(t in g for g in SHARED_INPUT)]
    for i, layer in enumerate(decoder_layers(model)):
        for group in groups:
            members = [t for t in group if t in proj.targets]
            if not members:
                continue
            parent, linear = PROJECTIONS[members[0]]
            module = getattr(getattr(layer, parent), linear)

            def hook(module, args, i=i, group=group, members=members):
                x = args[0][:, positions]
                masks = [proj.keep_mask(f"{i}.{t}", x.reshape(-1, x.shape[-1])).view(x.shape) for t in members]
                kept["|".join(group) if len(group) > 1 else group[0], i] = torch.stack(masks).any(0)

            hooks.append(module.register_forward_pre_hook(hook))
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return kept


def union_fractions(kept: torch.Tensor, batch: int) -> float:
    """Mean over positions and disjoint groups of ``batch`` rows of the fraction of inputs some row keeps."""
    rows = kept.shape[0] - kept.shape[0] % batch
    k = kept[:rows].view(rows // batch, batch, *kept.shape[1:])
    return k.any(1).float().mean().item()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--proj", nargs="+", required=True, help="projection specs (policyzoo.spec)")
    p.add_argument("--rows", type=int, default=16, help="passages side by side (the largest batch)")
    p.add_argument("--tokens", type=int, default=192, help="tokens per passage")
    p.add_argument("--positions", type=int, default=64, help="last positions of each passage measured")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model, tok = load_model()
    ids = tok(essays_text(), return_tensors="pt").input_ids[0]
    # Passages from far apart in the essays (the calibration texts are the first 8K tokens: skip them).
    starts = [8192 + i * (len(ids) - 8192 - args.tokens) // args.rows for i in range(args.rows)]
    batch_ids = torch.stack([ids[s : s + args.tokens] for s in starts])
    positions = slice(args.tokens - args.positions, args.tokens)
    rows = []
    for spec in args.proj:
        proj = parse_proj(spec)
        kept = kept_inputs(model, batch_ids, proj, positions)
        by_group: dict[str, list[torch.Tensor]] = {}
        for (group, _), k in kept.items():
            by_group.setdefault(group, []).append(k)
        for group, ks in by_group.items():
            for b in BATCHES:
                if b > args.rows:
                    continue
                rows.append({"proj": spec, "group": group, "batch": b,
                             "union": sum(union_fractions(k, b) for k in ks) / len(ks)})
                print(f"{spec:<60} {group:<8} B={b:<3} union {rows[-1]['union']:.3f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"rows": args.rows, "tokens": args.tokens, "positions": args.positions, "torch": torch.__version__}
    (out / "union.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    write_markdown(out / "union.md", meta, rows)


def write_markdown(path: Path, meta: dict, rows: list[dict]) -> None:
    """The table of ``union.json``'s rows: one line per sparsifier and group, a column per batch."""
    lines = ["# Union of the kept projection inputs across a batch (SmolLM2-135M, essays)", "",
             f"{meta['rows']} passages of {meta['tokens']} tokens side by side; the last {meta['positions']} positions of each.", "",
             "| proj | group | " + " | ".join(f"B={b}" for b in BATCHES) + " |", "|---|---|" + "---:|" * len(BATCHES)]
    for spec in dict.fromkeys(r["proj"] for r in rows):
        for group in dict.fromkeys(r["group"] for r in rows if r["proj"] == spec):
            cells = {r["batch"]: r["union"] for r in rows if r["proj"] == spec and r["group"] == group}
            escaped = group.replace("|", "\\|")  # a pipe would end the table cell
            lines.append(f"| `{spec}` | {escaped} | " + " | ".join(f"{cells[b]:.3f}" if b in cells else "—" for b in BATCHES) + " |")
    path.write_text("\n".join(lines) + "\n")

if __name__ == "__main__":
    main()

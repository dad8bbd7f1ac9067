"""Plot the compiled decode steps of one results folder: speedup over dense against context.

    python -m benchmarks.plot_results benchmarks/results/2026-11-29-h200-run4

Reads every ``*.json`` the sweep wrote there (one per device call) and takes the ``compiled`` rows.
Each speedup divides by the dense row of the same context, batch and mode (``compiled`` or
``compiled-dynamic``) *in the same file* (ratios from one run; timings drift by a few percent
between calls), so a setting only gets a point where its call also timed dense. When several calls measured one (setting, context), the last file in name order wins.
A row that carries an ``excluded`` note (added by hand to a results file, saying why the timing is
not to be trusted) is left out, and listed under the table.
Writes ``compiled.png`` (bounds dashed) and ``compiled.md`` into the folder.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import common


def compiled_points(folder: Path) -> list[dict]:
    """One dict per (setting, context) with ``speedup`` over the same call's dense and ``bound``."""
    points: dict[tuple[str, int], dict] = {}
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        rows = [r for r in data.get("rows", []) if r.get("section") == "compiled" and "ms" in r and "excluded" not in r]
        dense = {(r.get("mode"), r["context"], r.get("batch", 1)): r["ms"] for r in rows if r["setting"] == "dense"}
        for r in rows:
            key = (r.get("mode"), r["context"], r.get("batch", 1))
            if r["setting"] == "dense" or key not in dense:
                continue
            speedup = dense[key] / r["ms"]
            # a step compiled for every capacity at once is a different build, another batch a
            # different step: both labelled apart
            setting = r["setting"] + (" (dynamic capacity)" if r.get("mode") == "compiled-dynamic" else "")
            setting += f" (batch {key[2]})" if key[2] != 1 else ""
            points[setting, r["context"]] = {
                "setting": setting, "context": r["context"], "ms": r["ms"], "dense_ms": dense[key],
                "speedup": speedup, "bound": r["bound"], "of_bound": speedup / r["bound"], "file": path.name,
            }
    return sorted(points.values(), key=lambda p: (p["setting"], p["context"]))


def excluded_rows(folder: Path) -> list[tuple[str, dict]]:
    """``(file name, row)`` of the compiled rows marked ``excluded``."""
    return [(path.name, r) for path in sorted(folder.glob("*.json"))
            for r in json.loads(path.read_text()).get("rows", []) if r.get("section") == "compiled" and "excluded" in r]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    args = p.parse_args(argv)
    points = compiled_points(args.folder)
    if not points:
        raise SystemExit(f"{args.folder}: no compiled rows with a dense row of the same context and call")
    gpu = next((json.loads(f.read_text())["meta"].get("gpu", "") for f in sorted(args.folder.glob("*.json"))), "")
    common.plot_speedups(points, args.folder / "compiled.png",
                         f"compiled decode step, llama-3.1-8b shape, batch 1 unless labelled, {gpu}\nmeasured (solid, o) vs byte bound (dashed, x)")
    lines = ["| setting | context | ms | dense ms (same call) | speedup | bound | of bound | call |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {q['setting']} | {q['context']} | {q['ms']:.2f} | {q['dense_ms']:.2f} | {q['speedup']:.2f} | "
              f"{q['bound']:.2f} | {q['of_bound']:.2f} | {q['file']} |" for q in points]
    left_out = excluded_rows(args.folder)
    if left_out:
        lines += ["", "Left out (each row's `excluded` note):", ""]
        lines += [f"- {r['setting']} at {r['context']} ({name}): {r['excluded']}" for name, r in left_out]
    (args.folder / "compiled.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

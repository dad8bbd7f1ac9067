"""Summarise the sweep's ``gemvfused`` probe: the threshold GEMV's bandwidth beside cuBLAS.

    python -m benchmarks.plot_gemv benchmarks/results/2026-12-01-h200-run10/call3.json

Per projection group and batch: cuBLAS (``x @ W^T`` over all the weights), the kernel with the
launch parameters in force when the probe ran (``default``), and the fastest parameters the probe
tried. Bandwidth counts the weight rows the kernel reads (the union of the rows' kept features) for
the kernel, all of them for cuBLAS. Writes ``<stem>-gemv.md`` and ``<stem>-gemv.png`` beside the JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TARGET_TBPS = 3.6  # the projection issue's bar for the rows the kernel reads


def gemv_summary(rows: list[dict]) -> list[dict]:
    """One dict per (shape, batch) of the ``gemvfused`` rows, in the order they were measured."""
    out: dict[tuple[str, int], dict] = {}
    for r in rows:
        if r.get("section") != "gemvfused" or "us" not in r:
            continue
        key = (r["shape"], r["batch"])
        s = out.setdefault(key, {"shape": r["shape"], "batch": r["batch"], "union": r["union"], "cublas_us": r["cublas_us"],
                                 "cublas_TB/s": r["cublas_TB/s"]})
        if r["setting"].endswith(" default"):
            s["default_us"], s["default_TB/s"] = r["us"], r["TB/s"]
        if "best_us" not in s or r["us"] < s["best_us"]:
            s.update({"best_us": r["us"], "best_TB/s": r["TB/s"], "best": r["setting"].removeprefix("threshold GEMV ")})
    for s in out.values():
        s["best_vs_cublas"] = s["cublas_us"] / s["best_us"]
    return list(out.values())


def table(summary: list[dict]) -> str:
    head = ["group", "batch", "union read", "cuBLAS µs (TB/s)", "default µs (TB/s)", "best µs (TB/s)", "best vs cuBLAS",
            "best parameters"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summary:
        default = f"{s['default_us']:.1f} ({s['default_TB/s']:.2f})" if "default_us" in s else "—"
        shape = s["shape"].replace("|", "\\|")  # q|k|v inside a table cell
        lines.append(f"| {shape} | {s['batch']} | {s['union']:.3f} | {s['cublas_us']:.1f} ({s['cublas_TB/s']:.2f}) | {default} | "
                     f"{s['best_us']:.1f} ({s['best_TB/s']:.2f}) | {s['best_vs_cublas']:.2f}x | {s['best']} |")
    return "\n".join(lines) + "\n"


def plot(summary: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{s['shape']}\nB={s['batch']}" for s in summary]
    xs = range(len(summary))
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(summary)), 4.5))
    w = 0.27
    ax.bar([x - w for x in xs], [s["cublas_TB/s"] for s in summary], w, label="cuBLAS (all rows)")
    ax.bar(list(xs), [s.get("default_TB/s", 0) for s in summary], w, label="threshold GEMV, default")
    ax.bar([x + w for x in xs], [s["best_TB/s"] for s in summary], w, label="threshold GEMV, best tried")
    ax.axhline(TARGET_TBPS, color="k", ls="--", lw=1, label=f"target {TARGET_TBPS} TB/s")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("TB/s of the weight rows read")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", type=Path, help="a sweep JSON with gemvfused rows")
    args = ap.parse_args(argv)
    data = json.loads(args.json.read_text())
    summary = gemv_summary(data.get("rows", []))
    if not summary:
        raise SystemExit(f"{args.json}: no gemvfused rows")
    stem = args.json.with_suffix("")
    meta = data.get("meta", {})
    title = f"threshold GEMV at keep 0.5 vs cuBLAS — {meta.get('gpu', '?')}, {meta.get('date', '?')}"
    Path(f"{stem}-gemv.md").write_text(f"# {title}\n\n{table(summary)}")
    plot(summary, Path(f"{stem}-gemv.png"), title)
    print(table(summary))


if __name__ == "__main__":
    main()

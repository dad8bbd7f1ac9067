"""The evaluation report: the markdown results table, the PNG plots and the versions of a run."""

from __future__ import annotations

import math
import platform
from pathlib import Path
from typing import Any

import numpy as np


def length_label(n: int) -> str:
    """``1024 -> "1K"``, ``1536 -> "1.5K"``, ``1000 -> "1000"``, ``256 -> "256"``."""
    return f"{n / 1024:g}K" if n >= 1024 and n % 256 == 0 else str(n)


def _fmt(x: Any, spec: str = ".3f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return format(x, spec)


def _reuse(row: dict[str, Any]) -> str:
    """``"0.42 / 0.50"``: the reuse rates along time and layers (`kv.PrHS`), ``—`` for other policies."""
    time, layer = row.get("reuse_time"), row.get("reuse_layer")
    if all(x is None or (isinstance(x, float) and math.isnan(x)) for x in (time, layer)):
        return "—"
    return f"{_fmt(time, '.2f')} / {_fmt(layer, '.2f')}"


def format_markdown(results: dict[str, Any], title: str = "") -> str:
    """The results table: one row per setting × task × length."""
    head = [
        "setting", "task", "length", "n", "acc", "ppl dense → policy", "Δppl", "δ mean", "δ p95", "δ max",
        "δ bound mean", "recall", "out err", "KL", "top-1", "kv keep", "proj keep", "reuse time / layer",
    ]  # fmt: skip
    align = ["---", "---", "---:"] + ["---:"] * (len(head) - 3)
    lines = [f"# {title}", ""] if title else []
    lines += ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    for r in results["rows"]:
        ppl = f"{r['dense_ppl']:.3f} → {r['ppl']:.3f}" if r.get("ppl") is not None else "—"
        dppl = f"{r['ppl_increase']:+.3f} ({100 * r['ppl_increase_rel']:+.1f}%)" if r.get("ppl") is not None else "—"
        cells = [
            r["setting"], r["task"], length_label(r["length"]), str(r["n"]), _fmt(r.get("accuracy"), ".2f"), ppl, dppl,
            _fmt(r["delta_mean"]), _fmt(r["delta_p95"]), _fmt(r["delta_max"]), _fmt(r.get("bound_mean")), _fmt(r["recall"]),
            _fmt(r["output_error"]), _fmt(r["kl"], ".4f"), _fmt(r["top1"], ".3f"), _fmt(r["kv_keep"]), _fmt(r["proj_keep"]),
            _reuse(r),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], out: Path) -> list[Path]:
    """``accuracy.png`` (accuracy of each retrieval task and the relative perplexity increase vs
    length, a line per setting)
    and ``delta_per_layer.png`` (mean δ per layer, a line per setting, one panel per length)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    labels = [s["label"] for s in results["settings"]]
    kvs = list(dict.fromkeys(s["kv"] for s in results["settings"]))
    projs = list(dict.fromkeys(s["proj"] for s in results["settings"]))
    cmap = plt.get_cmap("tab10")
    style = {
        s["label"]: dict(
            color=cmap(kvs.index(s["kv"]) % 10),
            linestyle=["-", "--", ":", "-."][projs.index(s["proj"]) % 4],
            marker=["o", "s", "^", "x"][projs.index(s["proj"]) % 4],
            markerfacecolor="none" if projs.index(s["proj"]) else None,
        )
        for s in results["settings"]
    }
    # a small horizontal offset per setting keeps equal accuracies from hiding each other
    offset = {label: 0.02 * (i - (len(labels) - 1) / 2) for i, label in enumerate(labels)}
    written = []
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    panels = [(t, "accuracy") for t in tasks if any(r["task"] == t and r["accuracy"] is not None for r in rows)]
    panels += [(t, "ppl_increase_rel") for t in tasks if any(r["task"] == t and r.get("ppl") is not None for r in rows)]
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels) + 2.8, 4.2), squeeze=False)
        for ax, (task, metric) in zip(axes[0], panels):
            scale = 100.0 if metric == "ppl_increase_rel" else 1.0
            for label in labels:
                pts = sorted((r["length"], r[metric]) for r in rows if r["setting"] == label and r["task"] == task)
                if pts:
                    xs = [p[0] / 1024 + offset[label] for p in pts]
                    ax.plot(xs, [scale * p[1] for p in pts], label=label, **style[label])
            ax.set_xticks(sorted({r["length"] / 1024 for r in rows}))
            ax.set_xlabel("length (K tokens)")
            ax.set_ylabel("accuracy" if metric == "accuracy" else "perplexity increase over dense (%)")
            ax.set_title(task)
            if metric == "accuracy":
                ax.set_ylim(-0.05, 1.05)
            ax.grid(alpha=0.3)
        written.append(_save_with_legend(fig, axes, out / "accuracy.png"))
    lengths = sorted({r["length"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5.2 * len(lengths) + 2.8, 4.2), squeeze=False, sharey=True)
    for ax, length in zip(axes[0], lengths):
        for label in labels:
            curves = [r["delta_per_layer"] for r in rows if r["setting"] == label and r["length"] == length and r["delta_per_layer"]]
            if curves:
                ax.plot(range(len(curves[0])), np.mean(np.array(curves), 0), label=label, **{**style[label], "marker": "."})
        ax.set_xlabel("layer")
        ax.set_title(f"mean dropped mass δ per layer, {length_label(length)}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("δ (mean over steps, heads, tasks)")
    written.append(_save_with_legend(fig, axes, out / "delta_per_layer.png"))
    return written


def _save_with_legend(fig: Any, axes: Any, path: Path) -> Path:
    """One legend right of the last panel, then write and close the figure."""
    import matplotlib.pyplot as plt

    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def versions() -> dict[str, str]:
    """Versions of the packages a result depends on."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("policyzoo", "torch", "transformers", "datasets", "numpy"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out

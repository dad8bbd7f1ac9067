"""`benchmarks/results/LATEST.md`: the newest figure of every benchmark setting, each linked to its run.

Every device sweep writes a JSON file (``{"meta": {...}, "rows": [...]}``) into a folder of
``benchmarks/results/``. This script reads all of them, keeps for each setting (section, mode,
setting, context, batch, shape) the row of the newest run (by the run's date, then folder, then
file), and writes one table per section. Ratios (speedups, ``generate/step``) are always those of
the row's own run, never across runs. The README's GPU summary is the block between the markers
``<!-- latest:begin -->`` and ``<!-- latest:end -->``: `readme_block` writes it from the same rows.

    python -m benchmarks.latest            # rewrite LATEST.md and the README block
    python -m benchmarks.latest --check    # exit 1 if either is out of date (a test runs this)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
BEGIN, END = "<!-- latest:begin -->", "<!-- latest:end -->"

# The sections LATEST.md reports, in order, with their columns (probe sections are diagnostics of
# one run, read in that run's README).
COLUMNS = {
    "generate": ("generate_ms", "step_ms", "generate/step", "floor_ms", "ms/floor", "tok/s"),
    "compiled": ("ms", "floor_ms", "ms/floor", "speedup", "bound", "speedup/bound"),
    "hf": ("ms", "floor_ms", "ms/floor"),
    "kernel": ("us", "TB/s", "vs_dense_kernel"),
    "batch": ("ms", "floor_ms", "ms/floor", "speedup", "bound"),
    "step": ("ms", "floor_ms", "ms/floor", "speedup", "bound"),
    "tp": ("world", "generate_ms", "step_ms", "generate/step", "floor_ms", "ms/floor"),
    "many": ("order", "generate_ms", "fresh_generate_ms", "shared/alone", "step_ms", "floor_ms", "x_dense", "bound", "fallbacks"),
}
TITLES = {
    "generate": "`Decoder.generate` end to end (EOS id set, streamer attached, prefill excluded) beside the compiled step alone",
    "compiled": "Compiled decode step (GPU time), against dense through the same kernel and the byte bound",
    "hf": "Hugging Face `generate` on the same model shape",
    "kernel": "One layer's decode attention",
    "batch": "Eager step captured in a CUDA graph, batch rows",
    "step": "Eager step captured in a CUDA graph",
    "tp": "Tensor-parallel `Decoder.generate` on each of `world` GPUs (`benchmarks.tp`; floor: one rank's bytes)",
    "many": "Many compiled Decoders in one process (`benchmarks.many_decoders`): `generate` per setting in the shared process, "
            "in the order given, and alone in a process of its own",
}


# Settings whose definition changed: the rows of runs dated before the change measured what the
# second name means now, and are listed under it.
REDEFINED = {
    # `CommunityKV.split` (default 4) came on 2026-12-06; the earlier rows scored whole communities.
    "community-kv0.1-runs10": ("2026-12-06", "community-kv0.1-runs10-whole"),
    # `EntmaxKV.float64_steps` (default 0) came on 2026-12-07; the earlier rows took float64 steps.
    "entmax-kv0.1": ("2026-12-07", "entmax-kv0.1-f64"),
}


@dataclass(frozen=True)
class Row:
    """One benchmark row and the run it came from."""

    data: dict
    meta: dict
    path: Path  # the run's JSON file

    @property
    def key(self) -> tuple:
        d = self.data
        return (d.get("section"), d.get("mode", ""), d.get("setting"), d.get("context"), d.get("batch", 1), d.get("shape", ""),
                d.get("model", self.meta.get("model", "")), d.get("host_layers") or 0, d.get("page_cache") or 0.0,
                bool(d.get("prefetch")), d.get("world", 1))

    @property
    def order(self) -> tuple:
        """Newer runs sort later: the run's date, its folder, then its file, folder and file names in
        natural order (run10 after run9, call2 after call1)."""
        return (str(self.meta.get("date", "")), _natural(self.path.parent.name), _natural(self.path.name))


def _natural(name: str) -> list:
    """``name`` split into text and numbers, so that numbers compare as numbers."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def load_rows(results: Path = RESULTS) -> list[Row]:
    """Every measured row of every sweep JSON under ``results`` (rows with an error, or marked
    ``excluded`` by their run, are left out)."""
    rows = []
    for path in sorted(results.glob("*/*.json")):
        try:
            record = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if not isinstance(record, dict) or not isinstance(record.get("meta"), dict) or "gpu" not in record["meta"]:
            continue  # not a device sweep (quality results, gate files)
        for d in record.get("rows", []):
            if isinstance(d, dict) and d.get("section") in COLUMNS and "error" not in d and not d.get("excluded"):
                changed, now = REDEFINED.get(d.get("setting"), ("", ""))
                if str(record["meta"].get("date", "")) < changed:
                    d = {**d, "setting": now}
                rows.append(Row(d, record["meta"], path))
    return rows


def newest(rows: list[Row]) -> list[Row]:
    """The newest row of each setting."""
    best: dict[tuple, Row] = {}
    for row in rows:
        if row.key not in best or row.order >= best[row.key].order:
            best[row.key] = row
    return sorted(best.values(), key=lambda r: tuple(str(x) for x in r.key[:3]) + (r.key[3] or 0, r.key[4] or 1))


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"
    return "" if value is None else str(value)


def _link(row: Row, base: Path) -> str:
    rel = row.path.relative_to(base)
    return f"[{row.path.parent.name}/{row.path.stem}]({rel.as_posix()})"


def render(rows: list[Row], base: Path = RESULTS) -> str:
    """LATEST.md: one table per section, newest row per setting, each with its GPU, date and run."""
    lines = [
        "# Latest GPU figures",
        "",
        "The newest measurement of every benchmark setting, written by `python -m benchmarks.latest` from the",
        "sweep JSON files in this folder. Each row links to the run it comes from; its ratios (speedup",
        "over dense, `generate/step`) are from that run alone. Floors and bounds are the byte account",
        "(`policyzoo.bytes`) over the run's measured copy bandwidth.",
        "",
    ]
    for section, columns in COLUMNS.items():
        sec = [r for r in rows if r.data.get("section") == section]
        if not sec:
            continue
        head = ["setting", "mode", "context", "batch", *columns, "GPU", "date", "run"]
        lines += [f"## {section}: {TITLES[section]}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in sec:
            d = r.data
            name = d.get("setting", "") + (f" ({d['shape']})" if d.get("shape") else "") + (f" [{d['model']}]" if d.get("model") else "")
            if d.get("host_layers"):  # offloaded: the layers on the host and the page cache's share and hit rate
                name += f" (offload {d['host_layers']} layers" + (f", page cache {d['page_cache']:g}, hits {d['hit_rate']:.2f}" if d.get("page_cache") else "")
                name += (", prefetch" if d.get("prefetch") else "") + ")"
            cells = [name, d.get("mode", ""), d.get("context", ""), d.get("batch", 1), *(d.get(c) for c in columns)]
            cells += [r.meta.get("gpu", ""), r.meta.get("date", ""), _link(r, base)]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def readme_block(rows: list[Row]) -> str:
    """The README's GPU summary: the end-to-end rows, and Hugging Face's `generate` timed as they
    are, newest per setting."""
    gen = [r for r in rows if r.data.get("section") == "generate"]
    lines = [BEGIN, "", "Drawn from [benchmarks/results/LATEST.md](benchmarks/results/LATEST.md) by `python -m benchmarks.latest`.", ""]
    if gen:
        lines += ["| model | setting | context | batch | `generate` ms/token | step ms | generate / step | byte floor ms | run |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in gen:
            d = r.data
            lines.append(
                f"| {d.get('model', r.meta.get('model', ''))} | {d['setting']} | {d['context']} | {d.get('batch', 1)} | {_cell(d.get('generate_ms'))} | "
                f"{_cell(d.get('step_ms'))} | {_cell(d.get('generate/step'))} | {_cell(d.get('floor_ms'))} | {_link(r, ROOT)} |"
            )
        lines.append("")
    hf = [r for r in rows if r.data.get("section") == "hf" and r.data.get("mode") == "streamer"]
    if hf:
        lines += ["Hugging Face `generate` on the same model shape, timed the same way (streamer, EOS id):", "",
                  "| model | setting | context | ms/token | run |", "|---|---|---:|---:|---|"]
        for r in hf:
            d = r.data
            lines.append(f"| {d.get('model', r.meta.get('model', ''))} | {d['setting']} | {d['context']} | {_cell(d.get('ms'))} | {_link(r, ROOT)} |")
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


def update_readme(text: str, block: str) -> str:
    """``text`` with the block between the markers replaced (the markers must be there)."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"README.md has no {BEGIN} ... {END} block")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + block + tail


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 if LATEST.md or the README block is out of date")
    args = p.parse_args(argv)
    rows = newest(load_rows())
    latest, readme = render(rows) + "\n", update_readme(README.read_text(), readme_block(rows))
    target = RESULTS / "LATEST.md"
    if args.check:
        stale = [str(path.relative_to(ROOT)) for path, text in ((target, latest), (README, readme)) if not path.exists() or path.read_text() != text]
        if stale:
            print(f"out of date: {', '.join(stale)} (run python -m benchmarks.latest)", file=sys.stderr)
            return 1
        return 0
    target.write_text(latest)
    README.write_text(readme)
    print(f"wrote {target.relative_to(ROOT)} ({len(rows)} settings) and the README block")
    return 0


if __name__ == "__main__":
    sys.exit(main())

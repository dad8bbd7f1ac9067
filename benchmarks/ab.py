"""End-to-end A/B of kernel launch settings: `Decoder.generate` (the sweep's generate section) under
each variant, every variant in a process of its own, the variants' order alternating round by round.

Run on a CUDA machine::

    python -m benchmarks.ab --generate quest0.1@131072,quest0.1@32768 --dynamic-capacity \\
        --variant last=select_pages.finish_min_row=1073741824 --variant default= --rounds 2 \\
        --out benchmarks/results/RUN/ab

A variant is ``NAME=`` followed by comma-separated settings (nothing: the defaults): kernel launch
settings ``kernel.field=value``, the sweep's ``--override`` (`kernels.config.parse_overrides`), and
environment variables of the variant's process ``env:NAME=VALUE`` (Inductor's, for instance:
``pdl=env:TORCHINDUCTOR_ENABLE_PDL=1``). The first variant is the baseline. Round ``r`` runs the variants in order when ``r`` is even and in reverse when odd (A B,
B A, A B, ...): in one session on an H100 the first of two generate processes ran 1.5-5% faster
than the second whatever it ran (benchmarks/results/2026-12-06-h100-run28), so an A/B that always
starts with the same variant measures the order as well.

Per setting (setting, context, batch) and variant: ms/token of every round, their median, and the
ratio to the baseline within each round (neighbouring processes), as the median and the range over
the rounds. Written to ``--out``: ``ab.json`` (every process's generate rows, its variant, round and
position), ``ab.md`` (the table) and each process's log. Without a GPU, ``--tiny --backend
aot_eager`` runs it as a smoke test (timings that mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from policyzoo.kernels import config

from . import common


ENV = "env:"


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``NAME=setting,...`` → ``(NAME, settings)``; the settings are checked here."""
    name, eq, rest = text.partition("=")
    if not name or not eq:
        raise ValueError(f"expected NAME=kernel.field=value,... (or NAME= for the defaults), got {text!r}")
    settings = [s for s in rest.split(",") if s]
    config.parse_overrides([s for s in settings if not s.startswith(ENV)])
    for s in settings:
        if s.startswith(ENV) and not s[len(ENV):].partition("=")[0]:
            raise ValueError(f"expected env:NAME=VALUE, got {s!r}")
    return name, settings


def environment(settings: list[str]) -> dict[str, str]:
    """This process's environment with a variant's ``env:NAME=VALUE`` settings."""
    env = dict(os.environ)
    for s in settings:
        if s.startswith(ENV):
            key, _, value = s[len(ENV):].partition("=")
            env[key] = value
    return env


def schedule(names: list[str], rounds: int) -> list[tuple[int, int, str]]:
    """``(round, position, variant)`` in running order: the variants in order in even rounds, reversed
    in odd ones."""
    order = []
    for r in range(rounds):
        turn = names if r % 2 == 0 else names[::-1]
        order += [(r, i, name) for i, name in enumerate(turn)]
    return order


def summarise(rows: list[dict], names: list[str]) -> list[dict]:
    """Per (setting, context, batch) and variant: ms/token per round, median, and the ratio to the
    first variant within each round (median, min, max). Rows missing a round are left out of its ratio."""
    keyed: dict[tuple, dict[str, dict[int, float]]] = {}
    for r in rows:
        if "generate_ms" not in r:
            continue
        key = (r["setting"], r["context"], r["batch"])
        keyed.setdefault(key, {}).setdefault(r["variant"], {})[r["round"]] = r["generate_ms"]
    table = []
    base = names[0]
    for key, by_variant in keyed.items():
        for name in names:
            ms = by_variant.get(name, {})
            if not ms:
                continue
            ratios = [ms[k] / by_variant[base][k] for k in ms if k in by_variant.get(base, {})]
            table.append({
                "setting": key[0], "context": key[1], "batch": key[2], "variant": name,
                "ms_per_round": [round(ms[k], 4) for k in sorted(ms)], "ms_median": statistics.median(ms.values()),
                "vs_base_median": statistics.median(ratios) if ratios else None,
                "vs_base_min": min(ratios) if ratios else None, "vs_base_max": max(ratios) if ratios else None,
            })
    return table


def write_table(out: Path, meta: dict, table: list[dict]) -> None:
    lines = [f"# A/B of launch settings, `Decoder.generate` — {meta['gpu']}, {meta['date']}", "",
             f"{meta['rounds']} rounds, order alternating ({' | '.join(' '.join(o) for o in meta['orders'])}); "
             f"baseline `{meta['variants'][0]['name']}`. Variants: "
             + "; ".join(f"`{v['name']}` = {', '.join(v['settings']) or 'the defaults'}" for v in meta["variants"]), "",
             "| setting | context | batch | variant | ms/token per round | median | × baseline (median, range) |",
             "|---|---:|---:|---|---|---:|---|"]
    for t in table:
        ratio = "" if t["vs_base_median"] is None else (
            f"{t['vs_base_median']:.3f} ({t['vs_base_min']:.3f}–{t['vs_base_max']:.3f})")
        lines.append(f"| {t['setting']} | {t['context']} | {t['batch']} | {t['variant']} | "
                     f"{', '.join(f'{m:.3f}' for m in t['ms_per_round'])} | {t['ms_median']:.3f} | {ratio} |")
    (out / "ab.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--generate", required=True, help="setting@context[xB] items (the sweep's --generate)")
    p.add_argument("--variant", action="append", required=True, metavar="NAME=KERNEL.FIELD=VALUE,...",
                   help="a variant (repeatable, two at least; the first is the baseline)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of every variant (the order alternates)")
    p.add_argument("--out", default="benchmarks/results/ab")
    p.add_argument("--dynamic-capacity", action="store_true", help="the sweep's --dynamic-capacity")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--tiny", action="store_true", help="a toy model (smoke tests)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per process")
    args = p.parse_args(argv)
    try:
        variants = [parse_variant(v) for v in args.variant]
    except ValueError as err:
        p.error(f"--variant: {err}")
    names = [name for name, _ in variants]
    if len(names) < 2 or len(set(names)) != len(names):
        p.error(f"--variant: two or more variants with distinct names, got {names}")
    if args.rounds < 1:
        p.error(f"--rounds must be 1 or more, got {args.rounds}")
    settings = dict(variants)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    order = schedule(names, args.rounds)
    gpu = torch.cuda.get_device_name() if common.DEVICE == "cuda" else "cpu (smoke test)"
    meta = {"gpu": gpu, "date": time.strftime("%Y-%m-%d"), "source": common.source_digest(),
            "rounds": args.rounds, "variants": [{"name": n, "settings": s} for n, s in variants],
            "orders": [[name for r2, _, name in order if r2 == r] for r in range(args.rounds)],
            "generate": args.generate}
    rows: list[dict] = []
    for r, position, name in order:
        label = f"{name}-round{r}"
        cmd = [sys.executable, "-m", "benchmarks.sweep", "--only", "generate", "--generate", args.generate,
               "--new-tokens", str(args.new_tokens), "--model", args.model, "--backend", args.backend,
               "--out", str(out / label)]
        cmd += ["--dynamic-capacity"] * args.dynamic_capacity + ["--tiny"] * args.tiny
        cmd += ["--layers", str(args.layers)] if args.layers else []
        for setting in settings[name]:
            cmd += [] if setting.startswith(ENV) else ["--override", setting]
        print(f"ab round {r} position {position}: {name}", flush=True)
        started = time.perf_counter()
        with open(out / f"{label}.log", "w") as log:
            res = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout,
                                 env=environment(settings[name]))
        record = {"variant": name, "round": r, "position": position, "seconds": time.perf_counter() - started}
        if res.returncode != 0:
            rows.append({**record, "error": f"exit {res.returncode}: see {label}.log"})
            continue
        sweep = json.loads((out / label / "sweep.json").read_text())
        for row in sweep["rows"]:
            if row.get("section") == "generate":
                rows.append({**record, **row})
    table = summarise(rows, names)
    (out / "ab.json").write_text(json.dumps({"meta": meta, "rows": rows, "table": table}, indent=1))
    write_table(out, meta, table)
    for t in table:
        ratio = "" if t["vs_base_median"] is None else f" × baseline {t['vs_base_median']:.3f}"
        print(f"ab {t['setting']}@{t['context']}x{t['batch']} {t['variant']:<12} {t['ms_median']:8.3f} ms/token{ratio}",
              flush=True)
    return rows


if __name__ == "__main__":
    main()

"""`policyzoo eval` on the command line: its arguments (`add_parser`) and `cmd_eval`, which builds the
tasks, runs the grid and writes ``results.json``, ``results.md`` and the plots."""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from .. import assets
from ..argtypes import positive_int
from .data import load_dataset
from .report import format_markdown, plot, versions
from .runner import evaluate
from .settings import make_settings


def parse_length(text: str) -> int:
    """``"1k"`` → 1024, ``"1.5K"`` → 1536, ``"3000"`` → 3000."""
    t = text.strip().lower()
    try:
        value = float(t[:-1]) * 1024 if t.endswith("k") else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad length {text!r} (use tokens or K = 1024 tokens, e.g. 2k)") from None
    if value <= 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"bad length {text!r}: must be a positive whole number of tokens")
    return int(value)


def _lengths_arg(text: str) -> list[int]:
    return [parse_length(t) for t in text.split(",") if t.strip()]


def _tasks_arg(text: str) -> list[str]:
    from .tasks import TASKS

    tasks = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise argparse.ArgumentTypeError(f"unknown task(s) {bad or text!r}; accepted: {', '.join(TASKS)}")
    return tasks


def _spec_arg(parse):
    def convert(text: str) -> str:
        try:
            parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text

    return convert


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``eval`` subcommand to the ``policyzoo`` command line."""
    from ..assets import DEFAULT_MODEL
    from ..spec import KV_POLICIES, PROJ_SPARSIFIERS, parse_kv, parse_proj

    p = sub.add_parser(
        "eval",
        help="quality grid: KV × projection settings on passkey, multi-key and perplexity tasks",
        description=(
            "Run every --kv × --proj setting on the tasks at each length and write results.json, "
            "results.md and PNG plots to --out. Specs: NAME or NAME:PARAMS, e.g. quest:budget=256,page=16, "
            f"attn-topk:0.25, window:sinks=4,window=256, dense; topk:0.5, threshold:0.5,path=FILE, none. "
            f"KV policies: {', '.join(KV_POLICIES)}; projection sparsifiers: {', '.join(PROJ_SPARSIFIERS)}, none."
        ),
    )
    p.add_argument("--kv", nargs="+", default=["dense"], type=_spec_arg(parse_kv), metavar="SPEC", help="KV policy specs (default: dense)")
    p.add_argument("--proj", nargs="+", default=["none"], type=_spec_arg(parse_proj), metavar="SPEC",
                   help="projection specs (default: none); threshold:KEEP without path= is calibrated on the first 4K essay "
                        "tokens first, and says so (the Python API refuses an uncalibrated Threshold)")
    p.add_argument("--tasks", type=_tasks_arg, default=["passkey", "multikey", "ppl"], help="comma-separated: passkey,multikey,ppl (default: all)")
    p.add_argument("--lengths", type=_lengths_arg, default=[1024, 2048], help="comma-separated lengths, K = 1024 (default: 1k,2k)")
    p.add_argument("--placements", type=positive_int, default=3, help="needle depths per length, (i + 0.5) / N (default 3)")
    p.add_argument("--windows", type=positive_int, default=None, help="perplexity windows per length (default: --placements)")
    p.add_argument("--span", type=positive_int, default=64, help="scored tokens per perplexity window (default 64)")
    p.add_argument("--n-keys", type=positive_int, default=4, help="needles per multi-key prompt (default 4)")
    p.add_argument("--batch", type=positive_int, default=8, help="records decoded together (default 8)")
    p.add_argument("--dataset", default=None, help="evaluate a dataset with the task fields instead: a save_to_disk folder or a Hub name[:split]")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model: {DEFAULT_MODEL!r} (embedded), a Hub name or a path")
    p.add_argument("--seed", type=int, default=0, help="task seed (default 0)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_eval)
    return p


def check_positions(model, tokens: int, what: str) -> None:
    from .._compat import check_positions as check

    check(model, tokens, what)


def cmd_eval(args: argparse.Namespace) -> int:
    """``policyzoo eval``: build the tasks, run the grid, write the three outputs."""
    from . import tasks as tasks_mod

    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    settings = make_settings(args.kv, args.proj)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = assets.load_model(args.model)
    if not args.dataset:  # before the tasks are built: a prompt of the longest length alone must fit
        check_positions(model, max(args.lengths), f"--lengths {max(args.lengths)}")
    t_loaded = time.perf_counter()
    if args.dataset:
        data = load_dataset(args.dataset)
    else:
        data = tasks_mod.build(
            tokenizer, args.tasks, args.lengths, args.placements,
            n_keys=args.n_keys, span=args.span, n_windows=args.windows, seed=args.seed,
        )  # fmt: skip
    results = evaluate(model, tokenizer, settings, data, batch_size=args.batch, progress=not args.no_progress)
    wall = time.perf_counter() - t_start
    results["meta"] = {
        "argv": list(sys.argv),
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "model": args.model,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "device": str(next(model.parameters()).device),
        "threads": torch.get_num_threads(),
        "records": len(data),
        "model_load_s": round(t_loaded - t_start, 1),
        "wall_s": round(wall, 1),
    }
    with open(out / "results.json", "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, allow_nan=True)
        f.write("\n")
    title = f"policyzoo eval: {args.model}, seed {args.seed}"
    (out / "results.md").write_text(format_markdown(results, title), encoding="utf-8")
    written = [out / "results.json", out / "results.md"]
    if not args.no_plots:
        try:
            written += plot(results, out)
        except ModuleNotFoundError:
            print("warning: matplotlib is not installed; no plots (pip install matplotlib)", file=sys.stderr)
    print(format_markdown(results))
    print(f"wrote {', '.join(str(p) for p in written)} ({wall:.0f} s)")
    return 0

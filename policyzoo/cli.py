"""The ``policyzoo`` command line.

``policyzoo run`` decodes a passkey prompt (essay haystack, needle at a chosen depth) with the
embedded SmolLM2-135M-Instruct under a handful of KV / projection settings and prints, per setting,
the answer, decode speed, kept KV and projection fractions and the mean dropped attention mass.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from . import _compat
from .argtypes import positive_int

TIMING_NOTE = (
    "tok/s: 1 / median decode-step time (gap between successive generated tokens; prefill excluded)\n"
    "       of a separate un-audited greedy run, eager, batch 1.\n"
    "answer, kv keep / proj keep (kept fractions), δ (mean dropped attention mass): an audited run."
)


# ---------------------------------------------------------------------------------------- run
@dataclass
class Row:
    setting: str
    answer: str
    correct: bool
    tokens_per_s: float
    kv_keep: float
    proj_keep: float
    dropped_mass: float


def default_settings() -> list[tuple[str, Callable[[], tuple[Any, Any]]]]:
    """``(label, make)`` pairs; ``make()`` returns fresh ``(kv, proj)`` policies."""
    from .kv import AttentionTopK, Quest, Window
    from .proj import TopK

    return [
        ("dense", lambda: (None, None)),
        ("Window(sinks=4, window=256)", lambda: (Window(sinks=4, window=256), None)),
        ("AttentionTopK(0.25)", lambda: (AttentionTopK(0.25), None)),
        ("Quest(0.25, page=16)", lambda: (Quest(0.25, page=16), None)),
        ("AttentionTopK(0.25) + TopK(0.5)", lambda: (AttentionTopK(0.25), TopK(0.5))),
    ]


class _StepClock:
    """An HF-protocol streamer that stamps the arrival of every generated token.

    ``Decoder.generate`` calls ``put`` once with the prompt (before prefill) and once per generated
    token; the gaps between generated tokens are decode steps (plus greedy argmax), so the prefill
    is excluded without touching the decoder.
    """

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass

    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]

    def tokens_per_s(self) -> float:
        """``1 / median`` step time (robust to a stray slow step); NaN with fewer than 2 tokens."""
        steps = self.step_times()
        return 1.0 / statistics.median(steps) if steps else math.nan


def run_setting(model: Any, tokenizer: Any, input_ids: torch.Tensor, answer: str, label: str, kv: Any, proj: Any, new_tokens: int,
                progress: bool = False) -> Row:
    """Decode ``input_ids`` with a fresh `Decoder` over ``model``: one audited run, one timed run
    (``progress``: a bar for each, the prefill while it runs, then the tokens)."""
    from .assets import check_answer
    from .decoder import Decoder

    dec = Decoder(model, kv=kv, proj=proj)
    out = dec.generate(input_ids, max_new_tokens=new_tokens, audit=True, progress=progress)
    audit = dec.last_audit
    text = tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True)
    clock = _StepClock()
    timed = dec.generate(input_ids, max_new_tokens=new_tokens, streamer=clock, progress=progress)
    if not torch.equal(timed, out):
        print(f"warning: {label}: the timed run decoded differently from the audited run", file=sys.stderr)
    proj_keep = audit.mean("proj_keep") if proj is not None else 1.0
    return Row(
        setting=label,
        answer=" ".join(text.split()),
        correct=check_answer(text, answer),
        tokens_per_s=clock.tokens_per_s(),
        kv_keep=audit.mean("kv_keep"),
        proj_keep=proj_keep,
        dropped_mass=audit.mean("dropped_mass"),
    )


def format_table(rows: Sequence[Row], title: str = "") -> str:
    """A fixed-width text table of ``rows``."""
    answer_w = max([len("answer")] + [min(len(r.answer), 24) for r in rows])
    setting_w = max([len("setting")] + [len(r.setting) for r in rows])
    head = f"{'setting':<{setting_w}}  {'answer':<{answer_w}}  {'ok':<5}  {'tok/s':>7}  {'kv keep':>7}  {'proj keep':>9}  {'δ':>6}"
    lines = [title] if title else []
    lines += [head, "-" * len(head)]
    for r in rows:
        ans = r.answer if len(r.answer) <= 24 else r.answer[:23] + "…"
        lines.append(
            f"{r.setting:<{setting_w}}  {ans:<{answer_w}}  {'right' if r.correct else 'WRONG':<5}  "
            f"{r.tokens_per_s:>7.1f}  {r.kv_keep:>7.3f}  {r.proj_keep:>9.3f}  {r.dropped_mass:>6.3f}"
        )
    return "\n".join(lines)


def check_output_file(path: str | None, flag: str) -> None:
    """Refuse an output path that cannot be written before any work: a directory, a file in a folder
    that does not exist, or in one without write access."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{flag} {path!r} is a directory: give the path of the file to write")
    folder = target.parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path!r}: no directory {str(folder)!r} to write it in")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ValueError(f"{flag} {path!r}: not writable")


def cmd_run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from .assets import load_model, passkey_prompt

    check_output_file(args.json, "--json")
    torch.manual_seed(args.seed)
    if not args.no_progress:
        print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    load_s = time.perf_counter() - t0
    _compat.check_positions(model, args.tokens + args.new_tokens, f"--tokens ({args.tokens}) + --new-tokens ({args.new_tokens})")
    device = next(model.parameters()).device
    input_ids, answer = passkey_prompt(tokenizer, args.tokens, depth=args.depth, seed=args.seed)
    input_ids = input_ids.to(device)
    if args.new_tokens < len(tokenizer(" " + answer, add_special_tokens=False).input_ids):
        print(f"warning: --new-tokens {args.new_tokens} is too few to spell the {len(answer)}-digit key", file=sys.stderr)
    rows: list[Row] = []
    settings = default_settings()
    if not args.no_progress:
        print(f"model loaded in {load_s:.0f} s; {len(settings)} settings, each an audited and a timed run of the "
              f"{input_ids.shape[1]}-token prompt", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    bar = tqdm(settings, desc="settings", disable=args.no_progress, file=sys.stderr)
    for label, make in bar:
        bar.set_postfix_str(label)
        kv, proj = make()
        rows.append(run_setting(model, tokenizer, input_ids, answer, label, kv, proj, args.new_tokens, progress=not args.no_progress))
    run_s = time.perf_counter() - t0
    title = (
        f"passkey: {args.model}, {input_ids.shape[1]} prompt tokens, depth {args.depth}, key {answer}, "
        f"{args.new_tokens} new tokens, {torch.get_num_threads()} threads on {device}\n{TIMING_NOTE}\n"
    )
    print(format_table(rows, title))
    print(f"(model load {load_s:.1f} s, settings {run_s:.1f} s)")
    if args.json:
        record = {
            "model": args.model,
            "prompt_tokens": int(input_ids.shape[1]),
            "depth": args.depth,
            "seed": args.seed,
            "passkey": answer,
            "new_tokens": args.new_tokens,
            "device": str(device),
            "timing": " ".join(TIMING_NOTE.split()),
            "rows": [asdict(r) for r in rows],
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2, allow_nan=True)
            f.write("\n")
    return 0


# -------------------------------------------------------------------------------------- bytes
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _keep_ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a keep ratio in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a keep ratio in (0, 1], got {value:g}")
    return value


def _contexts(text: str) -> list[int]:
    from .bytes import parse_tokens

    try:
        return [parse_tokens(item) for item in text.split(",")]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def cmd_bytes(args: argparse.Namespace) -> int:
    """``policyzoo bytes``: the byte crossover, step bytes, byte floor and ideal bound of two keep ratios."""
    from .bytes import ByteAccount, format_report, report

    if args.union_keep is not None and args.batch == 1:
        raise ValueError("--union-keep applies with --batch > 1 only")
    if args.batch > 1 and args.rp < 1 and args.union_keep is None:
        raise ValueError("--batch > 1 with --rp < 1 needs --union-keep: the fraction of weight columns the rows keep together")
    acct = ByteAccount.from_config(args.model, dtype=_DTYPES[args.dtype])
    rep = report(acct, args.rp, args.rkv, args.contexts, batch=args.batch, union_keep=args.union_keep,
                 bandwidth=args.bandwidth * 1e12, model=args.model, dtype=args.dtype)  # fmt: skip
    print(json.dumps(rep, indent=2) if args.json else format_report(rep))
    return 0


def _add_bytes_parser(sub: Any) -> None:
    from .bytes import BUILTIN

    p = sub.add_parser(
        "bytes",
        help="byte account: crossover context, step bytes, byte floor and ideal speedup bound",
        description="Bytes a decode step reads with projection keep r_P and KV keep r_KV (policyzoo.bytes; docs/bytes.md, 'Byte "
        "account'): the crossover context in K = 1024 tokens (all seven projections, and feed-forward only), and "
        "per context the step bytes, byte floor and ideal speedup bound of dense, proj, kv and both.",
    )
    p.add_argument("--model", required=True, help=f"a built-in name ({', '.join(BUILTIN)}) or a config.json path (or its folder)")
    p.add_argument("--rp", type=_keep_ratio, required=True, help="projection keep ratio r_P in (0, 1]")
    p.add_argument("--rkv", type=_keep_ratio, required=True, help="KV keep ratio r_KV in (0, 1]")
    p.add_argument("--contexts", type=_contexts, default=[4096, 32768, 131072], help="comma-separated contexts (default 4k,32k,128k)")
    p.add_argument("--batch", type=positive_int, default=1, help="rows per step (default 1)")
    p.add_argument("--union-keep", type=_keep_ratio, default=None, help="with --batch > 1: fraction of weight columns the rows keep together")
    p.add_argument("--bandwidth", type=_positive_float, default=4.27, help="memory bandwidth in TB/s for the byte floor (default 4.27)")
    p.add_argument("--dtype", choices=list(_DTYPES), default="bf16", help="element type of weights and KV (default bf16)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the text report")
    p.set_defaults(func=cmd_bytes)


def cmd_calibrate(args: argparse.Namespace) -> int:
    """``policyzoo calibrate``: per-projection values from the dense model on the essays, written to a
    safetensors file: `Threshold` thresholds (``--method threshold``, for ``--proj
    threshold:path=FILE``) or fast `TopK` ratios (``--method topk-fast``, for ``--proj
    topk:mode=fast,path=FILE``)."""
    from .assets import essays_text, load_model
    from .proj import Threshold, TopK

    check_output_file(args.out, "--out")
    if args.method == "prhs":
        check_output_file(str(Path(args.out).with_suffix(".json")), "--out (its .json measurements)")
        return _calibrate_prhs(args)
    prhs_only = [flag for flag, value, default in (("--kv", args.kv, None), ("--steps", args.steps, 32), ("--eps", args.eps, None),
                                                   ("--axes", args.axes, "time,depth,layer")) if value != default]
    if prhs_only:
        raise ValueError(f"{', '.join(prhs_only)} apply to --method prhs only; --method {args.method} calibrates projections "
                         "on the dense model")  # fmt: skip
    targets = tuple(t for t in args.targets.split(",") if t)
    # Built first: keep and targets are checked before the model loads.
    if args.method == "threshold":
        sparsifier, values, spec = Threshold(args.keep, targets=targets), "thresholds", "threshold:path="
    else:
        sparsifier, values, spec = TopK(args.keep, targets=targets, mode="fast"), "ratios", "topk:mode=fast,path="
    model, tokenizer = load_model(args.model)
    device = next(model.parameters()).device
    ids = tokenizer(essays_text(), return_tensors="pt").input_ids[0]
    chunks = [ids[i : i + args.tokens] for i in range(0, args.texts * args.tokens, args.tokens)]
    chunks = [c.to(device) for c in chunks if len(c) == args.tokens]
    if not chunks:
        raise ValueError(f"the essays hold {len(ids)} tokens: fewer than one text of --tokens {args.tokens}")
    sparsifier.calibrate(model, chunks, max_tokens=args.tokens, progress=not args.no_progress)
    path = sparsifier.save(args.out)
    found = torch.tensor(list(getattr(sparsifier, values).values()))
    print(f"{len(found)} {values} (keep {args.keep}, {len(chunks)} texts of {args.tokens} tokens; "
          f"median {found.median():.4g}, range {found.min():.4g}..{found.max():.4g}) -> {path}\n"
          f"use them with: --proj {spec}{path}")  # fmt: skip
    return 0


def _calibrate_prhs(args: argparse.Namespace) -> int:
    """``policyzoo calibrate --method prhs``: `PrHS`'s schedule, layer groups and τ for ``--kv`` on
    the essays, to a safetensors file (and its measurements to a JSON file beside it)."""
    from .assets import essays_text, load_model
    from .decoder import Decoder
    from .kv import PrHS
    from .spec import parse_kv

    policy = parse_kv(args.kv or "quest:0.1")  # checked before the model loads
    axes = tuple(a for a in args.axes.split(",") if a)
    model, tokenizer = load_model(args.model)
    ids = tokenizer(essays_text(), return_tensors="pt").input_ids[0]
    span = args.tokens + args.steps
    texts = [ids[i : i + span] for i in range(0, args.texts * span, span)]
    texts = [t for t in texts if len(t) == span]
    if not texts:
        raise ValueError(f"the essays hold {len(ids)} tokens: fewer than one text of --tokens + --steps = {span}")
    prhs, report = PrHS.calibrate(Decoder(model, kv=policy), texts, eps=args.eps, context=args.tokens, steps=args.steps,
                                  axes=axes, progress=not args.no_progress)  # fmt: skip
    path = prhs.save(args.out)
    side = Path(args.out).with_suffix(".json")
    side.write_text(json.dumps(report, indent=1) + "\n")
    groups = len(set(prhs.layer)) if prhs.layer else report["layers"]
    print(f"PrHS around {args.kv} ({len(texts)} texts, {args.tokens} + {args.steps} tokens): "
          f"tau {prhs.time}, {groups} layer groups of {report['layers']} layers"
          f"{', depth scales ' + format(min(prhs.depth.scale), '.2f') + '..' + format(max(prhs.depth.scale), '.2f') if prhs.depth else ''}"
          f" -> {path} (measurements: {side})\nuse it with: --kv prhs:path={path}")  # fmt: skip
    return 0


def _add_calibrate_parser(sub: Any) -> None:
    from .assets import DEFAULT_MODEL
    from .proj.base import ALL_TARGETS

    p = sub.add_parser(
        "calibrate",
        help="calibration on the essays, to a safetensors file: Threshold thresholds, fast-TopK ratios or a PrHS schedule",
        description="Run the dense model over the embedded essays and write per-projection values to --out. "
        "--method threshold: each projection's threshold at the (1 - keep) quantile of its input magnitudes "
        "(Threshold.calibrate), for --proj threshold:path=FILE. --method topk-fast: each projection's ratio of the "
        "k-th largest input magnitude to the mean magnitude, median over tokens (TopK.calibrate), for "
        "--proj topk:mode=fast,path=FILE. --method prhs: PrHS's depth schedule, layer groups and cosine threshold "
        "around the --kv policy, from its selections against dense attention (PrHS.calibrate), for "
        "--kv prhs:path=FILE; the measurements go to FILE with a .json suffix.",
    )
    p.add_argument("--out", required=True, help="the safetensors file to write")
    p.add_argument("--method", choices=["threshold", "topk-fast", "prhs"], default="threshold",
                   help="what to calibrate (default threshold)")  # fmt: skip
    p.add_argument("--kv", default=None, help="with --method prhs: the KV policy PrHS wraps (default quest:0.1)")
    p.add_argument("--steps", type=positive_int, default=32, help="with --method prhs: decode steps per passage (default 32)")
    p.add_argument("--eps", type=_depth, default=None, help="with --method prhs: certify every reuse at this dropped mass")
    p.add_argument("--axes", default="time,depth,layer", help="with --method prhs: the axes to calibrate (default time,depth,layer)")
    p.add_argument("--keep", type=_keep_ratio, default=0.5, help="fraction of inputs to keep, in (0, 1] (default 0.5)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model: {DEFAULT_MODEL!r} (embedded), a Hub name or a path")
    p.add_argument("--texts", type=positive_int, default=8, help="essay passages to run (default 8)")
    p.add_argument("--tokens", type=positive_int, default=1024, help="tokens per passage (with prhs: its prompt; default 1024)")
    p.add_argument("--targets", default=",".join(ALL_TARGETS), help=f"projections to sparsify (default {','.join(ALL_TARGETS)})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_calibrate)


# --------------------------------------------------------------------------------- argparse
def _depth(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .assets import DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="policyzoo", description="Sparse decoding policies for Hugging Face causal LMs.")
    parser.add_argument("--version", action="version", version=f"policyzoo {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = sub.add_parser(
        "run",
        help="passkey demo: dense vs sparse settings on the embedded model",
        description="Decode a passkey prompt under several KV / projection settings and print a table.",
    )
    run.add_argument("--model", default=DEFAULT_MODEL, help=f"model: {DEFAULT_MODEL!r} (embedded), a Hub name or a path")
    run.add_argument("--tokens", type=positive_int, default=2048, help="prompt length in tokens (default 2048)")
    run.add_argument("--depth", type=_depth, default=0.5, help="relative depth of the needle in [0, 1] (default 0.5)")
    run.add_argument("--new-tokens", type=positive_int, default=8, help="tokens to generate (default 8)")
    run.add_argument("--seed", type=int, default=0, help="picks the pass key and the haystack (default 0)")
    run.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.set_defaults(func=cmd_run)
    _add_bytes_parser(sub)
    _add_calibrate_parser(sub)
    _add_eval_parser(sub)
    from .eval.show_cli import add_parser as add_show_parser  # `policyzoo show`: a picture of a KV policy
    add_show_parser(sub, check_output_file)
    return parser


def _add_eval_parser(sub: Any) -> None:
    """``policyzoo eval``: the quality grid (its arguments and command are in `policyzoo.eval.cli`)."""
    from .eval.cli import add_parser

    add_parser(sub)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # the reader went away (`policyzoo bytes | head`): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    except (ValueError, ModuleNotFoundError, OSError) as e:  # OSError: an unwritable --out, a missing file
        parser.exit(2, f"policyzoo {args.command}: error: {e}\n")
    return 1  # unreachable


if __name__ == "__main__":
    sys.exit(main())

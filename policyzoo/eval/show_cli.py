"""`policyzoo show` on the command line: its arguments (`add_parser`) and `cmd_show`, which draws the
picture of one KV policy (`eval.show.show`) on a model and writes it to ``--out``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

from ..argtypes import index_list, positive_int
from .show import BOUND_CHOICES, MAX_STEPS, matplotlib_module


def add_parser(sub: Any, check_output: Callable[[str, str], None]) -> argparse.ArgumentParser:
    """Add the ``show`` subcommand to the ``policyzoo`` command line. ``check_output(path, flag)`` refuses
    an ``--out`` that cannot be written (`cli.check_output_file`, handed in: `policyzoo.cli` imports this
    module, so this one cannot import it back)."""
    from ..assets import DEFAULT_MODEL

    p = sub.add_parser(
        "show",
        help="a picture of a KV policy: kept tokens over the dense attention, dropped mass, page bounds",
        description=(
            "Decode a few tokens of a passkey prompt with the --kv policy and draw, for the chosen layers and "
            "heads, the dense attention of each step page by page with the tokens the policy kept outlined; the "
            "dropped attention mass of every layer; and, for page policies, each page's upper bound against its "
            "true best logit. docs/pictures.md says how to read it."
        ),
    )
    p.add_argument("--kv", required=True, metavar="SPEC", help="the KV policy, e.g. quest:0.1 or attn-topk:0.1")
    p.add_argument("--proj", default="none", metavar="SPEC", help="a projection sparsifier, e.g. topk:0.5 (default: none)")
    p.add_argument("--out", required=True, metavar="PATH.png", help="the image to write (its suffix names the format)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model: {DEFAULT_MODEL!r} (embedded), a Hub name or a path")
    p.add_argument("--tokens", type=positive_int, default=1024, help="passkey prompt length in tokens (default 1024)")
    p.add_argument("--layers", type=index_list, default=None, help="comma-separated layers to draw (default: the middle one)")
    p.add_argument("--heads", type=index_list, default=None,
                   help="comma-separated query heads to draw in each layer (default: the first of each KV group, at most 4)")  # fmt: skip
    p.add_argument("--steps", type=positive_int, default=8, help=f"decode steps, a heat map's rows (1..{MAX_STEPS}; default 8)")
    p.add_argument("--bound", choices=BOUND_CHOICES, default="auto",
                   help="page bounds to draw: auto (those the policy's cache keeps), box, sketch or none (default auto)")  # fmt: skip
    p.add_argument("--dpi", type=positive_int, default=90, help="resolution of a raster image (default 90)")
    p.add_argument("--no-progress", action="store_true", help="no messages or progress bar")
    p.set_defaults(func=cmd_show, check_output=check_output)
    return p


def cmd_show(args: argparse.Namespace) -> int:
    """``policyzoo show``: every argument is checked before the model loads, the indices right after."""
    from ..assets import load_model
    from ..spec import parse_kv, parse_proj
    from .show import check_steps, page_bounds, show

    args.check_output(args.out, "--out")
    check_image_suffix(args.out)
    page_bounds(parse_kv(args.kv), args.bound)
    proj = args.proj if parse_proj(args.proj) is not None else None
    check_steps(args.steps)
    say = (lambda text: None) if args.no_progress else (lambda text: print(text, file=sys.stderr, flush=True))
    say(f"loading {args.model} ...")
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    say(f"model loaded in {time.perf_counter() - t0:.0f} s; decoding {args.steps} steps of a {args.tokens}-token passkey prompt")
    fig = show(model, tokenizer, args.kv, proj=proj, n_tokens=args.tokens, layers=args.layers, heads=args.heads, steps=args.steps,
               bound=args.bound, progress=not args.no_progress)  # fmt: skip
    fig.savefig(args.out, dpi=args.dpi)
    print(f"wrote {args.out} ({Path(args.out).stat().st_size / 1024:.0f} KB)")
    return 0


def check_image_suffix(path: str) -> None:
    """A `ValueError` unless ``path`` ends in a suffix matplotlib writes (``.png``, ``.svg``, ``.pdf``, ...)."""
    formats = matplotlib_module("matplotlib.backend_bases").FigureCanvasBase.get_supported_filetypes()
    if Path(path).suffix.lstrip(".").lower() not in formats:
        raise ValueError(f"--out {path!r}: the suffix names no image format; use one of {', '.join('.' + f for f in formats)}")

"""Argument types shared by the ``policyzoo`` subcommands (argparse ``type=`` callables).

Each raises `argparse.ArgumentTypeError`, whose message argparse prints as it is: a bad value is
reported as ``argument --batch: must be a positive integer, got 'x'``, never with a function's name.
"""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """A positive whole number."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def index_list(text: str) -> list[int]:
    """Comma-separated whole numbers >= 0 (layer or head indices): ``"3,14"`` -> ``[3, 14]``."""
    items = [t.strip() for t in text.split(",")]
    if not all(t.isascii() and t.isdigit() for t in items):
        raise argparse.ArgumentTypeError(f"must be comma-separated indices (whole numbers >= 0) such as 3,14, got {text!r}")
    return [int(t) for t in items]

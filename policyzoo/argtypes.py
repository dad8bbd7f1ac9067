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

"""Argument types of the command line: bad values are reported by argument, never by function name."""

from __future__ import annotations

import argparse

import pytest

from policyzoo import cli
from policyzoo.argtypes import positive_int


def test_positive_int_accepts_whole_positive_numbers_only():
    assert positive_int("3") == 3
    for bad in ("0", "-2", "x", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="must be a positive integer"):
            positive_int(bad)


@pytest.mark.parametrize(("argv", "names"), [(["bytes", "--model", "llama-3.1-8b", "--rp", "0.5", "--rkv", "0.5", "--batch", "x"], "--batch"),
                                             (["eval", "--out", "o", "--batch", "two"], "--batch"),
                                             (["run", "--tokens", "many"], "--tokens")])
def test_cli_messages_name_the_argument_not_a_private_function(argv, names, capsys):
    with pytest.raises(SystemExit):
        cli.main(argv)
    err = capsys.readouterr().err
    assert f"argument {names}: must be a positive integer, got" in err and "_positive" not in err and "invalid" not in err

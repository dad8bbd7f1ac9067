"""The recipe's one error type: bad input, reported by `train.main` as a usage error."""

from __future__ import annotations


class UsageError(ValueError):
    """Bad input to the recipe; its message names the option."""

"""Evaluation: audit metrics against dense decoding."""

from .audit import Audit
from .compare import compare
from .metrics import dropped_mass, logits_kl, relative_output_error, top1_agreement

__all__ = ["Audit", "compare", "dropped_mass", "logits_kl", "relative_output_error", "top1_agreement"]

"""Evaluation: audit metrics against dense decoding."""

from .audit import Audit
from .metrics import dropped_mass, logits_kl, relative_output_error, top1_agreement

__all__ = ["Audit", "dropped_mass", "logits_kl", "relative_output_error", "top1_agreement"]

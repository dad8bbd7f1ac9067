"""Evaluation: audit metrics against dense decoding, task datasets and the evaluation harness.

`tasks` builds passkey, multi-key and perplexity records as `datasets.Dataset`; `harness.evaluate`
runs a grid of settings on them (`policyzoo eval` on the command line).
"""

from .audit import Audit
from .compare import compare
from .harness import EvalAudit, Setting, evaluate, make_settings, summarize_audit, topk_mass_recall
from .metrics import dropped_mass, logits_kl, relative_output_error, top1_agreement

__all__ = [
    "Audit",
    "EvalAudit",
    "Setting",
    "compare",
    "dropped_mass",
    "evaluate",
    "logits_kl",
    "make_settings",
    "relative_output_error",
    "summarize_audit",
    "top1_agreement",
    "topk_mass_recall",
]

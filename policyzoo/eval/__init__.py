"""Evaluation: audit metrics against dense decoding, task datasets and the evaluation grid.

`metrics` and `audit` measure a decode against dense attention; `tasks` builds passkey, multi-key
and perplexity records as `datasets.Dataset`; `runner.evaluate` runs a grid of settings
(`settings`) on them, `aggregate` summarises the audits, `report` writes the table and plots, and
`cli` is `policyzoo eval` on the command line.
"""

from .aggregate import summarize_audit
from .audit import Audit, EvalAudit
from .compare import compare
from .metrics import dropped_mass, logits_kl, relative_output_error, top1_agreement, topk_mass_recall
from .runner import evaluate
from .settings import Setting, make_settings

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

"""Aggregation of audits into the reported statistics: per setting, task and length (`Collector`)
or of one `Audit` (`summarize_audit`)."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .audit import Audit

ATTENTION_METRICS = ("dropped_mass", "topk_recall", "output_error", "kv_keep", "certified_bound", "reuse_time", "reuse_layer")


def _flat(records: dict | list) -> dict[int, Tensor]:
    """Per-layer 1-D tensors of every recorded value (steps × rows × heads)."""
    if isinstance(records, list):
        return {0: torch.cat([r.float().flatten() for r in records])} if records else {}
    return {layer: torch.cat([r.float().flatten() for r in rs]) for layer, rs in sorted(records.items()) if rs}


class Collector:
    """Accumulates audits (and retrieval / perplexity outcomes) of one setting, task and length."""

    def __init__(self) -> None:
        self.layers: dict[str, dict[int, list[Tensor]]] = {m: defaultdict(list) for m in ATTENTION_METRICS}
        self.proj_keep: list[Tensor] = []
        self.logits_kl: list[Tensor] = []
        self.top1_agree: list[Tensor] = []
        self.correct: list[bool] = []
        self.nll: list[float] = []
        self.dense_nll: list[float] = []
        self.steps = 0

    def add_audit(self, audit: Audit) -> None:
        for metric in ATTENTION_METRICS:
            for layer, values in _flat(getattr(audit, metric, {})).items():
                self.layers[metric][layer].append(values)
        proj = [r.float().flatten() for rs in audit.proj_keep.values() for r in rs]
        if proj:
            self.proj_keep.append(torch.cat(proj))
        self.logits_kl += [r.float().flatten() for r in audit.logits_kl]
        self.top1_agree += [r.float().flatten() for r in audit.top1_agree]
        self.steps += len(next(iter(audit.dropped_mass.values()), []))

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"steps": self.steps}
        stats = summarize_layers({m: {k: torch.cat(v) for k, v in d.items()} for m, d in self.layers.items()})
        out.update(stats)
        out["proj_keep"] = _mean(torch.cat(self.proj_keep)) if self.proj_keep else 1.0
        out["kl"] = _mean(torch.cat(self.logits_kl)) if self.logits_kl else math.nan
        out["top1"] = _mean(torch.cat(self.top1_agree)) if self.top1_agree else math.nan
        out["kl_steps"] = int(sum(t.numel() for t in self.logits_kl))
        out["accuracy"] = float(np.mean(self.correct)) if self.correct else None
        if self.nll:
            dense, sparse = math.exp(float(np.mean(self.dense_nll))), math.exp(float(np.mean(self.nll)))
            out.update(dense_ppl=dense, ppl=sparse, ppl_increase=sparse - dense, ppl_increase_rel=sparse / dense - 1.0)
        else:
            out.update(dense_ppl=None, ppl=None, ppl_increase=None, ppl_increase_rel=None)
        return out


def summarize_layers(per_layer: dict[str, dict[int, Tensor]]) -> dict[str, Any]:
    """Aggregate per-layer records (``metric -> layer -> values``) into the reported statistics.

    δ: mean, p95, max and the per-layer mean (over steps, rows and KV heads); recall: mean and p5
    (the low tail is the bad one); output error: mean and p95; kv keep: mean; the certified bound
    on δ (page selections only, else NaN): mean and max; the reuse rate per axis (`kv.PrHS`'s
    selections only, else NaN): the share of (step, row, KV head) records that reused a selection.
    """

    def pooled(metric: str) -> Tensor:
        values = [v for _, v in sorted(per_layer.get(metric, {}).items())]
        return torch.cat(values) if values else torch.empty(0)

    delta, recall, err, keep, bound, reuse_time, reuse_layer = (pooled(m) for m in ATTENTION_METRICS)
    layers = per_layer.get("dropped_mass", {})
    return {
        "delta_mean": _mean(delta),
        "delta_p95": _quantile(delta, 0.95),
        "delta_max": float(delta.max()) if delta.numel() else math.nan,
        "delta_per_layer": [_mean(layers[k]) for k in sorted(layers)],
        "recall": _mean(recall),
        "recall_p5": _quantile(recall, 0.05),
        "output_error": _mean(err),
        "output_error_p95": _quantile(err, 0.95),
        "kv_keep": _mean(keep),
        "bound_mean": _mean(bound),
        "bound_max": float(bound.max()) if bound.numel() else math.nan,
        "reuse_time": _mean(reuse_time),
        "reuse_layer": _mean(reuse_layer),
    }


def summarize_audit(audit: Audit) -> dict[str, Any]:
    """The aggregated statistics of one `Audit` (δ mean/p95/max and per layer, recall, output
    error, kept fractions, logits KL, top-1 agreement)."""
    c = Collector()
    c.add_audit(audit)
    s = c.summary()
    return {k: v for k, v in s.items() if k not in ("accuracy", "dense_ppl", "ppl", "ppl_increase", "ppl_increase_rel")}


def _mean(x: Tensor) -> float:
    return float(x.float().mean()) if x.numel() else math.nan


def _quantile(x: Tensor, q: float) -> float:
    return float(np.quantile(x.double().numpy(), q)) if x.numel() else math.nan

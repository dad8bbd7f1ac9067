"""policyzoo.eval.aggregate: the statistics of an audit."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from policyzoo.eval.aggregate import summarize_audit
from policyzoo.eval.audit import Audit


def test_audit_aggregation_on_a_hand_made_audit():
    audit = Audit()
    # two layers, three steps, one row, two KV heads
    audit.dropped_mass[0] += [torch.tensor([[0.0, 0.1]]), torch.tensor([[0.2, 0.3]]), torch.tensor([[0.4, 0.5]])]
    audit.dropped_mass[1] += [torch.tensor([[0.6, 0.7]]), torch.tensor([[0.8, 0.9]]), torch.tensor([[1.0, 0.05]])]
    audit.output_error[0] += [torch.tensor([[0.01, 0.02]])] * 3
    audit.output_error[1] += [torch.tensor([[0.03, 0.04]])] * 3
    audit.logits_kl += [torch.tensor([0.1]), torch.tensor([0.3])]
    audit.top1_agree += [torch.tensor([True]), torch.tensor([False])]
    audit.proj_keep["0.q"] += [torch.tensor([0.5])]
    s = summarize_audit(audit)
    values = np.array([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 0.05])
    assert s["delta_mean"] == pytest.approx(values.mean())
    assert s["delta_p95"] == pytest.approx(np.quantile(values, 0.95))
    assert s["delta_p95"] == pytest.approx(0.9 + 0.45 * 0.1)  # linear interpolation between 0.9 and 1.0
    assert s["delta_max"] == pytest.approx(1.0)
    assert s["delta_per_layer"] == pytest.approx([0.25, (0.6 + 0.7 + 0.8 + 0.9 + 1.0 + 0.05) / 6])
    assert s["output_error"] == pytest.approx(0.025) and s["output_error_p95"] == pytest.approx(0.04 - 0.05 * 0.01 * 1.5, abs=2e-3)
    assert s["kl"] == pytest.approx(0.2) and s["top1"] == 0.5 and s["proj_keep"] == 0.5
    assert s["steps"] == 3 and math.isnan(s["recall"])  # a plain Audit records no recall

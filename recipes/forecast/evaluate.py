"""Evaluation: held-out loss and recall of the teacher's top blocks, and the passkey / perplexity
task evaluation through `policyzoo.eval`."""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from policyzoo.kv.forecast import ForecastHeads

from .examples import Example
from .geometry import DEFAULT_GEOMETRY, Geometry
from .objective import LayerQueries, forecast_loss, student_scores, topk_recall


def recall_ks(topk: int) -> list[int]:
    """The k at which recall is reported: powers of two up to ``--topk-blocks``, and it (the policy
    keeps a handful of blocks at the usual budgets, so the small k matter most)."""
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k < topk]
    return ks + [topk]


@torch.no_grad()
def evaluate_heads(heads: ForecastHeads | None, examples: Sequence[Example], geo: Geometry, topk: int, device: torch.device) -> dict[str, Any]:
    """Held-out loss and recall of the teacher's top blocks by ``heads`` (``None``: by the layers'
    own queries, `oracle_scores`): ``recall_at[k]`` is the mean over (layer, position, group) rows
    with more than k candidates (None if there are none), ``rows_at[k]`` how many; ``recall`` is at
    ``--topk-blocks`` or, when no row has that many candidates (short chunks), at the largest k that
    has rows (``recall_k``)."""
    queries_of = None if heads is None else LayerQueries(heads).to(device).eval()
    ks = recall_ks(topk)
    sums, counts, losses = dict.fromkeys(ks, 0.0), dict.fromkeys(ks, 0), []
    for e in examples:
        if queries_of is None:
            scores = e.oracle
        else:
            q = queries_of(e.inputs.to(device))
            scores = student_scores(q, e.rotary, e.means.to(device), e.counts.to(device), e.scales.to(device), geo).cpu()
        cand = e.candidates[None, :, None, :]
        losses.append(float(forecast_loss(scores, e.teacher, cand, topk)))
        for k in ks:
            s, c = topk_recall(scores, e.teacher, cand, k)
            sums[k] += s
            counts[k] += c
    recall_at = {k: (sums[k] / counts[k] if counts[k] else None) for k in ks}
    defined = [k for k in ks if recall_at[k] is not None]
    head_k = topk if recall_at[topk] is not None else (defined[-1] if defined else None)
    return {
        "loss": sum(losses) / len(losses),
        "recall": recall_at[head_k] if head_k is not None else None,
        "recall_k": head_k,
        "recall_at": {str(k): v for k, v in recall_at.items()},
        "rows_at": {str(k): counts[k] for k in ks},
    }


def task_specs(files: dict[str, Path], keep: float, geo: Geometry = DEFAULT_GEOMETRY) -> dict[str, str]:
    """The evaluated settings' specs by name: dense, and ``Forecast(keep, heads=FILE)`` of the
    geometry ``geo`` (the parameters it changes from Forecast's defaults) for each named file."""
    shape = "".join(f",{k}={v}" for k, v in asdict(geo).items() if v != getattr(DEFAULT_GEOMETRY, k))
    return {"dense": "dense", **{name: f"forecast:{keep},heads={path}{shape}" for name, path in files.items()}}


def task_eval(model: nn.Module, tokenizer: Any, files: dict[str, Path], args: argparse.Namespace,
              geo: Geometry = DEFAULT_GEOMETRY) -> list[dict]:
    """Passkey accuracy and perplexity through the library's harness (`policyzoo.eval`), dense and
    ``Forecast(--eval-keep, heads=FILE)`` of the geometry ``geo`` for each named heads file, on the
    embedded essays."""
    from policyzoo.eval import tasks
    from policyzoo.eval.runner import evaluate
    from policyzoo.eval.settings import make_settings

    specs = task_specs(files, args.eval_keep, geo)
    data = tasks.build(tokenizer, ["passkey", "ppl"], args.eval_lengths, args.placements, seed=args.seed)
    settings = make_settings(list(specs.values()), ["none"])
    names = {s.label: name for s, name in zip(settings, specs)}
    results = evaluate(model, tokenizer, settings, data, progress=not args.no_progress)
    keep = ("n", "accuracy", "ppl", "dense_ppl", "ppl_increase_rel", "delta_mean", "kv_keep", "recall")
    return [{"setting": names[r["setting"]], "spec": r["setting"], "task": r["task"], "length": r["length"], **{k: r.get(k) for k in keep}} for r in results["rows"]]


def format_tasks(rows: Sequence[dict]) -> str:
    """The task results as a small table: one line per setting and length."""

    def num(x: Any, fmt: str) -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)

    table: dict[tuple[str, int], dict] = {}
    for r in rows:
        cell = table.setdefault((r["setting"], r["length"]), {})
        if r["task"] == "passkey":
            cell["passkey"] = r["accuracy"]
        else:
            cell.update(ppl=r["ppl"], dense_ppl=r["dense_ppl"], rel=r["ppl_increase_rel"], keep=r["kv_keep"])
    lines = [f"{'setting':<18} {'length':>6} {'passkey':>8} {'ppl':>8} {'vs dense':>9} {'kv keep':>8}"]
    for (setting, length), c in table.items():
        rel = None if c.get("rel") is None else 100 * c["rel"]
        lines.append(f"{setting:<18} {length:>6} {num(c.get('passkey'), '.2f'):>8} {num(c.get('ppl'), '.3f'):>8} {num(rel, '+.2f') + '%':>9} {num(c.get('keep'), '.3f'):>8}")
    return "\n".join(lines)

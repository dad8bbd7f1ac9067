"""The evaluation harness: a grid of (KV policy × projection sparsifier) settings over task datasets.

For each batch of records (same task and length) the harness computes a **dense reference** once:
the dense prefill (its keys and values are kept as a snapshot) and the dense greedy continuation
(retrieval) or the dense logits of the scored span (perplexity). Each setting then starts from the
snapshot (the prefill is dense for every setting, so it is run once per record, not once per
setting; policies that override `KVSelector.prefill` get their own prefill) and decodes through
its policy:

- **retrieval** (``passkey``, ``multikey``, any record with ``span == 0``): free-running greedy
  decoding of ``len(" " + answer)`` tokens plus one; accuracy by `assets.check_answer`.
- **perplexity** (``ppl``, ``span > 0``): teacher-forced sparse decoding. The window's first
  ``length - span`` tokens are the prefix: all but its last token are prefilled dense, then the
  last prefix token and the span are fed one token at a time through the policy (the TRUE tokens,
  not the model's), so each of the ``span`` scored tokens is predicted by one policy decode step;
  the keys and values of the fed tokens are those the sparse decode computed (as in real sparse
  decoding). Dense perplexity comes from the dense prefill logits of the same windows.

Every decode step is audited (`EvalAudit`: dropped mass δ, top-k mass recall, relative output
error, kept fractions per layer and KV head); logits KL and top-1 agreement are taken against the
dense model's logits on the same token history: every step for perplexity, and for retrieval the
steps whose generated prefix still equals the dense greedy output (where a dense reference exists).

`policyzoo eval` (see `add_parser`) runs the grid from the command line and writes
``results.json``, ``results.md`` and PNG plots.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from .. import _compat, assets
from ..attention import ATTN_IMPLEMENTATION
from ..kv.base import KVSelector
from ..selection import Selection
from .audit import Audit, dense_attention_probs
from .metrics import group_mean, logits_kl, top1_agreement

ATTENTION_METRICS = ("dropped_mass", "topk_recall", "output_error", "kv_keep", "certified_bound")


# ------------------------------------------------------------------------------------ metrics
def topk_mass_recall(p_dense: Tensor, sel: Selection, token_valid: Tensor) -> Tensor:
    """``float32[B, H]``: the dense mass the selection captured over the dense top-k mass.

    ``k`` is the number of real tokens the selection kept for the query head's KV head, so the
    recall is 1 exactly when the policy kept the ``k`` heaviest tokens of every query head of the
    group (the best any selection of that size can do) and is never above 1.
    """
    b, h, n = p_dense.shape
    keep = sel.token_mask(n) & token_valid[:, None, :]  # [B, H_kv, N]
    h_kv = keep.shape[1]
    p = p_dense.float().view(b, h_kv, h // h_kv, n)
    captured = (p * keep[:, :, None, :]).sum(-1)  # [B, H_kv, G]
    k = keep.sum(-1)  # [B, H_kv]
    cum = p.sort(dim=-1, descending=True).values.cumsum(-1)
    idx = (k - 1).clamp(min=0)[:, :, None, None].expand(b, h_kv, h // h_kv, 1)
    best = torch.gather(cum, -1, idx).squeeze(-1)
    best = torch.where(k[:, :, None] > 0, best, torch.zeros_like(best))
    recall = torch.where(best > 0, captured / best.clamp(min=1e-30), torch.ones_like(best))
    return recall.clamp(max=1.0).reshape(b, h)


@dataclass
class EvalAudit(Audit):
    """An `Audit` that also records the top-k mass recall (`topk_mass_recall`) per layer and KV head."""

    topk_recall: dict[int, list[Tensor]] = field(default_factory=lambda: defaultdict(list))

    def record_attention(self, layer, q, cache, sel, out, scale, *args, **kwargs) -> None:  # noqa: ANN001
        super().record_attention(layer, q, cache, sel, out, scale, *args, **kwargs)
        token_valid = cache.token_valid()
        keys = cache.keys[layer]
        p = dense_attention_probs(q, keys, cache.start, cache.length, scale, kwargs.get("attention", "softmax"))
        self.topk_recall[layer].append(group_mean(topk_mass_recall(p, sel, token_valid), keys.shape[1]).cpu())


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
    on δ (page selections only, else NaN): mean and max.
    """

    def pooled(metric: str) -> Tensor:
        values = [v for _, v in sorted(per_layer.get(metric, {}).items())]
        return torch.cat(values) if values else torch.empty(0)

    delta, recall, err, keep, bound = (pooled(m) for m in ATTENTION_METRICS)
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


# ----------------------------------------------------------------------------------- settings
@dataclass
class Setting:
    """One grid point: a KV policy (``None``: dense) and a projection sparsifier (``None``: dense)."""

    label: str
    kv: KVSelector | None
    proj: Any
    kv_spec: str = "dense"
    proj_spec: str = "none"


def make_settings(kv_specs: Sequence[str], proj_specs: Sequence[str]) -> list[Setting]:
    """Every ``kv × proj`` pair of specs (`policyzoo.spec`), in the given order (kv outer)."""
    from ..spec import parse_kv, parse_proj, spec_label

    projs = {spec: parse_proj(spec) for spec in proj_specs}  # one instance per spec (calibrated once)
    settings, seen = [], set()
    for kv_spec in kv_specs:
        for proj_spec in proj_specs:
            label = spec_label(kv_spec, proj_spec)
            if label in seen:
                raise ValueError(f"setting {label!r} appears twice in the grid")
            seen.add(label)
            settings.append(Setting(label, parse_kv(kv_spec), projs[proj_spec], kv_spec, proj_spec))
    return settings


def calibrate_thresholds(model: Any, tokenizer: Any, settings: Iterable[Setting], tokens: int = 4096) -> None:
    """Calibrate every uncalibrated `Threshold` of ``settings`` on the first ``tokens`` essay tokens."""
    from ..proj import Threshold

    todo = [s.proj for s in settings if isinstance(s.proj, Threshold) and not s.proj.thresholds]
    if not todo:
        return
    ids = torch.tensor(tokenizer(assets.essays_text()[: tokens * 6], add_special_tokens=False).input_ids[:tokens])
    chunks = [ids[i : i + 1024] for i in range(0, len(ids), 1024)]
    for proj in todo:
        proj.calibrate(model, chunks)


# ---------------------------------------------------------------------------------- the loop
def _records(data: Any, tokenizer: Any) -> list[dict]:
    """Records from a `datasets.Dataset`, a list of them, or a list of dicts; text prompts
    (``prompt`` or ``text`` without ``input_ids``) are tokenized."""
    if isinstance(data, dict):
        raise TypeError("data must be a datasets.Dataset or a list of records, not a dict")
    parts = data if isinstance(data, (list, tuple)) and data and not isinstance(data[0], dict) else [data]
    out = []
    for part in parts:
        for r in part:
            r = dict(r)
            if r.get("input_ids") is None:
                text = r.get("prompt", r.get("text"))
                if text is None:
                    raise ValueError("each record needs input_ids (or a prompt / text field)")
                r["input_ids"] = tokenizer(text).input_ids
            r["input_ids"] = [int(t) for t in r["input_ids"]]
            r.setdefault("task", "retrieval")
            r["span"] = int(r.get("span") or 0)
            r["length"] = int(r.get("length") or len(r["input_ids"]))
            if r["span"] == 0 and not r.get("answer"):
                raise ValueError(f"a retrieval record (span 0) needs an answer: {r['task']!r}")
            if r["span"] and r["span"] + 1 >= len(r["input_ids"]):
                raise ValueError(f"span {r['span']} leaves no prefix in a window of {len(r['input_ids'])} tokens")
            out.append(r)
    return out


def _batches(records: list[dict], batch_size: int) -> list[list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["task"], r["length"], r["span"]), []).append(r)
    return [g[i : i + batch_size] for g in groups.values() for i in range(0, len(g), batch_size)]


@dataclass
class _Reference:
    """The dense computation of one batch, shared by every setting."""

    prompt: Tensor  # [B, T] left-padded prefill tokens
    start: Tensor  # [B] first real slot per row
    snapshot: list[tuple[Tensor, Tensor]]  # per layer (k, v) [B, H_kv, T, D]
    first_logits: Tensor  # [B, V] the prefill's last logits
    logits: Tensor  # [B, steps, V] dense logits of each decode step (or the span)
    tokens: Tensor  # retrieval: dense greedy tokens [B, new]; ppl: fed tokens [B, span]
    targets: Tensor | None = None  # ppl: the scored tokens [B, span]
    new_tokens: int = 0


def _left_pad(rows: list[Tensor], pad: int) -> tuple[Tensor, Tensor]:
    t = max(r.shape[-1] for r in rows)
    out = torch.full((len(rows), t), pad, dtype=torch.long, device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, t - r.shape[-1] :] = r
    return out, torch.tensor([t - r.shape[-1] for r in rows], device=rows[0].device)


@torch.no_grad()
def _prefill_row(dec: Any, ids: Tensor, keep_logits: int) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
    """Dense prefill of one row ``ids [T]``: the last ``keep_logits`` logits ``[keep, V]`` and the
    keys / values of every layer ``[H_kv, T, D]`` (`Decoder._prefill`, keeping more logits)."""
    t = ids.shape[0]
    start = torch.zeros(1, dtype=torch.long, device=ids.device)
    dec._prepare_cache(1, t, start, t)
    runtime = dec.runtime
    runtime.phase = "prefill"
    try:
        positions = torch.arange(t, device=ids.device)[None]
        out = dec.model(input_ids=ids[None], position_ids=positions, use_cache=False, logits_to_keep=keep_logits)
    finally:
        runtime.phase = "idle"
    cache = runtime.cache
    snap = [(cache.keys[l][0, :, :t].clone(), cache.values[l][0, :, :t].clone()) for l in range(cache.num_layers)]
    return out.logits[0].float(), snap


def _stack_snapshots(snaps: list[list[tuple[Tensor, Tensor]]], t: int) -> list[tuple[Tensor, Tensor]]:
    """Left-pad per-row snapshots into ``[B, H_kv, T, D]`` per layer (padding slots are zeros)."""
    out = []
    for layer in range(len(snaps[0])):
        k0 = snaps[0][layer][0]
        k = k0.new_zeros(len(snaps), k0.shape[0], t, k0.shape[-1])
        v = torch.zeros_like(k)
        for b, snap in enumerate(snaps):
            n = snap[layer][0].shape[1]
            k[b, :, t - n :] = snap[layer][0]
            v[b, :, t - n :] = snap[layer][1]
        out.append((k, v))
    return out


def _new_tokens(tokenizer: Any, answers: Sequence[str]) -> int:
    """Enough tokens to spell every answer after a space, plus one (to see the number end)."""
    return max(len(tokenizer(" " + a, add_special_tokens=False).input_ids) for a in answers) + 1


def _check_window(model: Any, needed: int) -> None:
    window = _compat.sliding_window(model)
    if window is not None and needed > window:
        raise ValueError(f"a context of {needed} tokens exceeds the model's sliding window ({window}); not supported")


@torch.no_grad()
def _reference(model: Any, tokenizer: Any, batch: list[dict], device: torch.device) -> _Reference:
    from ..decoder import Decoder

    dec = Decoder(model)
    span = batch[0]["span"]
    rows = [torch.tensor(r["input_ids"], dtype=torch.long, device=device) for r in batch]
    with _compat.attn_implementation(model, ATTN_IMPLEMENTATION):
        if span:  # perplexity: prefill all but the last token, keep the span's logits
            _check_window(model, max(len(r) for r in rows))
            firsts, snaps, logits = [], [], []
            for r in rows:
                lg, snap = _prefill_row(dec, r[:-1], keep_logits=span)
                prefix = r.shape[0] - span - 1
                snaps.append([(k[:, :prefix], v[:, :prefix]) for k, v in snap])
                logits.append(lg)
                firsts.append(lg[0])  # unused: the first span token is predicted by a decode step
            prompt, start = _left_pad([r[: r.shape[0] - span - 1] for r in rows], 0)
            fed = torch.stack([r[r.shape[0] - span - 1 : -1] for r in rows])
            targets = torch.stack([r[r.shape[0] - span :] for r in rows])
            return _Reference(
                prompt, start, _stack_snapshots(snaps, prompt.shape[1]), torch.stack(firsts),
                torch.stack(logits), fed, targets,
            )  # fmt: skip
        new = _new_tokens(tokenizer, [r["answer"] for r in batch])
        _check_window(model, max(len(r) for r in rows) + new)
        firsts, snaps = [], []
        for r in rows:
            lg, snap = _prefill_row(dec, r, keep_logits=1)
            firsts.append(lg[-1])
            snaps.append(snap)
        prompt, start = _left_pad(rows, 0)
        ref = _Reference(prompt, start, _stack_snapshots(snaps, prompt.shape[1]), torch.stack(firsts), None, None, new_tokens=new)  # type: ignore[arg-type]
        tokens, logits = _decode(dec, ref, teacher=None, audit=None)
        ref.tokens, ref.logits = tokens, torch.stack(logits, 1) if logits else torch.empty(len(rows), 0, 0)
        return ref


def _restore(dec: Any, ref: _Reference, steps: int) -> Tensor:
    """Start ``dec`` from the reference prefill: its snapshot, or a prefill of its own when the
    policy builds state in `KVSelector.prefill`. Returns the prefill's last logits ``[B, V]``."""
    b, t = ref.prompt.shape
    dec._prepare_cache(b, t + steps, ref.start, t)
    policy = dec.runtime.policy
    if type(policy).prefill is not KVSelector.prefill:
        return dec._prefill(ref.prompt, ref.start).float()
    cache = dec.runtime.cache
    for layer, (k, v) in enumerate(ref.snapshot):
        cache.write_prefill(layer, k.to(cache.dtype), v.to(cache.dtype))
    return ref.first_logits


@torch.no_grad()
def _decode(dec: Any, ref: _Reference, teacher: Tensor | None, audit: Audit | None) -> tuple[Tensor, list[Tensor]]:
    """Greedy (``teacher=None``, ``ref.new_tokens`` tokens) or teacher-forced decoding from the
    reference prefill; returns the generated / fed tokens ``[B, n]`` and each step's logits."""
    runtime = dec.runtime
    steps = teacher.shape[1] if teacher is not None else ref.new_tokens - 1
    out, all_logits = [], []
    try:
        with _compat.attn_implementation(dec.model, ATTN_IMPLEMENTATION):
            logits = _restore(dec, ref, steps)
            for i in range(steps + (0 if teacher is not None else 1)):
                token = teacher[:, i] if teacher is not None else logits.argmax(-1)
                out.append(token)
                if i == steps:
                    break
                runtime.phase, runtime.audit = "decode", audit
                logits = dec._decode_step(token[:, None]).float()
                runtime.phase, runtime.audit = "idle", None
                all_logits.append(logits)
    finally:
        runtime.phase, runtime.audit = "idle", None
    return torch.stack(out, 1), all_logits


@torch.no_grad()
def run_setting(model: Any, tokenizer: Any, setting: Setting, batch: list[dict], ref: _Reference, collector: Collector) -> list[dict]:
    """Decode one batch under ``setting`` from the dense reference; add its audit to ``collector``
    and return one result per record."""
    from ..decoder import Decoder

    if hasattr(setting.kv, "reseed"):  # a sampling policy (SSA): each batch's draws do not depend on the grid's order
        setting.kv.reseed(setting.kv.seed)
    dec = Decoder(model, kv=setting.kv, proj=setting.proj)
    audit = EvalAudit()
    span = batch[0]["span"]
    tokens, logits = _decode(dec, ref, teacher=ref.tokens if span else None, audit=audit)
    results = []
    if span:
        lg = torch.stack(logits, 1)  # [B, span, V]
        nll = torch.nn.functional.cross_entropy(lg.transpose(1, 2), ref.targets, reduction="none")  # [B, span]
        dense_nll = torch.nn.functional.cross_entropy(ref.logits.transpose(1, 2), ref.targets, reduction="none")
        for i in range(span):
            audit.logits_kl.append(logits_kl(ref.logits[:, i], lg[:, i]).cpu())
            audit.top1_agree.append(top1_agreement(ref.logits[:, i], lg[:, i]).cpu())
        collector.nll += nll.flatten().tolist()
        collector.dense_nll += dense_nll.flatten().tolist()
        for b, r in enumerate(batch):
            results.append({"nll": float(nll[b].mean()), "dense_nll": float(dense_nll[b].mean())})
    else:
        same = torch.ones(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        for i, lg in enumerate(logits):  # step i fed token i and predicts token i + 1
            same &= tokens[:, i] == ref.tokens[:, i]
            if bool(same.any()):
                audit.logits_kl.append(logits_kl(ref.logits[:, i][same], lg[same]).cpu())
                audit.top1_agree.append(top1_agreement(ref.logits[:, i][same], lg[same]).cpu())
        for b, r in enumerate(batch):
            text = tokenizer.decode(tokens[b], skip_special_tokens=True)
            ok = assets.check_answer(text, r["answer"])
            collector.correct.append(ok)
            results.append({"output": " ".join(text.split()), "correct": ok})
    collector.add_audit(audit)
    delta = torch.stack([torch.stack(v).float().mean((0, 2)) for v in audit.dropped_mass.values()]).mean(0)  # [B]
    for b, res in enumerate(results):
        res["delta_mean"] = float(delta[b])
    return results


def evaluate(
    model: Any,
    tokenizer: Any,
    settings: Sequence[Setting],
    data: Any,
    *,
    batch_size: int = 8,
    progress: bool = True,
) -> dict[str, Any]:
    """Run every setting on every record of ``data``; returns ``{"rows": [...], "items": [...]}``.

    ``rows`` has one entry per setting × task × length with the aggregated metrics (accuracy or
    perplexity, δ mean / p95 / max and per layer, recall, output error, logits KL, top-1, kept
    fractions); ``items`` one entry per setting × record (retrieval output and correctness, or the
    window's NLL). Records are batched by task and length (``batch_size`` rows, left-padded).
    """
    from tqdm.auto import tqdm

    if not settings:
        raise ValueError("no settings to evaluate")
    device = next(model.parameters()).device
    records = _records(data, tokenizer)
    if not records:
        raise ValueError("the dataset is empty")
    calibrate_thresholds(model, tokenizer, settings)
    batches = _batches(records, batch_size)
    collectors: dict[tuple, Collector] = {}
    items: list[dict] = []
    bar = tqdm(total=len(batches) * (len(settings) + 1), desc="eval", disable=not progress, file=sys.stderr)
    try:
        for batch in batches:
            task, length = batch[0]["task"], batch[0]["length"]
            bar.set_postfix_str(f"{task} {length} dense reference")
            ref = _reference(model, tokenizer, batch, device)
            bar.update(1)
            for s in settings:
                bar.set_postfix_str(f"{task} {length} {s.label}")
                col = collectors.setdefault((s.label, task, length), Collector())
                for r, res in zip(batch, run_setting(model, tokenizer, s, batch, ref, col)):
                    items.append({"setting": s.label, "task": task, "length": length, "depth": r.get("depth"), "seed": r.get("seed"), "answer": r.get("answer", ""), **res})
                bar.update(1)
            del ref
    finally:
        bar.close()
        from ..proj.base import uninstall

        uninstall(model)
    order = {s.label: i for i, s in enumerate(settings)}
    tasks_order: dict[str, int] = {}
    for r in records:
        tasks_order.setdefault(r["task"], len(tasks_order))
    rows = []
    for (label, task, length), col in sorted(collectors.items(), key=lambda kv: (order[kv[0][0]], tasks_order[kv[0][1]], kv[0][2])):
        n = sum(1 for it in items if it["setting"] == label and it["task"] == task and it["length"] == length)
        rows.append({"setting": label, "task": task, "length": length, "n": n, **col.summary()})
    return {"settings": [_setting_record(s) for s in settings], "rows": rows, "items": items}


def _setting_record(s: Setting) -> dict:
    return {"label": s.label, "kv": s.kv_spec, "proj": s.proj_spec, "kv_policy": repr(s.kv), "proj_policy": repr(s.proj)}


# ------------------------------------------------------------------------------------ outputs
def length_label(n: int) -> str:
    """``1024 -> "1K"``, ``1536 -> "1.5K"``, ``1000 -> "1000"``, ``256 -> "256"``."""
    return f"{n / 1024:g}K" if n >= 1024 and n % 256 == 0 else str(n)


def _fmt(x: Any, spec: str = ".3f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return format(x, spec)


def format_markdown(results: dict[str, Any], title: str = "") -> str:
    """The results table: one row per setting × task × length."""
    head = [
        "setting", "task", "length", "n", "acc", "ppl dense → policy", "Δppl", "δ mean", "δ p95", "δ max",
        "δ bound mean", "recall", "out err", "KL", "top-1", "kv keep", "proj keep",
    ]  # fmt: skip
    align = ["---", "---", "---:"] + ["---:"] * (len(head) - 3)
    lines = [f"# {title}", ""] if title else []
    lines += ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    for r in results["rows"]:
        ppl = f"{r['dense_ppl']:.3f} → {r['ppl']:.3f}" if r.get("ppl") is not None else "—"
        dppl = f"{r['ppl_increase']:+.3f} ({100 * r['ppl_increase_rel']:+.1f}%)" if r.get("ppl") is not None else "—"
        cells = [
            r["setting"], r["task"], length_label(r["length"]), str(r["n"]), _fmt(r.get("accuracy"), ".2f"), ppl, dppl,
            _fmt(r["delta_mean"]), _fmt(r["delta_p95"]), _fmt(r["delta_max"]), _fmt(r.get("bound_mean")), _fmt(r["recall"]),
            _fmt(r["output_error"]), _fmt(r["kl"], ".4f"), _fmt(r["top1"], ".3f"), _fmt(r["kv_keep"]), _fmt(r["proj_keep"]),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], out: Path) -> list[Path]:
    """``accuracy.png`` (accuracy of each retrieval task and the relative perplexity increase vs
    length, a line per setting)
    and ``delta_per_layer.png`` (mean δ per layer, a line per setting, one panel per length)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    labels = [s["label"] for s in results["settings"]]
    kvs = list(dict.fromkeys(s["kv"] for s in results["settings"]))
    projs = list(dict.fromkeys(s["proj"] for s in results["settings"]))
    cmap = plt.get_cmap("tab10")
    style = {
        s["label"]: dict(
            color=cmap(kvs.index(s["kv"]) % 10),
            linestyle=["-", "--", ":", "-."][projs.index(s["proj"]) % 4],
            marker=["o", "s", "^", "x"][projs.index(s["proj"]) % 4],
            markerfacecolor="none" if projs.index(s["proj"]) else None,
        )
        for s in results["settings"]
    }
    # a small horizontal offset per setting keeps equal accuracies from hiding each other
    offset = {label: 0.02 * (i - (len(labels) - 1) / 2) for i, label in enumerate(labels)}
    written = []
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    panels = [(t, "accuracy") for t in tasks if any(r["task"] == t and r["accuracy"] is not None for r in rows)]
    panels += [(t, "ppl_increase_rel") for t in tasks if any(r["task"] == t and r.get("ppl") is not None for r in rows)]
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels) + 2.8, 4.2), squeeze=False)
        for ax, (task, metric) in zip(axes[0], panels):
            scale = 100.0 if metric == "ppl_increase_rel" else 1.0
            for label in labels:
                pts = sorted((r["length"], r[metric]) for r in rows if r["setting"] == label and r["task"] == task)
                if pts:
                    xs = [p[0] / 1024 + offset[label] for p in pts]
                    ax.plot(xs, [scale * p[1] for p in pts], label=label, **style[label])
            ax.set_xticks(sorted({r["length"] / 1024 for r in rows}))
            ax.set_xlabel("length (K tokens)")
            ax.set_ylabel("accuracy" if metric == "accuracy" else "perplexity increase over dense (%)")
            ax.set_title(task)
            if metric == "accuracy":
                ax.set_ylim(-0.05, 1.05)
            ax.grid(alpha=0.3)
        written.append(_save_with_legend(fig, axes, out / "accuracy.png"))
    lengths = sorted({r["length"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5.2 * len(lengths) + 2.8, 4.2), squeeze=False, sharey=True)
    for ax, length in zip(axes[0], lengths):
        for label in labels:
            curves = [r["delta_per_layer"] for r in rows if r["setting"] == label and r["length"] == length and r["delta_per_layer"]]
            if curves:
                ax.plot(range(len(curves[0])), np.mean(np.array(curves), 0), label=label, **{**style[label], "marker": "."})
        ax.set_xlabel("layer")
        ax.set_title(f"mean dropped mass δ per layer, {length_label(length)}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("δ (mean over steps, heads, tasks)")
    written.append(_save_with_legend(fig, axes, out / "delta_per_layer.png"))
    return written


def _save_with_legend(fig: Any, axes: Any, path: Path) -> Path:
    """One legend right of the last panel, then write and close the figure."""
    import matplotlib.pyplot as plt

    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def versions() -> dict[str, str]:
    """Versions of the packages a result depends on."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("policyzoo", "torch", "transformers", "datasets", "numpy"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


# ---------------------------------------------------------------------------------------- CLI
def parse_length(text: str) -> int:
    """``"1k"`` → 1024, ``"1.5K"`` → 1536, ``"3000"`` → 3000."""
    t = text.strip().lower()
    try:
        value = float(t[:-1]) * 1024 if t.endswith("k") else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad length {text!r} (use tokens or K = 1024 tokens, e.g. 2k)") from None
    if value <= 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"bad length {text!r}: must be a positive whole number of tokens")
    return int(value)


def _lengths_arg(text: str) -> list[int]:
    return [parse_length(t) for t in text.split(",") if t.strip()]


def _tasks_arg(text: str) -> list[str]:
    from .tasks import TASKS

    tasks = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise argparse.ArgumentTypeError(f"unknown task(s) {bad or text!r}; accepted: {', '.join(TASKS)}")
    return tasks


def _spec_arg(parse):
    def convert(text: str) -> str:
        try:
            parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text

    return convert


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``eval`` subcommand to the ``policyzoo`` command line."""
    from ..assets import DEFAULT_MODEL
    from ..spec import KV_POLICIES, PROJ_SPARSIFIERS, parse_kv, parse_proj

    p = sub.add_parser(
        "eval",
        help="quality grid: KV × projection settings on passkey, multi-key and perplexity tasks",
        description=(
            "Run every --kv × --proj setting on the tasks at each length and write results.json, "
            "results.md and PNG plots to --out. Specs: NAME or NAME:PARAMS, e.g. quest:budget=256,page=16, "
            f"attn-topk:0.25, window:sinks=4,window=256, dense; topk:0.5, threshold:0.5,path=FILE, none. "
            f"KV policies: {', '.join(KV_POLICIES)}; projection sparsifiers: {', '.join(PROJ_SPARSIFIERS)}, none."
        ),
    )
    p.add_argument("--kv", nargs="+", default=["dense"], type=_spec_arg(parse_kv), metavar="SPEC", help="KV policy specs (default: dense)")
    p.add_argument("--proj", nargs="+", default=["none"], type=_spec_arg(parse_proj), metavar="SPEC", help="projection specs (default: none)")
    p.add_argument("--tasks", type=_tasks_arg, default=["passkey", "multikey", "ppl"], help="comma-separated: passkey,multikey,ppl (default: all)")
    p.add_argument("--lengths", type=_lengths_arg, default=[1024, 2048], help="comma-separated lengths, K = 1024 (default: 1k,2k)")
    p.add_argument("--placements", type=_positive, default=3, help="needle depths per length, (i + 0.5) / N (default 3)")
    p.add_argument("--windows", type=_positive, default=None, help="perplexity windows per length (default: --placements)")
    p.add_argument("--span", type=_positive, default=64, help="scored tokens per perplexity window (default 64)")
    p.add_argument("--n-keys", type=_positive, default=4, help="needles per multi-key prompt (default 4)")
    p.add_argument("--batch", type=_positive, default=8, help="records decoded together (default 8)")
    p.add_argument("--dataset", default=None, help="evaluate a dataset with the task fields instead: a save_to_disk folder or a Hub name[:split]")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model: {DEFAULT_MODEL!r} (embedded), a Hub name or a path")
    p.add_argument("--seed", type=int, default=0, help="task seed (default 0)")
    p.add_argument("--threads", type=_positive, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_eval)
    return p


def _load_dataset(spec: str):
    import datasets

    if Path(spec).exists():
        data = datasets.load_from_disk(spec)
    else:
        name, _, split = spec.partition(":")
        data = datasets.load_dataset(name, split=split or "train")
    if isinstance(data, datasets.DatasetDict):
        data = next(iter(data.values()))
    return data


def cmd_eval(args: argparse.Namespace) -> int:
    """``policyzoo eval``: build the tasks, run the grid, write the three outputs."""
    from . import tasks as tasks_mod

    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    settings = make_settings(args.kv, args.proj)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = assets.load_model(args.model)
    t_loaded = time.perf_counter()
    if args.dataset:
        data = _load_dataset(args.dataset)
    else:
        data = tasks_mod.build(
            tokenizer, args.tasks, args.lengths, args.placements,
            n_keys=args.n_keys, span=args.span, n_windows=args.windows, seed=args.seed,
        )  # fmt: skip
    results = evaluate(model, tokenizer, settings, data, batch_size=args.batch, progress=not args.no_progress)
    wall = time.perf_counter() - t_start
    results["meta"] = {
        "argv": list(sys.argv),
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "model": args.model,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "device": str(next(model.parameters()).device),
        "threads": torch.get_num_threads(),
        "records": len(data),
        "model_load_s": round(t_loaded - t_start, 1),
        "wall_s": round(wall, 1),
    }
    with open(out / "results.json", "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, allow_nan=True)
        f.write("\n")
    title = f"policyzoo eval: {args.model}, seed {args.seed}"
    (out / "results.md").write_text(format_markdown(results, title), encoding="utf-8")
    written = [out / "results.json", out / "results.md"]
    if not args.no_plots:
        try:
            written += plot(results, out)
        except ModuleNotFoundError:
            print("warning: matplotlib is not installed; no plots (pip install matplotlib)", file=sys.stderr)
    print(format_markdown(results))
    print(f"wrote {', '.join(str(p) for p in written)} ({wall:.0f} s)")
    return 0

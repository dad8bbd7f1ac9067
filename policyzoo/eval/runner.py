"""The evaluation runner: a grid of (KV policy × projection sparsifier) settings over task datasets.

For each batch of records (same task and length) the runner computes a **dense reference** once:
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

`policyzoo eval` (`policyzoo.eval.cli`) runs the grid from the command line and writes
``results.json``, ``results.md`` and PNG plots (`policyzoo.eval.report`).
"""

from __future__ import annotations

import math
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from .. import assets
from .aggregate import Collector
from .audit import Audit, EvalAudit
from .data import batch_records, left_pad, new_tokens, stack_snapshots, to_records
from .metrics import logits_kl, top1_agreement
from .settings import Setting, calibrate_thresholds, setting_record


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


# --------------------------------------------------------------------------------- decoding
@torch.no_grad()
def _prefill_row(dec: Any, ids: Tensor, keep_logits: int, snapshot: int | None = None) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
    """Dense prefill of one row ``ids [T]``: the last ``keep_logits`` logits ``[keep, V]`` and the
    keys / values of every layer over the first ``snapshot`` tokens (default all), ``[H_kv, snapshot, D]``.

    A sliding-window layer keeps only a ring of its last slots (`PagedKVCache.windows`): its snapshot
    holds the ring's tokens and zeros before them (`load_prefix` keeps only a window's last tokens).
    When the snapshot stops short of the prompt, the rings hold the prompt's end, not the
    snapshot's: the snapshot's prefix is then prefilled again."""
    t = ids.shape[0]
    n = t if snapshot is None else snapshot
    logits = dec.session.prefill(ids[None], keep_logits=keep_logits)
    if n < t and dec.session.cache.windows:
        dec.session.prefill(ids[None, :n], keep_logits=1)
        t = n
    cache, first = dec.session.cache, dec.session.prompt_slot(t)
    return logits[0].float(), [_layer_snapshot(cache, layer, first, t, n) for layer in range(cache.num_layers)]


def _layer_snapshot(cache: Any, layer: int, first: int, t: int, n: int) -> tuple[Tensor, Tensor]:
    """Row 0's keys and values of slots ``first .. first + n - 1`` of a cache prefilled with ``t >= n``
    tokens from slot ``first``: a window layer's from its ring (the last ring slots of the ``n``,
    zeros before them)."""
    if layer not in cache.windows:
        return cache.keys[layer][0, :, first : first + n].clone(), cache.values[layer][0, :, first : first + n].clone()
    keep = min(n, cache.keys[layer].shape[2])
    k, v = cache.window_tokens(layer, first + n - keep, first + n)
    pad = (0, 0, n - keep, 0)  # zeros before the ring's tokens: out of every later window
    return torch.nn.functional.pad(k[0], pad), torch.nn.functional.pad(v[0], pad)


def _restore(dec: Any, ref: _Reference, steps: int) -> Tensor:
    """Start ``dec`` from the reference prefill: its snapshot, or a prefill of its own when the
    policy builds state there (`DecodeSession.needs_own_prefill`). Returns the prefill's last
    logits ``[B, V]``."""
    b, t = ref.prompt.shape
    session = dec.session
    if session.needs_own_prefill():
        mask = (torch.arange(t, device=ref.prompt.device)[None, :] >= ref.start[:, None]).long()
        return session.prefill(ref.prompt, mask, capacity=t + steps)[:, -1].float()
    session.load_prefix(ref.snapshot, ref.start, capacity=t + steps)
    return ref.first_logits


@torch.no_grad()
def _decode(dec: Any, ref: _Reference, teacher: Tensor | None, audit: Audit | None) -> tuple[Tensor, list[Tensor]]:
    """Greedy (``teacher=None``, ``ref.new_tokens`` tokens) or teacher-forced decoding from the
    reference prefill; returns the generated / fed tokens ``[B, n]`` and each step's logits."""
    steps = teacher.shape[1] if teacher is not None else ref.new_tokens - 1
    out, all_logits = [], []
    logits = _restore(dec, ref, steps)
    with dec.session.audit(audit) if audit is not None else nullcontext():
        for i in range(steps + (0 if teacher is not None else 1)):
            token = teacher[:, i] if teacher is not None else logits.argmax(-1)
            out.append(token)
            if i == steps:
                break
            logits = dec.session.step(token).float()
            all_logits.append(logits)
    return torch.stack(out, 1), all_logits


# ----------------------------------------------------------------------------------- the grid
@torch.no_grad()
def _reference(model: Any, tokenizer: Any, batch: list[dict], device: torch.device) -> _Reference:
    from ..decoder import Decoder

    dec = Decoder(model)
    span = batch[0]["span"]
    rows = [torch.tensor(r["input_ids"], dtype=torch.long, device=device) for r in batch]
    if span:  # perplexity: prefill all but the last token, keep the span's logits
        firsts, snaps, logits = [], [], []
        for r in rows:
            prefix = r.shape[0] - span - 1
            lg, snap = _prefill_row(dec, r[:-1], keep_logits=span, snapshot=prefix)
            snaps.append(snap)
            logits.append(lg)
            firsts.append(lg[0])  # unused: the first span token is predicted by a decode step
        prompt, start = left_pad([r[: r.shape[0] - span - 1] for r in rows], 0)
        fed = torch.stack([r[r.shape[0] - span - 1 : -1] for r in rows])
        targets = torch.stack([r[r.shape[0] - span :] for r in rows])
        return _Reference(
            prompt, start, stack_snapshots(snaps, prompt.shape[1]), torch.stack(firsts),
            torch.stack(logits), fed, targets,
        )  # fmt: skip
    new = new_tokens(tokenizer, [r["answer"] for r in batch])
    firsts, snaps = [], []
    for r in rows:
        lg, snap = _prefill_row(dec, r, keep_logits=1)
        firsts.append(lg[-1])
        snaps.append(snap)
    prompt, start = left_pad(rows, 0)
    ref = _Reference(prompt, start, stack_snapshots(snaps, prompt.shape[1]), torch.stack(firsts), None, None, new_tokens=new)  # type: ignore[arg-type]
    tokens, logits = _decode(dec, ref, teacher=None, audit=None)
    ref.tokens, ref.logits = tokens, torch.stack(logits, 1) if logits else torch.empty(len(rows), 0, 0)
    return ref


@torch.no_grad()
def run_setting(model: Any, tokenizer: Any, setting: Setting, batch: list[dict], ref: _Reference, collector: Collector) -> list[dict]:
    """Decode one batch under ``setting`` from the dense reference; add its audit to ``collector``
    and return one result per record."""
    from ..decoder import Decoder

    if setting.kv is not None:  # a sampling policy (SSA): each batch's draws do not depend on the grid's order
        setting.kv.reset_random()
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
    if audit.dropped_mass:
        delta = torch.stack([torch.stack(v).float().mean((0, 2)) for v in audit.dropped_mass.values()]).mean(0)  # [B]
    else:  # every layer a sliding-window layer at this length: the policy chose nothing; no δ to report
        delta = torch.full((len(results),), math.nan)
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
    records = to_records(data, tokenizer)
    if not records:
        raise ValueError("the dataset is empty")
    from .._compat import check_positions

    longest = max(records, key=lambda r: len(r["input_ids"]) + (0 if r["span"] else new_tokens(tokenizer, [r["answer"]])))
    need = len(longest["input_ids"]) + (0 if longest["span"] else new_tokens(tokenizer, [longest["answer"]]))
    check_positions(model, need, f"the longest record ({longest['task']}, length {longest['length']}) with its answer")
    calibrate_thresholds(model, tokenizer, settings)
    batches = batch_records(records, batch_size)
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
    return {"settings": [setting_record(s) for s in settings], "rows": rows, "items": items}

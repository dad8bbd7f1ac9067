"""Evaluation records: normalising a dataset into records, batching them by task and length,
left padding, stacking per-row prefill snapshots, and loading a dataset from disk or the Hub."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor


def to_records(data: Any, tokenizer: Any) -> list[dict]:
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


def batch_records(records: list[dict], batch_size: int) -> list[list[dict]]:
    """Group records by (task, length, span) and cut each group into batches of ``batch_size``."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["task"], r["length"], r["span"]), []).append(r)
    return [g[i : i + batch_size] for g in groups.values() for i in range(0, len(g), batch_size)]


def left_pad(rows: list[Tensor], pad: int) -> tuple[Tensor, Tensor]:
    """Left-pad 1-D token rows to ``[B, T]`` with ``pad``; also returns each row's first real slot ``[B]``."""
    t = max(r.shape[-1] for r in rows)
    out = torch.full((len(rows), t), pad, dtype=torch.long, device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, t - r.shape[-1] :] = r
    return out, torch.tensor([t - r.shape[-1] for r in rows], device=rows[0].device)


def stack_snapshots(snaps: list[list[tuple[Tensor, Tensor]]], t: int) -> list[tuple[Tensor, Tensor]]:
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


def new_tokens(tokenizer: Any, answers: Sequence[str]) -> int:
    """Enough tokens to spell every answer after a space, plus one (to see the number end)."""
    return max(len(tokenizer(" " + a, add_special_tokens=False).input_ids) for a in answers) + 1


def load_dataset(spec: str) -> Any:
    """A `datasets.Dataset` from a ``save_to_disk`` folder or a Hub ``name[:split]`` (a `DatasetDict`: its first split)."""
    import datasets

    if Path(spec).exists():
        data = datasets.load_from_disk(spec)
    else:
        name, _, split = spec.partition(":")
        data = datasets.load_dataset(name, split=split or "train")
    if isinstance(data, datasets.DatasetDict):
        data = next(iter(data.values()))
    return data

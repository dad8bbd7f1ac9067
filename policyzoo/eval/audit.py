"""`Audit`: on-demand per step / layer / KV-head records of a decode run.

Enabled with ``Decoder.generate(..., audit=True)`` or `policyzoo.eval.compare`; each record is a
small tensor, so an audit costs one extra dense attention pass per layer (the thing it measures
against), never a change to the decode itself.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .. import kernels
from ..cache import PagedKVCache
from ..selection import Selection
from .metrics import dropped_mass, group_mean, relative_output_error


@dataclass
class Audit:
    """Collected metrics. Per-layer lists hold one ``[B, H_kv]`` tensor per decode step."""

    dropped_mass: dict[int, list[Tensor]] = field(default_factory=lambda: defaultdict(list))
    output_error: dict[int, list[Tensor]] = field(default_factory=lambda: defaultdict(list))
    kv_keep: dict[int, list[Tensor]] = field(default_factory=lambda: defaultdict(list))
    proj_keep: dict[str, list[Tensor]] = field(default_factory=lambda: defaultdict(list))
    logits_kl: list[Tensor] = field(default_factory=list)  # per step, [B]
    top1_agree: list[Tensor] = field(default_factory=list)  # per step, [B]

    def record_attention(self, layer: int, q: Tensor, cache: PagedKVCache, sel: Selection, out: Tensor, scale: float) -> None:
        keys, values, token_valid = cache.keys[layer], cache.values[layer], cache.token_valid()
        h_kv = keys.shape[1]
        p = kernels.dense_probs(q, keys, cache.start, cache.length, scale)
        b, h, n = p.shape
        o_dense = torch.einsum("bkgn,bknd->bkgd", p.view(b, h_kv, h // h_kv, n), values.float()).reshape(b, h, -1)
        self.dropped_mass[layer].append(group_mean(dropped_mass(p, sel, token_valid), h_kv).cpu())
        err = relative_output_error(o_dense.view(b, h_kv, -1), out.float().view(b, h_kv, -1))
        self.output_error[layer].append(err.cpu())
        kept = sel.kept_tokens(token_valid)
        self.kv_keep[layer].append((kept / token_valid.sum(-1, keepdim=True).clamp(min=1)).cpu())

    def record_projection(self, name: str, keep: Tensor) -> None:
        self.proj_keep[name].append(keep.float().mean().reshape(1).cpu())

    # ---------------------------------------------------------------------------- summaries
    def per_layer(self, metric: str) -> Tensor:
        """``[layers, steps, B, H_kv]`` stack of one attention metric."""
        records = getattr(self, metric)
        return torch.stack([torch.stack(records[layer]) for layer in sorted(records)])

    def mean(self, metric: str) -> float:
        """Mean of a metric over everything recorded (NaN if nothing was)."""
        records = getattr(self, metric)
        if isinstance(records, list):
            return torch.cat([r.float().flatten() for r in records]).mean().item() if records else float("nan")
        values = [r.float().flatten() for rs in records.values() for r in rs]
        return torch.cat(values).mean().item() if values else float("nan")

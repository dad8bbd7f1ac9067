"""`Audit`: on-demand per step / layer / KV-head records of a decode run.

Enabled with ``Decoder.generate(..., audit=True)`` or `policyzoo.eval.compare`; each record is a
small tensor, so an audit costs one extra dense attention pass per layer (the thing it measures
against), never a change to the decode itself.

The dense reference is the model's own attention: softmax, or 1.5-entmax for an entmax model (the
dropped mass is then the dense entmax probability mass outside the selection).

`EvalAudit` also records the top-k mass recall; the evaluation runner (`policyzoo.eval.runner`) uses it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .. import kernels
from ..attention import entmax15
from ..backend import Attention
from ..cache import PagedKVCache
from ..kv.base import KVState
from ..kv.certified import certified_dropped_mass
from ..selection import REUSE_AXES, Selection
from .metrics import dropped_mass, group_mean, relative_output_error, topk_mass_recall


def dense_attention_probs(
    q: Tensor, keys: Tensor, start: Tensor, length: Tensor, scale: float, attention: Attention = "softmax"
) -> Tensor:
    """``float32[B, H, N]``: dense probabilities of one query token over every visible slot.

    ``"softmax"`` is `kernels.dense_probs`. ``"entmax"`` takes 1.5-entmax of its log: entmax is
    shift invariant and ``log p = z − lse``, so this is entmax of the logits ``z`` (slots whose softmax
    weight underflows lie far outside the entmax support, which is within 2 of the top logit).
    """
    p = kernels.dense_probs(q, keys, start, length, scale)
    if attention == "softmax":
        return p
    if attention == "entmax":
        return entmax15(torch.log(p))
    raise ValueError(f"attention must be 'softmax' or 'entmax', got {attention!r}")


def certified_bound_of(q: Tensor, cache: PagedKVCache, layer: int, sel: Selection, scale: float) -> Tensor:
    """``float32[B, H]``: `certified_dropped_mass` of a page selection, an upper bound of the softmax δ.

    The bound's ``Z_S`` is the *unweighted* normaliser of the selected tokens: for a selection
    without ``log_weight`` it is the ``lse`` the decode kernel already returned (so a policy can report
    the bound with no KV read); the audit recomputes it here, without any ``log_weight`` (SSA's
    Horvitz–Thompson weights make the kernel's lse an estimate of the dense one instead).
    """
    state = KVState(cache, layer, scale)
    bare = Selection(sel.indices, sel.count, block=sel.block)
    _, lse = kernels.decode_attention(q, state.keys, state.values, bare, cache.start, cache.length, scale)
    return certified_dropped_mass(state, q, bare, lse)


@dataclass
class Audit:
    """Collected metrics. Per-layer lists hold one ``[B, H_kv]`` tensor per decode step.

    Per KV head, ``dropped_mass`` is the group mean of the true δ and ``certified_bound`` the group
    mean of its certified upper bound (`certified_bound_of`), so ``certified_bound >= dropped_mass``
    entry by entry. The bound is recorded for selections of softmax models whose cache keeps the key
    min and max (page selections, and the token selections of a two-stage page policy), and nothing
    is recorded otherwise: a token policy's and a dense decode's cache have no page summaries to
    certify with, and the bound is a softmax statement.
    """

    dropped_mass: dict[int, list[Tensor]] = field(default_factory=lambda: defaultdict(list))
    certified_bound: dict[int, list[Tensor]] = field(default_factory=lambda: defaultdict(list))
    output_error: dict[int, list[Tensor]] = field(default_factory=lambda: defaultdict(list))
    kv_keep: dict[int, list[Tensor]] = field(default_factory=lambda: defaultdict(list))
    # Per reuse axis (`selection.REUSE_AXES`), 1.0 where a KV head reused an earlier selection
    # (`Selection.reuse`, set by `kv.PrHS`); recorded for selections that carry the tag.
    reuse_time: dict[int, list[Tensor]] = field(default_factory=lambda: defaultdict(list))
    reuse_layer: dict[int, list[Tensor]] = field(default_factory=lambda: defaultdict(list))
    proj_keep: dict[str, list[Tensor]] = field(default_factory=lambda: defaultdict(list))
    logits_kl: list[Tensor] = field(default_factory=list)  # per step, [B]
    top1_agree: list[Tensor] = field(default_factory=list)  # per step, [B]

    def record_attention(
        self,
        layer: int,
        q: Tensor,
        cache: PagedKVCache,
        sel: Selection,
        out: Tensor,
        scale: float,
        attention: Attention = "softmax",
    ) -> None:
        """Record one decode step of one layer: ``out`` is what the step attended to through ``sel``,
        ``attention`` the model's attention (the dense reference uses the same)."""
        keys, values, token_valid = cache.keys[layer], cache.values[layer], cache.token_valid()
        h_kv = keys.shape[1]
        p = dense_attention_probs(q, keys, cache.start, cache.length, scale, attention)
        b, h, n = p.shape
        o_dense = torch.einsum("bkgn,bknd->bkgd", p.view(b, h_kv, h // h_kv, n), values.float()).reshape(b, h, -1)
        self.dropped_mass[layer].append(group_mean(dropped_mass(p, sel, token_valid), h_kv).cpu())
        # A cache without min/max (a dense decode keeps no summaries) has nothing to certify with.
        certifiable = sel.block in (1, cache.page_size) and cache.keeps("page_min", "page_max")
        if attention == "softmax" and certifiable:
            bound = certified_bound_of(q, cache, layer, sel, scale)
            self.certified_bound[layer].append(group_mean(bound, h_kv).cpu())
        err = relative_output_error(o_dense.view(b, h_kv, -1), out.float().view(b, h_kv, -1))
        self.output_error[layer].append(err.cpu())
        if sel.reuse is not None:
            for code, axis in enumerate(REUSE_AXES, start=1):
                getattr(self, f"reuse_{axis}")[layer].append((sel.reuse == code).float().cpu())
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

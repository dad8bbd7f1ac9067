"""Calibration of `PrHS` (`PrHS.calibrate`): its depth schedule, layer groups and cosine threshold
``τ``, measured on real text with the policy it wraps.

It decodes through a `policyzoo.Decoder` the caller builds around the policy (this package cannot
import the Decoder, which imports it). For each text the model prefills ``context`` tokens and is
then teacher-forced ``steps`` more, the wrapped policy making every selection (uncalibrated: no reuse). At each step and layer, against the
layer's dense softmax ``p``:

- **depth**: the share of the visible tokens that holds ``mass`` of ``p`` (how concentrated the layer
  is), the mass on the last ``w`` tokens for each candidate window ``w``, and the probability of
  the last token the policy's budget would keep (the ``k``-th largest);
- **layer**: for each layer below (up to ``max_group - 1`` of them), how much more mass the layer
  drops through that layer's selection than through its own (δ increase), and how much the two
  selections overlap (Jaccard, per KV head);
- **time**: for each earlier step up to ``max_lag`` back, the cosine of each query head to its query
  then (the group's smallest) and the δ increase of reusing that step's selection, with the tokens
  appended since (as `PrHS` extends it).

From these: each layer's budget scale is its concentration share over the mean (clipped to
``scale_range``, then back to a mean of 1); its window the widest candidate whose recent tokens are
each worth keeping: every ring of candidates up to it (the tokens between one candidate and the
next) carries at least the ``k``-th largest probability per token on average, within half the
layer's budget at the calibration context (and never below the policy's own window); adjacent layers join the lowest layer of their group while the overlap is at least
``min_overlap`` and the mean δ increase at most ``max_increase``; ``τ`` is the smallest cosine
above which reusing costs at most ``max_increase`` of mass on average (``1.0``: reuse only for
identical query directions, when none does).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor
from tqdm.auto import tqdm

from .. import kernels
from ..cache import PagedKVCache
from ..selection import Selection
from .base import Budget, KVSelector

WINDOWS = (16, 32, 64, 128, 256)
TAUS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99, 0.995)


@dataclass
class _Seen:
    """One layer's query and selection at one step, kept for the later steps' time pairs."""

    q: Tensor  # [B, H, D] float32
    mask: Tensor  # bool [B, H_kv, N]
    length: int
    block: int


class _Observer:
    """A `backend.Recorder` that measures what the calibration needs at every (step, layer)."""

    def __init__(self, budget: Budget | None, windows: Sequence[int], mass: float, max_group: int, max_lag: int) -> None:
        self.budget, self.windows, self.mass, self.max_group, self.max_lag = budget, tuple(windows), mass, max_group, max_lag
        self.kth: dict[int, list[float]] = defaultdict(list)  # layer -> probability of the budget's last kept token
        self.need: dict[int, list[float]] = defaultdict(list)  # layer -> share of tokens holding `mass`
        self.recent: dict[int, list[Tensor]] = defaultdict(list)  # layer -> mass on the last w, per window
        self.layer_increase: dict[tuple[int, int], list[Tensor]] = defaultdict(list)  # (below, layer)
        self.layer_overlap: dict[tuple[int, int], list[Tensor]] = defaultdict(list)
        self.time_cos: dict[int, list[Tensor]] = defaultdict(list)  # lag -> group-min cosines
        self.time_increase: dict[int, list[Tensor]] = defaultdict(list)
        self.history: dict[int, list[_Seen]] = defaultdict(list)  # layer -> the last max_lag steps
        self.step_masks: dict[int, Tensor] = {}  # layer -> this step's mask

    def new_text(self) -> None:
        self.history.clear()
        self.step_masks.clear()

    def record_projection(self, name: str, keep: Tensor) -> None:
        pass

    def record_attention(
        self, layer: int, q: Tensor, cache: PagedKVCache, sel: Selection, out: Tensor, scale: float, attention: str = "softmax"
    ) -> None:
        if layer == 0:
            self.step_masks.clear()
        keys, valid = cache.keys[layer], cache.token_valid()
        b, h, _ = q.shape
        h_kv, n = keys.shape[1], keys.shape[2]
        p = kernels.dense_probs(q, keys, cache.start, cache.length, scale).view(b, h_kv, h // h_kv, n)
        length = int(cache.length)
        mask = sel.token_mask(n) & valid[:, None, :]
        own = _dropped(p, mask)

        # depth: concentration and recency
        ordered = p.sort(dim=-1, descending=True).values
        need = (ordered.cumsum(-1) < self.mass).sum(-1).float() + 1  # tokens to reach `mass`
        if self.budget is not None:
            k = self.budget.count(valid.sum(-1)).clamp(1, n)  # [B]
            self.kth[layer].append(float(ordered.gather(-1, (k - 1).view(b, 1, 1, 1).expand(b, h_kv, h // h_kv, 1)).mean()))
        self.need[layer].append(float((need / valid.sum(-1)[:, None, None].clamp(min=1)).mean()))
        slots = torch.arange(n, device=p.device)
        self.recent[layer].append(torch.stack([p[..., slots >= length - w].sum(-1).mean() for w in self.windows]).cpu())

        # layer: this layer through each lower layer's selection of this step
        for below in range(max(0, layer - self.max_group + 1), layer):
            other = self.step_masks.get(below)
            if other is not None:
                self.layer_increase[(below, layer)].append((_dropped(p, other) - own).flatten().cpu())
                self.layer_overlap[(below, layer)].append(_jaccard(other, mask).flatten().cpu())
        self.step_masks[layer] = mask

        # time: each earlier step's selection, extended with what was appended since
        qf = q.float()
        past = self.history[layer]
        for lag, seen in enumerate(reversed(past), start=1):
            first_new = (seen.length - 1) // seen.block * seen.block
            extended = seen.mask | ((slots >= first_new) & valid)[:, None, :]
            cos = torch.nn.functional.cosine_similarity(qf, seen.q, dim=-1).view(b, h_kv, -1).amin(-1)
            self.time_cos[lag].append(cos.flatten().cpu())
            self.time_increase[lag].append((_dropped(p, extended) - own).flatten().cpu())
        past.append(_Seen(qf, mask, length, sel.block))
        del past[: -self.max_lag]


def _window(recent: list[float], windows: Sequence[int], bar: float, least: int, most: float) -> int:
    """The widest of ``windows`` (ascending; ``recent`` their masses) up to ``most`` whose every ring
    up to it holds at least ``bar`` of mass per token, and at least ``least``."""
    chosen, below, mass_below = least, 0, 0.0
    for w, m in zip(windows, recent):
        if w > most or (m - mass_below) / (w - below) < bar:
            break
        chosen, below, mass_below = max(least, w), w, m
    return chosen


def _dropped(p: Tensor, mask: Tensor) -> Tensor:
    """``[B, H_kv]``: the group's mean softmax mass outside ``mask`` (``p [B, H_kv, G, N]``)."""
    return (1.0 - (p * mask[:, :, None, :]).sum(-1)).clamp(min=0).mean(-1)


def _jaccard(a: Tensor, b: Tensor) -> Tensor:
    return (a & b).sum(-1).float() / (a | b).sum(-1).clamp(min=1).float()


def _texts_as_ids(texts: Sequence[str] | Sequence[Tensor], tokenizer: Any, need: int) -> list[Tensor]:
    if len(texts) == 0:
        raise ValueError("texts must hold at least one text")
    ids = []
    for text in texts:
        if isinstance(text, str):
            if tokenizer is None:
                raise ValueError("texts given as strings need a tokenizer")
            text = tokenizer(text, return_tensors="pt").input_ids[0]
        text = torch.as_tensor(text).flatten()
        if len(text) < need:
            raise ValueError(f"a calibration text has {len(text)} tokens; context + steps needs {need}")
        ids.append(text[:need])
    return ids


@dataclass(frozen=True)
class Calibration:
    """What `measure` found: per-layer budget scales and windows (``None`` for an axis not asked
    for), layer group ids, ``τ``, and the measurements behind them (`report`)."""

    scale: tuple[float, ...] | None
    window: tuple[int, ...] | None
    groups: tuple[int, ...]
    tau: float | None
    report: dict[str, Any]


@torch.no_grad()
def measure(
    decoder: Any,
    texts: Sequence[str] | Sequence[Tensor],
    *,
    tokenizer: Any = None,
    context: int = 1024,
    steps: int = 32,
    axes: Sequence[str] = ("time", "depth", "layer"),
    mass: float = 0.9,
    windows: Sequence[int] = WINDOWS,
    scale_range: tuple[float, float] = (0.5, 2.0),
    min_overlap: float = 0.5,
    max_increase: float = 0.01,
    max_group: int = 4,
    max_lag: int = 8,
    progress: bool = True,
) -> Calibration:
    """The axes in ``axes`` measured with ``decoder`` (a `policyzoo.Decoder` around the policy to
    wrap, which makes every selection) on ``texts`` (strings with ``tokenizer``, or token ids; each
    needs ``context + steps`` tokens); module docstring."""
    policy = decoder.kv
    if not isinstance(policy, KVSelector) or getattr(policy, "attention", "softmax") != "softmax":
        raise ValueError(f"calibration needs a decoder with a softmax KV policy to wrap, got {policy!r}")
    unknown = set(axes) - {"time", "depth", "layer"}
    if unknown:
        raise ValueError(f"axes must be among 'time', 'depth', 'layer', got {sorted(unknown)}")
    if not 0.0 < mass <= 1.0 or max_increase < 0:
        raise ValueError(f"mass must be in (0, 1] and max_increase >= 0, got {mass} and {max_increase}")
    if "depth" in axes and not all(hasattr(policy, f) for f in ("budget", "window")):
        raise ValueError(f"the depth axis schedules budget and window: {type(policy).__name__} lacks one")
    ids = _texts_as_ids(texts, tokenizer, context + steps)
    windows = tuple(sorted(windows))
    observer = _Observer(Budget(policy.budget) if hasattr(policy, "budget") else None, windows, mass, max_group, max_lag)
    _observe(decoder, ids, context, steps, observer, progress)
    layers = len(observer.need)
    report: dict[str, Any] = {"texts": len(ids), "context": context, "steps": steps, "layers": layers}
    scale = window = None
    if "depth" in axes:
        scale, window, report["depth"] = _depth_axis(observer, policy, context, windows, scale_range)
    groups: tuple[int, ...] = ()
    if "layer" in axes:
        groups, report["layer"] = _layer_axis(observer, max_group, min_overlap, max_increase)
        if scale is not None:  # a group shares one selection, so one depth entry: its leader's
            for layer in range(1, layers):
                if groups[layer] == groups[layer - 1]:
                    scale[layer], window[layer] = scale[layer - 1], window[layer - 1]
            mean = sum(scale) / len(scale)
            scale = [s / mean for s in scale]
    tau = None
    if "time" in axes:
        tau, report["time"] = _time_axis(observer, max_increase)
    return Calibration(None if scale is None else tuple(scale), None if window is None else tuple(int(w) for w in window),
                       groups, tau, report)  # fmt: skip


def _observe(decoder: Any, ids: Sequence[Tensor], context: int, steps: int, observer: "_Observer", progress: bool) -> None:
    """Decode ``steps`` teacher-forced tokens after the first ``context`` of each text, the
    ``observer`` auditing every step."""
    session = decoder.session
    device = next(decoder.model.parameters()).device
    bar = tqdm(total=len(ids) * steps, desc="calibrating PrHS", unit="step", disable=not progress)
    try:
        for text in ids:
            text = text.to(device)
            observer.new_text()
            session.prefill(text[None, :context], capacity=context + steps)
            with session.audit(observer):
                for i in range(steps):
                    session.step(text[context + i].view(1))
                    bar.update()
    finally:
        bar.close()
        session.release()


def _depth_axis(observer: "_Observer", policy: Any, context: int, windows: tuple[int, ...],
                scale_range: tuple[float, float]) -> tuple[list[float], list[int], dict[str, Any]]:
    """Each layer's budget scale (its need over the mean, clamped) and window, and their report."""
    layers = len(observer.need)
    need = torch.tensor([sum(observer.need[i]) / len(observer.need[i]) for i in range(layers)])
    scale = (need / need.mean()).clamp(*scale_range)
    scale = scale / scale.mean()
    recent = torch.stack([torch.stack(observer.recent[i]).mean(0) for i in range(layers)])  # [L, W]
    kth = [sum(observer.kth[i]) / len(observer.kth[i]) for i in range(layers)]
    tokens = Budget(policy.budget).count(torch.tensor([context])).item()  # the policy's budget at the calibration context
    most = [0.5 * tokens * float(sc) for sc in scale]
    window = [_window(row, windows, bar, policy.window, cap) for row, bar, cap in zip(recent.tolist(), kth, most)]
    report = {"need": need.tolist(), "recent_mass": recent.tolist(), "windows": list(windows), "kth_prob": kth}
    return scale.tolist(), window, report


def _layer_axis(observer: "_Observer", max_group: int, min_overlap: float,
                max_increase: float) -> tuple[tuple[int, ...], dict[str, Any]]:
    """Groups of adjacent layers that share their leader's selection, and their report."""
    increase = {k: float(torch.cat(v).mean()) for k, v in observer.layer_increase.items()}
    overlap = {k: float(torch.cat(v).mean()) for k, v in observer.layer_overlap.items()}
    groups, leader = [0], 0
    for layer in range(1, len(observer.need)):
        fits = layer - leader < max_group and overlap.get((leader, layer), 0.0) >= min_overlap
        if fits and increase.get((leader, layer), math.inf) <= max_increase:
            groups.append(groups[-1])
        else:
            leader = layer
            groups.append(groups[-1] + 1)
    report = {"increase": {f"{a}->{b}": v for (a, b), v in increase.items()},
              "overlap": {f"{a}->{b}": v for (a, b), v in overlap.items()}}  # fmt: skip
    return tuple(groups), report


def _time_axis(observer: "_Observer", max_increase: float) -> tuple[float, dict[str, Any]]:
    """The smallest query-similarity threshold τ whose reuses raise the dropped mass by at most
    ``max_increase`` (1.0: none), and its report."""
    cos = torch.cat([torch.cat(v) for v in observer.time_cos.values()])
    inc = torch.cat([torch.cat(v) for v in observer.time_increase.values()])
    rows = []
    for t in TAUS:
        hit = cos >= t
        rows.append({"tau": t, "share": float(hit.float().mean()),
                     "increase": float(inc[hit].mean()) if hit.any() else math.nan})  # fmt: skip
    ok = [r["tau"] for r in rows if r["share"] > 0 and r["increase"] <= max_increase]
    tau = min(ok) if ok else 1.0
    lag1 = torch.cat(observer.time_cos[1]) if observer.time_cos.get(1) else torch.empty(0)
    return tau, {"tau": tau, "grid": rows, "lag1_share": float((lag1 >= tau).float().mean()) if lag1.numel() else math.nan}

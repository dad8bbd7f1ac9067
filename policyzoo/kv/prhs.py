"""`PrHS`: pre-hoc selection — choose before scoring by reusing selections along time and layers,
with a per-layer budget schedule along depth (after "Near-Oracle KV Selection via Pre-hoc Sparsity";
no public code exists, so the design is this library's).

A wrapped ``policy`` (`Quest`, `AttentionTopK`, `SSA`, `EntmaxKV`, ...) makes every fresh selection.
Three axes, each usable alone:

- **time** (``time=τ``): a layer keeps its previous step's selection, per row and KV head, while
  every query head of the group stays within cosine ``τ`` of the query that made it. The tokens
  appended since are added to it (the step's own token or its page: one entry per step at most),
  and it may hold at most ``extra`` tokens' worth of entries more than the policy would keep now;
  past that the policy selects afresh. (The selections are ``extra`` entries wider than the
  policy's, so the limit depends on the row alone, never on its batchmates' lengths.)
- **depth** (``depth=DepthSchedule``): layer ``l`` runs the policy with ``scale[l]`` times its
  budget and a recency window of ``window[l]`` tokens.
- **layer** (``layer=(group id per layer)``): a layer whose group id equals the layer's below reuses
  the selection the layer below made at this step (the positions; the keys are its own).

**Accuracy control.** With ``eps`` set, every reuse is certified: it happens only where the
certified dropped-mass bound of the reused selection for the current query (`kv.certified`;
``log Z_S`` from the selection's keys, `certify_before_attention`) is at most ``eps`` on every
query head of the group; ``eps=0`` never reuses. Without ``eps`` reuse is governed by ``τ`` and the calibrated layer
groups alone. The page bound behind the certificate overshoots by 10+ nats on real models, so on
those the certificate rarely allows a reuse: the audit reports the reuse rate per axis
(`Selection.reuse`), δ and the bound.

**Static shapes.** Every decision is a per-(row, KV head) mask on the device, so a compiled step
never recompiles or syncs. The fresh selection is therefore computed even where it is not used,
except on a layer that reuses the layer below without ``eps``: that layer skips its policy
entirely, which is where the layer axis saves time.

`PrHS.calibrate` measures the schedule, the layer groups and ``τ`` on text (`kv.prhs_calibration`);
`save` and `load` keep them in a safetensors file (``--kv prhs:path=FILE``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from ..selection import REUSE_AXES, Selection
from .base import KVSelector, KVState, check_count, policy_params, read_policy_file
from .certified import DEFAULT_SLACK, certify_before_attention
from .prhs_calibration import measure
from .wrapper import PolicyWrapper
from .registry import policy_class, register

TIME, LAYER = (1 + REUSE_AXES.index(axis) for axis in ("time", "layer"))


@dataclass(frozen=True)
class DepthSchedule:
    """Per-layer budget multipliers (of the wrapped policy's budget) and recency windows (tokens)."""

    scale: tuple[float, ...]
    window: tuple[int, ...]

    def __post_init__(self) -> None:
        scale, window = tuple(self.scale), tuple(self.window)
        if not scale or len(scale) != len(window):
            raise ValueError(f"a depth schedule needs one scale and one window per layer, got {len(scale)} and {len(window)}")
        if not all(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s > 0 for s in scale):
            raise ValueError(f"depth scales must be finite numbers > 0, got {scale}")
        if not all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in window):
            raise ValueError(f"depth windows must be ints >= 0, got {window}")
        object.__setattr__(self, "scale", tuple(float(s) for s in scale))
        object.__setattr__(self, "window", window)

    def __len__(self) -> int:
        return len(self.scale)


def scaled_budget(budget: int | float, scale: float) -> int | float:
    """``budget`` times ``scale``: a keep ratio stays in (0, 1], a token count stays an int >= 1."""
    if isinstance(budget, float):
        return min(1.0, budget * scale)
    return max(1, round(budget * scale))


@dataclass
class PrHSLayer:
    """`PrHS`'s state of one layer (with ``time``): the query that made the selection the layer
    reuses, ``float32[B, H, D]`` (None before the prefill)."""

    query: Tensor | None = None


@register("prhs")
@dataclass
class PrHS(PolicyWrapper):
    """Reuse selections along time and layers, and schedule budgets along depth (module docstring).

    Args:
        policy: makes every fresh selection.
        eps: certify each reuse: the certified dropped-mass bound must be at most ``eps`` (``None``:
            uncertified reuse). Needs a softmax policy without sampling weights.
        time: ``τ`` in (0, 1]: reuse the previous step's selection while the query's cosine to the
            query that made it is at least ``τ`` (``None``: no reuse along time).
        depth: the per-layer budget and window schedule (``None``: the policy's own everywhere).
        layer: a group id per layer, non-decreasing; a layer in its lower neighbour's group reuses
            that layer's selection (``()``: no sharing).
        extra: with ``time``, the tokens a reused selection may hold beyond the policy's budget of
            the moment (rounded up to whole entries: one page of a page selection by default).
        slack: relative widening of the page bounds in the certificate (float rounding).
    """

    policy: KVSelector
    eps: float | None = None
    time: float | None = None
    depth: DepthSchedule | None = None
    layer: tuple[int, ...] = ()
    extra: int = 16
    slack: float = DEFAULT_SLACK
    _per_layer: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.check_policy()
        if isinstance(self.policy, PrHS):
            raise TypeError("PrHS: policy must be a KV policy, not a PrHS (one PrHS has all three axes)")
        if self.policy.selects_ahead:
            self.refuse("this policy makes each layer's selection one layer ahead, a chain PrHS would break by "
                        "reusing a selection, skipping a layer or re-budgeting it")  # fmt: skip
        if self.eps is not None:
            if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not 0.0 <= self.eps <= 1.0:
                raise ValueError(f"eps must be None or a number in [0, 1], got {self.eps!r}")
            if self.policy.attention != "softmax":
                self.refuse("eps certifies softmax dropped mass: the policy attends with entmax")
            if self.policy.weighted:
                self.refuse(f"eps needs selections without sampling weights (sample={getattr(self.policy, 'sample', '?')!r}); "
                            "use sample=0 or no eps")  # fmt: skip
        if self.time is not None and (isinstance(self.time, bool) or not isinstance(self.time, (int, float))
                                      or not 0.0 < self.time <= 1.0):  # fmt: skip
            raise ValueError(f"time (the cosine τ) must be None or a number in (0, 1], got {self.time!r}")
        if self.depth is not None:
            if not isinstance(self.depth, DepthSchedule):
                raise TypeError(f"depth must be a DepthSchedule, got {type(self.depth).__name__}")
            missing = [f for f in ("budget", "window") if not hasattr(self.policy, f)]
            if missing:
                self.refuse(f"a depth schedule sets the policy's budget and window: {type(self.policy).__name__} has no {missing[0]}")
        self.layer = tuple(self.layer)
        if not all(isinstance(g, int) and not isinstance(g, bool) for g in self.layer):
            raise TypeError(f"layer must be a tuple of int group ids, got {self.layer!r}")
        if any(b < a for a, b in zip(self.layer, self.layer[1:])):
            raise ValueError(f"layer group ids must be non-decreasing (groups of adjacent layers), got {self.layer}")
        if self.depth is not None and self.layer:
            if len(self.layer) != len(self.depth):
                raise ValueError(f"layer has {len(self.layer)} entries, the depth schedule {len(self.depth)}")
            for i in range(1, len(self.layer)):
                same = (self.depth.scale[i], self.depth.window[i]) == (self.depth.scale[i - 1], self.depth.window[i - 1])
                if self.layer[i] == self.layer[i - 1] and not same:
                    raise ValueError(f"layers {i - 1} and {i} share a selection, so their depth entries must be equal")
        check_count(self.extra, "extra", minimum=1)
        if isinstance(self.slack, bool) or not (isinstance(self.slack, (int, float)) and math.isfinite(self.slack) and self.slack >= 0):
            raise ValueError(f"slack must be a finite number >= 0, got {self.slack!r}")

    # ------------------------------------------------------------------ what PrHS adds
    @property
    def own_summaries(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("page_min", "page_max") if self.eps is not None else ()  # the certificate reads them

    @property
    def own_step_context(self) -> tuple[str, ...]:  # type: ignore[override]
        return (("previous",) if self.time is not None else ()) + (("below",) if self.layer else ())

    @property
    def own_prefill(self) -> bool:  # type: ignore[override]
        return self.policy.own_prefill or self.time is not None  # the reference queries are made in prefill

    layer_invariant = False  # its depth schedule and layer groups are per layer

    def policy_at(self, layer: int) -> KVSelector:
        """The wrapped policy as layer ``layer`` runs it (its depth entry applied; learned parts shared)."""
        if self.depth is None:
            return self.policy
        if layer not in self._per_layer:
            scale, window = self.depth.scale[layer], self.depth.window[layer]
            copy = replace(self.policy, budget=scaled_budget(self.policy.budget, scale), window=window)
            for name, module in self.policy.modules().items():
                setattr(copy, name, module)
            self._per_layer[layer] = copy
        return self._per_layer[layer]

    def shares_below(self, layer: int) -> bool:
        """Whether layer ``layer`` reuses the selection of the layer below."""
        return 0 < layer < len(self.layer) and self.layer[layer] == self.layer[layer - 1]

    def predicts_layer(self, layer: int) -> bool:
        return self.eps is None and self.shares_below(layer)  # it reuses the layer below's selection as is

    def next_layer_selection(self, state: KVState, sel: Selection) -> Selection | None:
        return sel if self.predicts_layer(state.layer + 1) else None

    # ------------------------------------------------------------------ life cycle
    def new_layer_state(self) -> PrHSLayer:
        return PrHSLayer()

    def prefill(self, state: KVState, q: Tensor, k: Tensor, v: Tensor) -> None:
        layers = state.cache.num_layers
        for what, n in (("depth schedule", len(self.depth) if self.depth is not None else layers), ("layer", len(self.layer) or layers)):
            if n != layers:
                raise ValueError(f"PrHS's {what} has {n} layers, the model {layers}")
        self.policy_at(state.layer).prefill(state, q, k, v)
        if self.time is not None:
            # The query that made the layer's reusable selection; zero (cosine 0: no reuse) until the
            # first fresh selection. Made here (eager) and written in place, for CUDA graphs.
            made = torch.zeros(q.shape[0], q.shape[1], q.shape[-1], dtype=torch.float32, device=q.device)
            if made.device.type == "cuda":
                torch._dynamo.mark_static_address(made)
            state.layer_state_of(self).query = made

    def finish_prefill(self, states: Sequence[KVState]) -> None:
        by_policy: dict[int, tuple[KVSelector, list[KVState]]] = {}
        for state in states:
            policy = self.policy_at(state.layer)
            by_policy.setdefault(id(policy), (policy, []))[1].append(state)
        for policy, own in by_policy.values():
            policy.finish_prefill(own)

    def append(self, state: KVState, k: Tensor, v: Tensor) -> None:
        self.policy_at(state.layer).append(state, k, v)

    def select(self, state: KVState, q: Tensor) -> Selection:
        context = state.context
        below = context.below
        if self.shares_below(state.layer) and below is not None:
            if self.eps is None:  # uncertified sharing: this layer's policy does not run at all
                return replace(below, reuse=torch.full_like(below.count, LAYER, dtype=torch.int8))
            fresh = self._fresh(state, q)
            return merge(self._certified(state, q, below), below, fresh, LAYER)
        fresh = self._fresh(state, q)
        made = state.layer_state_of(self).query
        if self.time is None or made is None:
            return tagged(fresh)
        if context.previous is None:  # the prefill's selection for the prompt's last token
            made.copy_(q.float())
            return tagged(fresh)
        reused, fits = extend_to_newest(context.previous, state)
        g = q.shape[1] // fresh.count.shape[1]
        cos = torch.nn.functional.cosine_similarity(q.float(), made, dim=-1, eps=1e-12)  # [B, H]
        close = cos.view(cos.shape[0], -1, g).amin(-1) >= self.time
        use = close & fits & (reused.count <= fresh.count + self._extra(fresh))
        if self.eps is not None:
            use = use & self._certified(state, q, reused)
        # The reference query stays that of the selection being reused; a fresh selection's own.
        made.copy_(torch.where(use.repeat_interleave(g, dim=1)[..., None], made, q.float()))
        return merge(use, reused, fresh, TIME)

    def _extra(self, sel: Selection) -> int:
        return -(-self.extra // sel.block)

    def _fresh(self, state: KVState, q: Tensor) -> Selection:
        """The wrapped policy's selection; with ``time``, ``extra`` entries wider (padding), so that a
        reused selection has room to grow by what is appended."""
        sel = self.policy_at(state.layer).select(state, q)
        return widen(sel, self._extra(sel)) if self.time is not None else sel

    def _certified(self, state: KVState, q: Tensor, sel: Selection) -> Tensor:
        """``bool[B, H_kv]``: the certified bound of ``sel`` for ``q`` is at most ``eps`` on every
        query head of the group."""
        bound = certify_before_attention(state, q, sel, self.slack)
        return (bound.view(bound.shape[0], sel.count.shape[1], -1).amax(-1) <= self.eps) & (self.eps > 0)

    # ------------------------------------------------------------------ calibration, files
    @classmethod
    def calibrate(cls, decoder: Any, texts: Sequence[str] | Sequence[Tensor], *, eps: float | None = None,
                  **options: Any) -> tuple["PrHS", dict[str, Any]]:  # fmt: skip
        """``(PrHS, report)``: `PrHS` around ``decoder``'s KV policy (``Decoder(model, kv=policy)``),
        with ``eps``, its depth schedule, layer groups and ``τ`` measured on ``texts`` (`kv.prhs_calibration`:
        ``options`` are `measure`'s, e.g. ``tokenizer``, ``context``, ``steps``, ``axes``); the report
        holds the measurements behind every choice."""
        PrHS(decoder.kv, eps=eps)  # the policy and eps are checked before any decoding
        found = measure(decoder, texts, **options)
        depth = None if found.scale is None else DepthSchedule(found.scale, found.window)
        return cls(decoder.kv, eps=eps, time=found.tau, depth=depth, layer=found.groups), found.report

    def save(self, path: str | Path) -> Path:
        """Write the schedule, the groups and the parameters (the wrapped policy's too, with its
        learned tensors) to a safetensors file that `load` (and ``--kv prhs:path=FILE``) reads."""
        from safetensors.torch import save_file

        tensors = {"layer": torch.tensor(self.layer or [0], dtype=torch.int64), "has_layer": torch.tensor(bool(self.layer))}
        tensors.update({f"policy.{key}": value.detach().contiguous().cpu() for key, value in self.state_dict().items()})
        if self.depth is not None:
            tensors["depth.scale"] = torch.tensor(self.depth.scale, dtype=torch.float64)
            tensors["depth.window"] = torch.tensor(self.depth.window, dtype=torch.int64)
        meta = {
            "policy": type(self).__name__,
            "params": json.dumps({"eps": self.eps, "time": self.time, "slack": self.slack}),
            "wrapped": json.dumps({"class": type(self.policy).__name__, "params": policy_params(self.policy)}),
        }
        save_file(tensors, str(path), metadata=meta)
        return Path(path)

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> "PrHS":
        """A `PrHS` from a file `save` wrote; ``overrides`` replace parameters (``policy``: another
        wrapped policy, ``time``, ``eps``, ...)."""
        meta, tensors = read_policy_file(path, cls.__name__)
        params: dict[str, Any] = json.loads(meta["params"])
        if "policy" not in overrides:
            wrapped = json.loads(meta["wrapped"])
            params["policy"] = policy_class(wrapped["class"])(**wrapped["params"])
            learned = {key[len("policy.") :]: value for key, value in tensors.items() if key.startswith("policy.")}
            if learned:
                params["policy"].load_state_dict(learned)
        if "depth.scale" in tensors:
            params["depth"] = DepthSchedule(tuple(tensors["depth.scale"].tolist()), tuple(tensors["depth.window"].tolist()))
        params["layer"] = tuple(tensors["layer"].tolist()) if bool(tensors["has_layer"]) else ()
        return cls(**{**params, **overrides})


def merge(use: Tensor, reused: Selection, fresh: Selection, axis: int) -> Selection:
    """Per row and KV head, ``reused`` where ``use`` (``bool[B, H_kv]``), else ``fresh``; tagged
    with the reuse ``axis`` code (`Selection.reuse`) where reused."""
    if (reused.indices.shape, reused.block, reused.log_weight is None) != (fresh.indices.shape, fresh.block, fresh.log_weight is None):
        raise ValueError(
            f"a reused selection must have the layout of a fresh one (width, block, weights): got "
            f"{tuple(reused.indices.shape)}/{reused.block} and {tuple(fresh.indices.shape)}/{fresh.block}"
        )
    weight = None if fresh.log_weight is None else torch.where(use[..., None], reused.log_weight, fresh.log_weight)
    return Selection(
        indices=torch.where(use[..., None], reused.indices, fresh.indices),
        count=torch.where(use, reused.count, fresh.count),
        log_weight=weight,
        block=fresh.block,
        reuse=(use.to(torch.int8) * axis),
    )


def extend_to_newest(sel: Selection, state: KVState) -> tuple[Selection, Tensor]:
    """``(selection, fits)``: ``sel`` from an earlier step with the step's own token (its page, for a
    page selection) added where missing, and ``bool[B, H_kv]`` where it fit within ``K_max``.

    Applied at every step of a reuse, so every token appended since the selection was made is in it:
    the recency window the policy forced stays covered."""
    newest = torch.div(state.cache.length - 1, sel.block, rounding_mode="floor").to(sel.indices.dtype)  # 0-dim
    held = ((sel.indices == newest) & sel.entry_valid()).any(-1)
    add = ~held & (sel.count < sel.k_max)
    put = add[..., None] & (torch.arange(sel.k_max, device=held.device) == sel.count[..., None].long())
    weight = None if sel.log_weight is None else sel.log_weight.masked_fill(put, 0.0)
    out = Selection(torch.where(put, newest, sel.indices), sel.count + add.to(sel.count.dtype), weight, sel.block)
    return out, held | add


def widen(sel: Selection, extra: int) -> Selection:
    """``sel`` with ``extra`` padding entries (past ``count``: never read)."""
    pad = sel.indices.new_zeros(*sel.indices.shape[:2], extra)
    weight = None if sel.log_weight is None else torch.cat([sel.log_weight, sel.log_weight.new_zeros(pad.shape)], -1)
    return Selection(torch.cat([sel.indices, pad], -1), sel.count, weight, sel.block, sel.reuse)


def tagged(sel: Selection) -> Selection:
    """``sel`` tagged as made this step (reuse code 0), so the audit counts it in the reuse rates."""
    return replace(sel, reuse=torch.zeros_like(sel.count, dtype=torch.int8))

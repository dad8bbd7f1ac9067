"""`TopK`: keep the ``keep`` fraction of largest-magnitude inputs of each decode token.

Two modes:

- ``"exact"`` (the reference): exactly ``ceil(keep·d_in)`` inputs per token, found by a selection
  launch (`kernels.select_top`) before the sparse GEMV.
- ``"fast"``: no selection launch. Each token's threshold is estimated as ``ratio · mean|x|``, with
  a per-projection ``ratio`` calibrated on real text (`calibrate`: the median over tokens of the
  k-th largest ``|x|`` over ``mean|x|``), and the GEMV keeps ``|x| >= threshold`` inside the kernel.
  The kept fraction is close to ``keep`` on every token but not exact: dividing by ``mean|x|``
  removes the token's scale, not the shape of its distribution. The audit (``proj keep``) reports
  what it was. Unlike `Threshold`, whose fixed thresholds keep more inputs on tokens with larger
  activations, the fast mode keeps about the same fraction of every token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor, nn

from .. import kernels
from ..distributed import concat_over_ranks, is_row_parallel, shard_of, sum_over_ranks
from .base import ALL_TARGETS, ProjectionSparsifier, ProjectionSwitch, check_keep, check_targets, kept_features, topk_mask
from .calibration import DeviceScalars, check_fits, check_values, collect_inputs, read_values, save_values

MODES = ("exact", "fast")
_KIND = "topk-fast"  # the metadata kind of a file of fast-mode ratios


@dataclass
class TopK(ProjectionSparsifier):
    """Activation sparsity at a fixed ratio per token: ``ceil(keep·d_in)`` inputs kept per token and
    projection (``mode="exact"``), or about that many from a calibrated estimate of the threshold
    (``mode="fast"``, ``ratios`` from `calibrate` or `load`)."""

    keep: float = 0.5
    targets: Sequence[str] = ALL_TARGETS
    mode: str = "exact"
    ratios: dict[str, float] = field(default_factory=dict)
    input_only = True  # the kept set is the input's top-k: q/k/v (and gate/up) share it
    shardable = True  # a row-parallel shard is cut at the whole input's threshold (`_shard_threshold`)
    _shard = None  # the tensor-parallel model's `Shard` (set by `install`): not a dataclass field

    @property
    def layer_invariant(self) -> bool:  # type: ignore[override]
        return self.mode == "exact"  # the fast mode's ratios are per projection and layer

    def __post_init__(self) -> None:
        self.keep = check_keep(self.keep)
        self.targets = check_targets(self.targets)
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        check_values(self.ratios, "ratios")
        if self.ratios and self.mode != "fast":
            raise ValueError("ratios are the fast mode's: pass mode='fast'")
        self._device = DeviceScalars(self.ratios, "fast-TopK ratio", "call calibrate() or load() first")

    def install(self, model: nn.Module, switch: ProjectionSwitch, workspace: kernels.Workspace | None = None) -> None:
        check_fits(self.ratios, model, self.targets, "TopK(mode='fast')", "ratios")
        super().install(model, switch, workspace)
        self._shard = shard_of(model)
        if self.mode == "fast":
            self._device.install(next(model.parameters()).device)

    def threshold(self, name: str, x: Tensor) -> Tensor:
        """Fast mode: ``[B, 1]`` fp32 thresholds, ``ratio · mean|x|`` per row of ``x [B, d_in]`` (the
        whole input's mean where ``x`` is a rank's shard of it)."""
        mags = x.abs().float()
        if not is_row_parallel(self._shard, name):
            return self._device.scalar(name, x.device) * mags.mean(-1, keepdim=True)
        total = sum_over_ranks(mags.sum(-1, keepdim=True), self._shard)
        return self._device.scalar(name, x.device) * total / (x.shape[-1] * self._shard.world)

    def keep_mask(self, name: str, x: Tensor) -> Tensor:
        if self.mode == "fast" or is_row_parallel(self._shard, name):
            return x.abs().float() >= self._shard_threshold(name, x)
        return topk_mask(x, self.keep)

    def _shard_threshold(self, name: str, x: Tensor) -> Tensor:
        """``[..., 1]``: the fast mode's threshold, or, on a rank's shard of a row-parallel input, the
        whole input's ``ceil(keep·d_in)``-th largest magnitude (each rank's best that many, gathered)."""
        if self.mode == "fast":
            return self.threshold(name, x)
        mags = x.abs().float()
        k = kept_features(self.keep, x.shape[-1] * self._shard.world)
        best = concat_over_ranks(mags.topk(min(k, mags.shape[-1]), dim=-1).values, self._shard)
        return best.topk(k, dim=-1).values[..., -1:]

    def project(self, name: str, x: Tensor, w_t: Tensor, bias: Tensor | None, *,
                workspace: kernels.Workspace | None = None) -> Tensor:
        if self.mode == "fast" or is_row_parallel(self._shard, name):
            return kernels.sparse_gemv_threshold(x, self._shard_threshold(name, x), w_t, bias, workspace=workspace)
        # The kept features in ascending order (one threshold search, not a sorted top-k), so the
        # GEMV reads the weight rows in memory order.
        k = kept_features(self.keep, x.shape[-1])
        count = torch.full((x.shape[0],), k, dtype=torch.int32, device=x.device)
        idx = kernels.select_top(x, count, k, absolute=True, workspace=workspace)
        if x.shape[0] == 1:
            return kernels.sparse_gemv_index(x, idx, w_t, bias, workspace=workspace)
        # Rows of a batch: one read of each weight row for the union of their kept sets.
        keep = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, idx.long(), True)
        return kernels.sparse_linear(x, w_t.t(), bias, keep, workspace=workspace)

    @torch.no_grad()
    def calibrate(
        self,
        model: nn.Module,
        texts: Sequence[str] | Sequence[Tensor],
        tokenizer=None,
        max_tokens: int = 1024,
        progress: bool = False,
    ) -> "TopK":
        """Fast mode: set each projection's ratio from the dense model's activations on ``texts``
        (strings need ``tokenizer``; each cut to ``max_tokens``), with a progress bar if ``progress``."""
        if self.mode != "fast":
            raise ValueError("only TopK(mode='fast') calibrates: the exact mode needs nothing")
        keep = self.keep
        ratios = collect_inputs(model, texts, self.targets, lambda x: _ratio(x, keep), tokenizer, max_tokens, progress)
        for name, r in ratios.items():
            self.ratios[name] = float(r.median())
        self._device.refresh()  # an installed, compiled step keeps reading the same tensors
        return self

    def save(self, path: str | Path) -> Path:
        """Write the fast mode's ratios and ``keep`` to a safetensors file; returns its path."""
        if not self.ratios:
            raise ValueError("nothing to save: calibrate() first")
        meta = {"kind": _KIND, "keep": repr(self.keep), "targets": ",".join(self.targets)}
        return save_values(path, self.ratios, meta)

    @classmethod
    def load(cls, path: str | Path) -> "TopK":
        """A fast-mode `TopK` from a file `save` wrote."""
        meta, values = read_values(path, _KIND, "TopK", "fast-TopK")
        return cls(keep=float(meta["keep"]), targets=tuple(meta["targets"].split(",")), mode="fast", ratios=values)


def _ratio(x: Tensor, keep: float) -> Tensor:
    """Per token of ``x [T, d]``: its ``ceil(keep·d)``-th largest ``|x|`` over its ``mean|x|``."""
    mags = x.abs().float()
    k = kept_features(keep, mags.shape[-1])
    kth = mags.topk(k, dim=-1).values[:, -1]
    return kth / mags.mean(-1).clamp_min(torch.finfo(torch.float32).tiny)

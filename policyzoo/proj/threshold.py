"""`Threshold`: TEAL-style activation sparsity with per-projection magnitude thresholds.

`calibrate` runs the dense model over real text, collects each target projection's input magnitudes
and sets its threshold at the ``1 − keep`` quantile of ``|x|`` (equivalently the
``0.5 + 0.5·(1 − keep)`` quantile of a symmetric ``x``), so that on similar text about ``keep`` of the
inputs survive. In decode, inputs with ``|x| >= threshold`` are kept; the kept fraction varies per
token, which is the point (and the reason to audit it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor, nn

from .. import kernels
from .base import ALL_TARGETS, ProjectionSparsifier, ProjectionSwitch, check_keep, check_targets, group_segment, shared_groups
from .calibration import DeviceScalars, check_fits, check_values, collect_inputs, read_values, save_values

_SAMPLES_PER_PROJECTION = 1 << 18  # enough for a stable quantile, small enough for any model


@dataclass
class Threshold(ProjectionSparsifier):
    """Keep inputs whose magnitude reaches the calibrated per-projection threshold.

    Projections of one input (q|k|v, gate|up) run as one sparse GEMV over their concatenated
    weights, each output column compared against its own projection's threshold.
    """

    keep: float = 0.5
    targets: Sequence[str] = ALL_TARGETS
    thresholds: dict[str, float] = field(default_factory=dict)

    shardable = True  # calibrated thresholds apply to a rank's shard of an input as to the whole

    def __post_init__(self) -> None:
        self.keep = check_keep(self.keep)
        self.targets = check_targets(self.targets)
        check_values(self.thresholds, "thresholds")
        self._device = DeviceScalars(self.thresholds, "threshold", "call calibrate() or load() first")
        self._groups: list[tuple[tuple[str, ...], tuple[int, ...]]] = []  # (names, sizes) of installed groups

    def threshold(self, name: str, device: torch.device) -> Tensor:
        """Projection ``name``'s threshold as a 0-dim fp32 tensor on ``device``: the one `install`
        made, or (used outside a Decoder) one made now."""
        return self._device.scalar(name, device)

    def install(self, model: nn.Module, switch: ProjectionSwitch, workspace: kernels.Workspace | None = None) -> None:
        """Wrap the projections, then make every calibrated threshold (and each q|k|v or gate|up
        group's per-column thresholds) a device tensor, once; `calibrate` later updates them in place."""
        check_fits(self.thresholds, model, self.targets, "Threshold", "thresholds")
        super().install(model, switch, workspace)
        groups = [(tuple(g.names), tuple(g.sizes)) for g in shared_groups(model, self)]
        self._device.install(next(model.parameters()).device, groups)
        self._groups = groups

    def keep_mask(self, name: str, x: Tensor) -> Tensor:
        return x.abs().float() >= self.threshold(name, x.device)

    def project(self, name: str, x: Tensor, w_t: Tensor, bias: Tensor | None, *,
                workspace: kernels.Workspace | None = None) -> Tensor:
        return kernels.sparse_gemv_threshold(x, self.threshold(name, x.device), w_t, bias, workspace=workspace)

    def project_group(self, names, sizes, x, w_t, bias, *, workspace=None):
        columns = self._device.columns(tuple(names))
        segment = group_segment(sizes)
        if columns is None or columns.device != x.device or segment % 16:
            return None  # each member runs its own GEMV
        return kernels.sparse_gemv_threshold(x, columns, w_t, bias, segment, workspace=workspace)

    @torch.no_grad()
    def calibrate(
        self,
        model: nn.Module,
        texts: Sequence[str] | Sequence[Tensor],
        tokenizer=None,
        max_tokens: int = 1024,
        progress: bool = False,
    ) -> "Threshold":
        """Set thresholds from the dense model's activations on ``texts`` (strings need ``tokenizer``;
        each is cut to ``max_tokens``), with a progress bar over the texts if ``progress``."""
        mags = collect_inputs(model, texts, self.targets, _magnitude_sample, tokenizer, max_tokens, progress)
        g = torch.Generator().manual_seed(0)
        for name, m in mags.items():
            if m.numel() > _SAMPLES_PER_PROJECTION:
                m = m[torch.randperm(m.numel(), generator=g)[:_SAMPLES_PER_PROJECTION]]
            self.thresholds[name] = float(torch.quantile(m, 1.0 - self.keep)) if self.keep < 1 else 0.0
        self._device.refresh()  # an installed, compiled step keeps reading the same tensors
        if self._groups:  # groups installed before their thresholds existed get their columns now
            self._device.install(next(model.parameters()).device, self._groups)
        return self

    def save(self, path: str | Path) -> Path:
        """Write the thresholds (one scalar tensor per projection) and ``keep`` to a safetensors file;
        returns its path."""
        if not self.thresholds:
            raise ValueError("nothing to save: calibrate() first")
        return save_values(path, self.thresholds, {"keep": repr(self.keep), "targets": ",".join(self.targets)})

    @classmethod
    def load(cls, path: str | Path) -> "Threshold":
        meta, values = read_values(path, "threshold", "Threshold", "Threshold")
        return cls(keep=float(meta["keep"]), targets=tuple(meta["targets"].split(",")), thresholds=values)


def _magnitude_sample(x: Tensor) -> Tensor:
    """Up to `_SAMPLES_PER_PROJECTION` of the input magnitudes, evenly strided."""
    x = x.abs().float().flatten()
    return x[:: x.numel() // _SAMPLES_PER_PROJECTION + 1] if x.numel() > _SAMPLES_PER_PROJECTION else x

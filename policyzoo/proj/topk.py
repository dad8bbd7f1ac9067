"""`TopK`: keep exactly the ``keep`` fraction of largest-magnitude inputs of each decode token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from .. import kernels
from .base import ALL_TARGETS, ProjectionSparsifier, check_keep, check_targets, kept_features, topk_mask


@dataclass
class TopK(ProjectionSparsifier):
    """Exact-ratio activation sparsity: ``ceil(keep·d_in)`` inputs kept per token and projection."""

    keep: float = 0.5
    targets: Sequence[str] = ALL_TARGETS
    input_only = True  # the kept set is the input's top-k: q/k/v (and gate/up) share it

    def __post_init__(self) -> None:
        self.keep = check_keep(self.keep)
        self.targets = check_targets(self.targets)

    def keep_mask(self, name: str, x: Tensor) -> Tensor:
        return topk_mask(x, self.keep)

    def project(self, name: str, x: Tensor, w_t: Tensor, bias: Tensor | None) -> Tensor:
        # The kept features in ascending order (one threshold search, not a sorted top-k), so the
        # GEMV reads the weight rows in memory order.
        k = kept_features(self.keep, x.shape[-1])
        count = torch.full((x.shape[0],), k, dtype=torch.int32, device=x.device)
        idx = kernels.select_top(x, count, k, absolute=True)
        return kernels.sparse_gemv_index(x, idx, w_t, bias)

"""The pooled Gaussian entmax threshold (`EntmaxKV`'s τ̂): the op ``policyzoo::gaussian_entmax_threshold``.

Specification: ``reference.py``; kernel: ``kernel.py``. One opaque op, so that `torch.compile` does
not fuse the Newton passes into one reduction over all pages (which Triton 3.6 fails to compile at
8192 pages). Launch parameters: `EntmaxThresholdConfig`, completed per call by
`entmax_threshold_config`.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor

from ...config import LaunchConfig, current, next_power_of_2, powers_of_two
from ...route import HAS_TRITON, need_triton, routed
from . import reference

if HAS_TRITON:
    from . import kernel


@dataclasses.dataclass(frozen=True, kw_only=True)
class EntmaxThresholdConfig(LaunchConfig):
    """Launch parameters of the pooled Gaussian entmax threshold."""

    keyword = "entmax_threshold"

    block_p: int = 1024
    """Pages per block of a pass (registers per thread: block_p / (32·num_warps) pages); a shorter
    row takes one block of next_pow2(P) pages, 32 at least."""
    num_warps: int = 8
    """Warps for a full block; a smaller block takes one per 128 pages (1 at least)."""

    def __post_init__(self) -> None:
        powers_of_two(self, "block_p", "num_warps")


def entmax_threshold_config(p: int) -> EntmaxThresholdConfig:
    """The launch parameters of a call on rows of ``p`` pages: the config in force
    (`config.current`), its block cut to next_pow2(p) pages (32 at least) and its warps to one per
    128 pages of the block (1 at least)."""
    return _choose(current(EntmaxThresholdConfig), p)


@functools.lru_cache(maxsize=1024)  # a launch's Python time: the same few shapes at every decode step
def _choose(cfg: EntmaxThresholdConfig, p: int) -> EntmaxThresholdConfig:
    block = min(cfg.block_p, max(next_power_of_2(p), 32))
    return dataclasses.replace(cfg, block_p=block, num_warps=max(1, min(cfg.num_warps, block // 128)))


@torch.library.custom_op("policyzoo::gaussian_entmax_threshold", mutates_args=())
def _gaussian_entmax_threshold_op(m: Tensor, s: Tensor, n: Tensor, cap: Tensor | None, iters: int = 12) -> Tensor:
    need_triton()
    return kernel.gaussian_entmax_threshold(m, s, n, cap, iters, entmax_threshold_config)


@_gaussian_entmax_threshold_op.register_fake
def _(m, s, n, cap, iters=12):
    shapes = [t.shape for t in (m, s, n, cap) if t is not None]
    return m.new_empty(*torch.broadcast_shapes(*shapes)[:-1], 1, dtype=torch.float64)


@routed(reference.gaussian_entmax_threshold)
def gaussian_entmax_threshold(m: Tensor, s: Tensor, n: Tensor, cap: Tensor | None = None, iters: int = 12) -> Tensor:
    """Entmax threshold of a pool of censored Gaussians along the last dim → ``float64[..., 1]``
    (`EntmaxKV`'s τ̂); see `reference.gaussian_entmax_threshold`."""
    return torch.ops.policyzoo.gaussian_entmax_threshold(m, s, n, cap, int(iters))


__all__ = ["EntmaxThresholdConfig", "entmax_threshold_config", "gaussian_entmax_threshold"]

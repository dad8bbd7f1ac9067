"""The page Gaussians of `EntmaxKV`: the op ``policyzoo::page_gaussians``, per query head and page
the mean and standard deviation of a Gaussian model of the page's logits, from the page mean and
standard deviation summaries.

Specification: ``reference.py``; kernel: ``kernel.py``. Launch parameters: `PageGaussiansConfig`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ...config import LaunchConfig, current, powers_of_two
from ...route import HAS_TRITON, need_triton, routed
from . import reference

if HAS_TRITON:
    from . import kernel


@dataclasses.dataclass(frozen=True, kw_only=True)
class PageGaussiansConfig(LaunchConfig):
    """Launch parameters of the page Gaussians: a program holds ``block_p`` pages of both summaries."""

    keyword = "page_gaussians"

    block_p: int = 32
    """Pages per program."""
    num_warps: int = 4
    """Warps per program."""

    def __post_init__(self) -> None:
        powers_of_two(self, "block_p", "num_warps")


@torch.library.custom_op("policyzoo::page_gaussians", mutates_args=())
def _page_gaussians_op(q: Tensor, page_mean: Tensor, page_std: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    need_triton()
    return kernel.page_gaussians(q, page_mean, page_std, scale, current(PageGaussiansConfig))


@_page_gaussians_op.register_fake
def _(q, page_mean, page_std, scale):
    b, h, _ = q.shape
    p = page_mean.shape[2]
    return q.new_empty(b, h, p, dtype=torch.float32), q.new_empty(b, h, p, dtype=torch.float32)


@routed(reference.page_gaussians)
def page_gaussians(q: Tensor, page_mean: Tensor, page_std: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``(μ, σ) float32[B, H, P]``: the Gaussian model of each page's logits per query head; see
    `reference.page_gaussians`."""
    return torch.ops.policyzoo.page_gaussians(q, page_mean, page_std, float(scale))


__all__ = ["PageGaussiansConfig", "page_gaussians"]

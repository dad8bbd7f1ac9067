"""The Quest page bound: the op ``policyzoo::quest_page_bound``, per query head or folded over each
GQA group in the kernel.

Specification: ``reference.py``; kernel: ``kernel.py``. Launch parameters: `PageScoreConfig`,
completed per call by `page_score_config`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import torch
from torch import Tensor

from ...config import LaunchConfig, current, next_power_of_2, one_of, powers_of_two
from ...route import HAS_TRITON, need_triton, routed
from . import reference

if HAS_TRITON:
    from . import kernel


@dataclasses.dataclass(frozen=True, kw_only=True)
class PageScoreConfig(LaunchConfig):
    """Launch parameters of the Quest page bound. Over 8,192 pages (8 KV heads, GQA 4, D=128, bf16
    summaries) tl.dot over 64 pages with 2 warps was the fastest, ahead of the per-head loop."""

    keyword = "page_score"
    METHODS: ClassVar[tuple[str, ...]] = ("dot", "loop")

    method: str = "dot"
    """``"dot"``: the bound's two dot products per page with tl.dot (head dims under 16, below its
    minimum, take the loop); ``"loop"``: the G query heads in turn over a tile held in registers."""
    block_p: int = 64
    """Pages per program (16 at least with tl.dot)."""
    num_warps: int = 2
    """Warps per program."""

    def __post_init__(self) -> None:
        one_of(self, "method", self.METHODS)
        powers_of_two(self, "block_p", "num_warps")


def page_score_config(d: int) -> PageScoreConfig:
    """The launch parameters of a call with head dim ``d``: the config in force (`config.current`),
    with the loop where tl.dot cannot serve (it needs 16 rows, columns and inner size: head dims
    under 16) and tiles of 16 pages at least for the dot."""
    return _choose(current(PageScoreConfig), d)


@functools.lru_cache(maxsize=1024)  # a launch's Python time: the same few shapes at every decode step
def _choose(cfg: PageScoreConfig, d: int) -> PageScoreConfig:
    if cfg.method == "dot" and next_power_of_2(d) >= 16:
        return dataclasses.replace(cfg, block_p=max(16, cfg.block_p))
    return dataclasses.replace(cfg, method="loop")


@torch.library.custom_op("policyzoo::quest_page_bound", mutates_args=())
def _quest_page_bound_op(q: Tensor, page_min: Tensor, page_max: Tensor, scale: float, agg: str = "none") -> Tensor:
    need_triton()
    return kernel.quest_page_bound(q, page_min, page_max, scale, agg, page_score_config(q.shape[-1]))


@_quest_page_bound_op.register_fake
def _(q, page_min, page_max, scale, agg="none"):
    b, h, _ = q.shape
    _, h_kv, p, _ = page_min.shape
    return q.new_empty(b, h if agg == "none" else h_kv, p, dtype=torch.float32)


@routed(reference.quest_page_bound)
def quest_page_bound(q: Tensor, page_min: Tensor, page_max: Tensor, scale: float) -> Tensor:
    """Quest page bound ``float32[B, H, P]``; see `reference.quest_page_bound`."""
    return torch.ops.policyzoo.quest_page_bound(q, page_min, page_max, float(scale), "none")


@routed(reference.quest_page_bound_grouped)
def quest_page_bound_grouped(q: Tensor, page_min: Tensor, page_max: Tensor, scale: float, agg: str = "max") -> Tensor:
    """Quest page bound folded over each GQA group in the kernel → ``float32[B, H_kv, P]`` (the
    per-head bounds are never written); see `reference.quest_page_bound_grouped`."""
    return torch.ops.policyzoo.quest_page_bound(q, page_min, page_max, float(scale), agg)


__all__ = ["PageScoreConfig", "page_score_config", "quest_page_bound", "quest_page_bound_grouped"]

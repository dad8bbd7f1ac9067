"""The pooled Gaussian entmax threshold (`EntmaxKV`'s τ̂): the op ``policyzoo::gaussian_entmax_threshold``.

Specification: ``reference.py``; kernel: ``kernel.py``. One opaque op, so that `torch.compile` does
not fuse the Newton passes into one reduction over all pages (which Triton 3.6 fails to compile at
8192 pages). The row's programs meet at a barrier per Newton step, counted in the caller's
`Workspace` (``barrier_counters``), else in counters made for the call. Launch parameters:
`EntmaxThresholdConfig`, completed per call by `entmax_threshold_config`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
from torch import Tensor

from ...config import LaunchConfig, cdiv, current, next_power_of_2, non_negative, positive, powers_of_two
from ...route import HAS_TRITON, INTERPRET, need_triton, routed
from ...workspace import Workspace, buffer, zeroed
from . import reference

if HAS_TRITON:
    from . import kernel


@dataclasses.dataclass(frozen=True, kw_only=True)
class EntmaxThresholdConfig(LaunchConfig):
    """Launch parameters of the pooled Gaussian entmax threshold: a row's pages are split over
    ``split`` programs, each walking its slice in blocks of ``block_p`` pages (held in registers for
    the whole solve when the slice is one block)."""

    keyword = "entmax_threshold"

    block_p: int = 2048
    """Pages per block (registers per thread: block_p / (32·num_warps) pages); a shorter slice takes
    one block of next_pow2(slice) pages, 32 at least."""
    num_warps: int = 16
    """Warps for a full block; a smaller block takes one per 128 pages (1 at least)."""
    split: int = 0
    """Programs per row. 0: as many as fit one program per SM for every row (the programs of a row
    wait for each other at every step, so they must all run at once), at most one per
    ``min_pages`` pages. A larger value is cut to that. One under the interpreter, which runs
    programs one after another."""
    min_pages: int = 512
    """The fewest pages a program of an automatic split takes."""

    def __post_init__(self) -> None:
        powers_of_two(self, "block_p", "num_warps")
        non_negative(self, "split")
        positive(self, "min_pages")


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def entmax_threshold_config(p: int, rows: int = 1, sms: int = 1) -> EntmaxThresholdConfig:
    """The launch parameters of a call on ``rows`` rows of ``p`` pages on a device of ``sms`` SMs:
    the config in force (`config.current`), its split settled (at most ``sms // rows`` programs per
    row, so that every program runs at once; ``sms = 1``: one per row), its block cut to
    next_pow2(slice) pages (32 at least; half that where the rest fits a small tail block,
    `tail_block`) and its warps to one per 128 pages of the block."""
    return _choose(current(EntmaxThresholdConfig), p, rows, sms)


# A held slice may run past its block by at most 1/TAIL_FRACTION of it, into a tail block of its own.
TAIL_FRACTION = 8


def tail_block(per_program: int, block_p: int) -> int | None:
    """Pages of the tail block that holds a slice of ``per_program`` pages past its ``block_p``: 0
    when the block holds the slice, a power of two (32 at least) when the overflow is at most
    ``block_p / TAIL_FRACTION``, None when the slice is walked from memory every step instead.

    A cache of 128K tokens has a few pages more than 8,192: split four ways, 2,049 pages a program,
    which without a tail would be walked from memory block by block at every Newton step (the
    τ-independent terms computed again each time), or held in a block of 4,096 lanes."""
    over = per_program - block_p
    if over <= 0:
        return 0
    return max(32, next_power_of_2(over)) if over * TAIL_FRACTION <= block_p else None


@functools.lru_cache(maxsize=1024)  # a launch's Python time: the same few shapes at every decode step
def _choose(cfg: EntmaxThresholdConfig, p: int, rows: int, sms: int) -> EntmaxThresholdConfig:
    fit = max(1, sms // max(rows, 1))
    split = min(fit, cfg.split or cdiv(p, cfg.min_pages), p)
    per_program = cdiv(p, max(split, 1))
    block = min(cfg.block_p, max(next_power_of_2(per_program), 32))
    if block // 2 >= 32 and tail_block(per_program, block // 2):  # half the block and a small tail
        block //= 2
    return dataclasses.replace(cfg, split=max(split, 1), block_p=block,
                               num_warps=max(1, min(cfg.num_warps, block // 128)))


def _plan_for(p: int, rows: int, device: torch.device) -> tuple[EntmaxThresholdConfig, int | None]:
    """`entmax_threshold_config` for the device (its SMs on CUDA; one program per row elsewhere: the
    interpreter runs programs one after another, so a row's programs would wait forever), and the
    `tail_block` of its slices."""
    cfg = entmax_threshold_config(p, rows, _sm_count(device) if device.type == "cuda" and not INTERPRET else 1)
    return cfg, tail_block(cdiv(p, cfg.split), cfg.block_p)


@torch.library.custom_op("policyzoo::gaussian_entmax_threshold", mutates_args=())
def _gaussian_entmax_threshold_op(m: Tensor, s: Tensor, n: Tensor, cap: Tensor | None, iters: int = 12,
                                  float64_steps: int = reference.FINE_STEPS, counters: Tensor | None = None) -> Tensor:
    # ``counters`` is written and left zero: to torch the op does not mutate it.
    need_triton()
    rows = math.prod(torch.broadcast_shapes(*(t.shape for t in (m, s, n, cap) if t is not None))[:-1])
    counters = zeroed(counters, kernel.COUNTERS * rows, m.device)
    return kernel.gaussian_entmax_threshold(m, s, n, cap, iters, float64_steps, counters, _plan_for)


@_gaussian_entmax_threshold_op.register_fake
def _(m, s, n, cap, iters=12, float64_steps=reference.FINE_STEPS, counters=None):
    shapes = [t.shape for t in (m, s, n, cap) if t is not None]
    return m.new_empty(*torch.broadcast_shapes(*shapes)[:-1], 1, dtype=torch.float64)


@routed(reference.gaussian_entmax_threshold)
def gaussian_entmax_threshold(m: Tensor, s: Tensor, n: Tensor, cap: Tensor | None = None, iters: int = 12,
                              float64_steps: int = reference.FINE_STEPS, *,
                              workspace: Workspace | None = None) -> Tensor:
    """Entmax threshold of a pool of censored Gaussians along the last dim → ``float64[..., 1]``
    (`EntmaxKV`'s τ̂); see `reference.gaussian_entmax_threshold` (``float64_steps=0``: every Newton
    step in float32, the kernel's float32 throughout). ``workspace``: the zeroed barrier counters
    (`Workspace`)."""
    return torch.ops.policyzoo.gaussian_entmax_threshold(m, s, n, cap, int(iters), int(float64_steps),
                                                         buffer(workspace, "barrier_counters"))


__all__ = ["EntmaxThresholdConfig", "entmax_threshold_config", "gaussian_entmax_threshold", "tail_block"]

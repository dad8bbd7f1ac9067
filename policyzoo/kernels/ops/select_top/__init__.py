"""Top-count selection: the op ``policyzoo::select_top``, the positions of each row's largest scores
in ascending order.

Specification: ``reference.py`` (a stable sort); kernels: ``kernel.py``, one program per row or, for
long bf16 rows, histograms over several programs. The histograms need a zeroed buffer: the caller's
`Workspace` (``workspace=``), else one made for the call. Rows the kernel does not take (`takes`) go
to the reference. Launch parameters: `SelectTopConfig`, completed per call by `select_top_config`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import torch
from torch import Tensor

from ...config import LaunchConfig, current, next_power_of_2, non_negative, one_of, positive, powers_of_two
from ...route import HAS_TRITON, check_device, need_triton, routed
from ...workspace import Workspace, buffer, zeroed
from . import reference

if HAS_TRITON:
    from . import kernel

# Entries a row may have to stay in one program's registers (and the counts fit 16 bits in `_emit`):
# every activation vector, and the pages of a 256K context.
MAX_BLOCK_N = 16384
# Entries of a bf16 row by histograms: each program of the emit launch reads every earlier chunk's
# counts, a few KB at this length (a two-stage policy's candidate tokens: 39,322 at keep 0.1 of 128K).
MAX_HIST_N = 1 << 18


@dataclasses.dataclass(frozen=True, kw_only=True)
class SelectTopConfig(LaunchConfig):
    """Launch parameters of `select_top`. Its row-length limits are hard limits of the kernel, not
    choices: `MAX_BLOCK_N` for a row held in registers; longer bf16 rows, up to `MAX_HIST_N`, always
    take the histograms."""

    keyword = "select_top"
    METHODS: ClassVar[tuple[str, ...]] = ("auto", "program", "histogram")

    # Histograms overtake one program near 7K bf16 entries on an H200, hence 8,192.
    method: str = "auto"
    """``"program"``: one program per row, the row held in registers. ``"histogram"``: bf16 rows
    spread over programs of `hist_chunk` entries, two 256-bin histograms of their 16-bit keys, four
    launches (other rows take one program). ``"auto"``: histograms for bf16 rows of `hist_min_n`
    entries or more, one program otherwise."""
    hist_min_n: int = 8192
    """Entries from which ``"auto"`` takes the histograms."""
    hist_chunk: int = 512
    """Entries per program of the histogram method."""
    num_warps: int = 0
    """Warps per program of the one-program method; 0: by the entries held (4 below 4,096, else 8)."""
    interp_steps: int = 16
    """Steps of the threshold search that interpolate before it halves the bracket (0: halve only)."""

    def __post_init__(self) -> None:
        one_of(self, "method", self.METHODS)
        positive(self, "hist_min_n")
        powers_of_two(self, "hist_chunk")
        powers_of_two(self, "num_warps", zero=True)
        non_negative(self, "interp_steps")


def takes(n: int, dtype: torch.dtype) -> bool:
    """Whether the kernel takes rows of ``n`` entries of ``dtype``: up to `MAX_BLOCK_N`, held by one
    program, and bf16 rows up to `MAX_HIST_N` by histograms."""
    return n <= MAX_BLOCK_N or (dtype == torch.bfloat16 and n <= MAX_HIST_N)


def tiles(n: int) -> tuple[int, int]:
    """``(BLOCK_N, TAIL)`` for a row of ``n <= MAX_BLOCK_N`` entries: the largest power of two up to
    ``n`` (16 at least), then the smallest power of two covering the rest (0 if none), so a row just
    over a power of two costs a few more lanes, not twice as many (8,203 pages: 8,192 + 16, not 16,384)."""
    block = max(16, 1 << (max(n, 1).bit_length() - 1))
    if block >= n:
        return block, 0
    tail = max(16, next_power_of_2(n - block))
    return (2 * block, 0) if tail == block else (block, tail)


def select_top_config(n: int, dtype: torch.dtype) -> SelectTopConfig:
    """The launch parameters of a call on rows of ``n`` entries of ``dtype``: the config in force
    (`config.current`) with its method settled (``"auto"``: histograms for bf16 rows of `hist_min_n`
    entries or more; histograms only for bf16 rows, whose keys have 16 bits) and its warps chosen by
    the entries held where it leaves them 0."""
    return _choose(current(SelectTopConfig), n, dtype)


@functools.lru_cache(maxsize=1024)  # a launch's Python time: the same few shapes at every decode step
def _choose(cfg: SelectTopConfig, n: int, dtype: torch.dtype) -> SelectTopConfig:
    bf16 = dtype == torch.bfloat16
    method = cfg.method
    if method == "auto":
        method = "histogram" if bf16 and n >= cfg.hist_min_n else "program"
    elif method == "histogram" and not bf16:
        method = "program"
    block, tail = tiles(n)
    return dataclasses.replace(cfg, method=method, num_warps=cfg.num_warps or (4 if block + tail < 4096 else 8))


@torch.library.custom_op("policyzoo::select_top", mutates_args=())
def _select_top_op(
    scores: Tensor, count: Tensor, k_max: int, absolute: bool = False, histograms: Tensor | None = None
) -> Tensor:
    # ``histograms`` is written and left zero: to torch the op does not mutate it.
    need_triton()
    check_device(scores)
    if scores.dim() != 2 or count.shape != scores.shape[:1]:
        raise ValueError(f"expected scores [R, N] and count [R], got {tuple(scores.shape)} and {tuple(count.shape)}")
    r, n = scores.shape
    if not takes(n, scores.dtype):
        raise ValueError(f"select_top takes rows of at most {MAX_BLOCK_N} entries ({MAX_HIST_N} in bf16), got {n} "
                         f"{scores.dtype} (kernels.select_top sends longer rows to the torch reference)")
    cfg = select_top_config(n, scores.dtype)
    hist = None
    if (cfg.method == "histogram" or n > MAX_BLOCK_N) and r and k_max:  # a row too long for one program
        hist = zeroed(histograms, r * 512, scores.device)
    return kernel.select_top(scores, count, k_max, absolute, cfg, hist, tiles(n))


@_select_top_op.register_fake
def _(scores, count, k_max, absolute=False, histograms=None):
    return scores.new_empty(scores.shape[0], k_max, dtype=torch.int32)


def _takes_rows(scores: Tensor, *args, **kwargs) -> bool:
    return takes(scores.shape[-1], scores.dtype)


@routed(reference.select_top, takes=_takes_rows)
def select_top(
    scores: Tensor, count: Tensor, k_max: int, absolute: bool = False, *, workspace: Workspace | None = None
) -> Tensor:
    """Positions of each row's ``count`` largest scores, ascending → ``int32[R, k_max]``; see
    `reference.select_top`. Rows the kernel does not take (over `MAX_BLOCK_N` entries, unless bf16)
    go to the reference, a sort. ``workspace``: the zeroed histograms (`Workspace`)."""
    return torch.ops.policyzoo.select_top(scores, count, int(k_max), bool(absolute),
                                          buffer(workspace, "select_histograms"))


__all__ = ["MAX_BLOCK_N", "MAX_HIST_N", "SelectTopConfig", "select_top", "select_top_config", "takes", "tiles"]

"""The sparse GEMV of the projection branch: the ops ``policyzoo::sparse_gemv_index``,
``policyzoo::sparse_gemv_threshold`` and ``policyzoo::sparse_gemv_mask``.

Three ways to name the kept input features of ``x [B, d_in]`` against an input-major weight
``w_t [d_in, d_out]``: an index list (`sparse_gemv_index`), a threshold on ``|x|`` decided in the
kernel (`sparse_gemv_threshold`), a bool mask (`sparse_gemv_mask`; `sparse_linear` takes an
``nn.Linear`` weight and any leading dims). Specification: ``reference.py``; kernels: ``kernel.py``.

Launch parameters: `GemvConfig`, completed per call by `gemv_config`; the op turns it into a
`GemvPlan`. A split-K launch that sums its slices in its last program needs zeroed arrival counters
(and fp32 sums with `GemvConfig.atomic_sum`): the caller's `Workspace` (``workspace=``), else made
for the call.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch
from torch import Tensor

from ...config import LaunchConfig, at_least, booleans, cdiv, current, non_negative, positive, powers_of_two
from ...route import HAS_TRITON, check_device, need_triton, routed
from ...workspace import Workspace, buffer, zeroed
from . import reference

if HAS_TRITON:
    from . import kernel


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemvConfig(LaunchConfig):
    """Launch parameters of the sparse GEMV. With the tiles from the shapes it reads the kept weight
    rows faster than the dense cuBLAS GEMV reads the whole weight, at keep 0.5 on every projection of
    an 8B model (H200)."""

    keyword = "gemv"

    # The tiles from the shapes were the fastest, or within 1%, of 37 tile shapes and 2-8 warps on
    # every Llama-3.1-8B projection at batch 1, 4 and 16.
    block_n: int = 0
    """Outputs per program; 0: from the shapes (64 for one row, 128 for row blocks, 256 for row
    blocks of `wide_d_out` outputs or more)."""
    block_k: int = 0
    """Input features per tile of a program's loop; 0: from the shapes (128 for one row, 32 for
    row blocks, half of those from `wide_d_out` outputs)."""
    wide_d_out: int = 16384
    """Outputs from which the tiles from the shapes take half the features per tile (and row blocks
    twice the outputs): gate|up of an 8B model, whose output blocks alone nearly fill the GPU."""
    num_warps: int = 4
    """Warps per program."""
    num_stages: int = 3
    """Software pipelining of the tile loop (the weight loads' masks depend on the activations loaded
    in the same iteration, so the depth matters little)."""
    # Off: it lost much more on gate|up than it gained on the other projections.
    prefetch: bool = False
    """Scanning kernels: load the next tile's activations, and decide which of its features are
    kept, while this tile's weights are in flight."""
    # A [block_k, block_n] fp32 accumulator takes most of a thread's registers, leaving few loads in
    # flight; summing each tile at once (TEAL's layout) frees them but costs a cross-thread reduction
    # per iteration. Off: slower than the default loop on every 8B projection.
    tile_sum: bool = False
    """Scanning kernels at one row: sum each tile's products over its features at once (an
    accumulator of `block_n` floats) rather than once after the loop."""
    # TEAL's kernel: one small tile per program, its sum added atomically into the output. Off: slower
    # than partials summed by the last program on every 8B projection.
    atomic_sum: bool = False
    """Scanning kernels: the slices of the features add their sums into one fp32 sum per output
    with atomic adds (the last program to arrive casts it), rather than each writing its partial.
    The order of the adds varies between launches, so the outputs are not bitwise reproducible.
    Uses the workspace's zeroed sums (`Workspace`)."""
    # Off until a GPU times it.
    warm_x: bool = False
    """Scanning kernels: before its loop, a program asks for every activation line of its slice in
    its SM's L1 (a prefetch hint), and reads the weights past L1 (``.cg``) so that they do not evict
    them: the loop's activation loads, on which its weight loads wait, then hit L1."""
    max_registers: int = 0
    """The registers a thread may use (ptxas' ``maxnreg``), so that more programs share an SM; 0: as
    many as the compiler takes (Triton 3.6 for sm_90: 255 at the one-row 64x128 tile in 4 warps, two
    programs an SM)."""
    split: int = 0
    """Slices of the kept features per output block (split-K); 0: from the shapes (`target_programs`,
    `min_tiles_per_split`)."""
    target_programs: int = 512
    """Programs that a split from the shapes aims at (one wave of an H200: two waves were slower)."""
    min_tiles_per_split: int = 4
    """Tiles of `block_k` features per slice at least, in a split from the shapes."""
    sum_block: int = 1024
    """Outputs per program of the split-K epilogue launch."""
    # Summing in the last program saves a launch where the inputs split several ways, and costs more
    # than it saves on gate|up, which splits 2 ways over many programs (each pays its atomic).
    fuse_epilogue: bool = True
    """Whether the last program of each output block to finish sums the slices (an arrival counter,
    `Workspace`), from `min_fused_split` slices up, instead of an epilogue launch."""
    min_fused_split: int = 3
    """Slices from which the epilogue is fused."""
    block_b: int = 16
    """Batch rows per program of the threshold and mask kernels at batch > 1 (a power of two, 16 at
    least: tl.dot's size). A program reads each weight row once for the union of its rows."""
    # 2: a single row through tl.dot was slower than the loop on every 8B projection.
    dot_from_rows: int = 2
    """Batch rows from which the scanning kernels take row blocks through tl.dot (`block_b` rows per
    program, the absent rows masked); 1 takes them for a single row too, whose weight tiles Triton
    then pipelines as tl.dot operands."""

    def __post_init__(self) -> None:
        powers_of_two(self, "num_warps", "sum_block", "block_b")
        powers_of_two(self, "block_n", "block_k", zero=True)
        positive(self, "wide_d_out")
        at_least(self, 16, "tl.dot's size", "block_b")
        positive(self, "num_stages", "target_programs", "min_tiles_per_split", "min_fused_split", "dot_from_rows")
        non_negative(self, "split", "max_registers")
        booleans(self, "fuse_epilogue", "prefetch", "tile_sum", "atomic_sum", "warm_x")


def slice_len(k: int, split: int, block_k: int) -> int:
    """Kept features per slice when ``k`` split ``split`` ways: whole tiles of ``block_k``."""
    return cdiv(cdiv(max(k, 1), split), block_k) * block_k


def row_block(rows: int, cfg: GemvConfig) -> int:
    """Batch rows per program of the scanning kernels: 1 below `GemvConfig.dot_from_rows` rows,
    else `GemvConfig.block_b` (through tl.dot)."""
    return 1 if rows < cfg.dot_from_rows else cfg.block_b


def gemv_config(k: int, d_out: int, rows: int, align: int = 0, dot: bool = False, gather: bool = False) -> GemvConfig:
    """The launch parameters of a call over ``k`` kept features (all ``d_in`` for the scanning
    kernels), ``d_out`` outputs and ``rows`` programs' worth of batch rows (batch rows for the index
    kernel, row blocks for the scanning ones): the config in force (`config.current`) with `split`
    settled and `fuse_epilogue` true only where the epilogue is fused for it.

    `block_n` and `block_k` 0 take the tiles from the shapes (see `GemvConfig`; the index kernel,
    ``gather``, always takes 64x128, which served exact `TopK` better on gate|up). ``split`` 0 splits
    the features until about `target_programs` programs (one program per output block and row is too
    few for a GPU's memory system when d_out is small), each slice keeping `min_tiles_per_split`
    tiles at least; a split is then rounded to whole tiles per slice, which can leave fewer slices.
    The epilogue is fused from `min_fused_split` slices. ``align`` > 0 caps `block_n` at the largest
    power of two dividing it, so that no block straddles a multiple of it; ``dot`` (row blocks
    through tl.dot) raises `block_n` and `block_k` to 16 at least.
    """
    return _choose(current(GemvConfig), k, d_out, rows, align, dot, gather)


@functools.lru_cache(maxsize=1024)  # a launch's Python time: the same few shapes at every decode step
def _choose(cfg: GemvConfig, k: int, d_out: int, rows: int, align: int = 0, dot: bool = False,
            gather: bool = False) -> GemvConfig:
    wide = d_out >= cfg.wide_d_out and not gather
    if not cfg.block_n:
        cfg = dataclasses.replace(cfg, block_n=(256 if wide else 128) if dot else 64)
    if not cfg.block_k:
        cfg = dataclasses.replace(cfg, block_k=(16 if wide else 32) if dot else (64 if wide else 128))
    if align:
        cfg = dataclasses.replace(cfg, block_n=min(cfg.block_n, align & -align))
    if dot:
        cfg = dataclasses.replace(cfg, block_n=max(cfg.block_n, 16), block_k=max(cfg.block_k, 16))
    split = cfg.split
    if split == 0:
        programs = cdiv(d_out, cfg.block_n) * max(rows, 1)
        split = max(1, min(cdiv(cfg.target_programs, programs), k // (cfg.min_tiles_per_split * cfg.block_k)))
    split = cdiv(max(k, 1), slice_len(k, split, cfg.block_k))
    atomic = cfg.atomic_sum and split > 1 and not gather
    fuse = cfg.fuse_epilogue and split > 1 and (split >= cfg.min_fused_split or atomic)
    return dataclasses.replace(cfg, split=split, fuse_epilogue=fuse, atomic_sum=atomic and fuse)


class GemvPlan(NamedTuple):
    """One launch: its config, batch rows per program (0: one row, the index kernel), programs along
    the batch, kept features and features per slice, and its zeroed scratch: arrival counters where
    the last program sums the slices, fp32 sums with `GemvConfig.atomic_sum` (else None)."""

    cfg: GemvConfig
    block_b: int
    row_programs: int
    k: int
    k_per: int
    counters: Tensor | None
    sums: Tensor | None


def plan(x: Tensor, d_out: int, k: int, block_b: int, align: int, counters: Tensor | None,
         sums: Tensor | None) -> GemvPlan:
    """The `GemvPlan` of a call on ``x [B, d_in]`` (``block_b`` 0: the index kernel), with the
    workspace's ``counters`` and ``sums`` where they are large enough, else new zeroed ones."""
    b = x.shape[0]
    row_programs = b if block_b == 0 else cdiv(b, block_b)
    cfg = gemv_config(k, d_out, row_programs, align, dot=block_b > 1, gather=block_b == 0)
    done = total = None
    if cfg.fuse_epilogue:  # a split the last program of each output block sums
        done = zeroed(counters, cdiv(d_out, cfg.block_n) * row_programs, x.device)
    if cfg.atomic_sum:  # one fp32 sum per output (int32 zeros are 0.0f)
        total = zeroed(sums, b * d_out, x.device)[: b * d_out].view(torch.float32)
    return GemvPlan(cfg, block_b, row_programs, k, slice_len(k, cfg.split, cfg.block_k), done, total)


def threshold_strides(t: Tensor, b: int, d_out: int) -> tuple[int, int]:
    """``(row, column)`` strides of a threshold ``t``: 0-dim (one for all), ``[B, 1]`` (one per row)
    or ``[1, d_out]`` (one per output column); a size-1 dimension is broadcast (stride 0)."""
    if t.dim() == 0:
        return 0, 0
    if t.dim() != 2 or t.shape[0] not in (1, b) or t.shape[1] not in (1, d_out) or (t.shape[0] > 1 and t.shape[1] > 1):
        raise ValueError(f"a threshold must be a scalar, [B, 1] or [1, d_out] (B={b}, d_out={d_out}), got {tuple(t.shape)}")
    return (t.stride(0) if t.shape[0] > 1 else 0), (t.stride(1) if t.shape[1] > 1 else 0)


def check_segment(t: Tensor, d_out: int, segment: int) -> None:
    """Per-column thresholds are read once per block of outputs: they must be constant over runs
    of ``segment`` columns, and ``segment`` a multiple of 16 (the narrowest block it allows)."""
    if t.dim() == 2 and t.shape[1] > 1 and (segment <= 0 or segment % 16 or d_out % segment):
        raise ValueError(
            f"per-column thresholds need segment, a multiple of 16 dividing d_out={d_out}, over which they are "
            f"constant; got segment={segment}"
        )


def _checked(x: Tensor, w_t: Tensor) -> Tensor:
    """``x`` with a unit last stride, after the checks every GEMV op makes."""
    need_triton()
    check_device(x)
    if x.dim() != 2 or w_t.dim() != 2 or x.shape[1] != w_t.shape[0]:
        raise ValueError(f"expected x [B, d_in] and w_t [d_in, d_out], got {tuple(x.shape)} and {tuple(w_t.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


# The ops write the workspace's ``counters`` and ``sums`` and leave them zero: to torch they do not
# mutate them.
@torch.library.custom_op("policyzoo::sparse_gemv_index", mutates_args=())
def _sparse_gemv_index_op(x: Tensor, idx: Tensor, w_t: Tensor, bias: Tensor | None, counters: Tensor | None = None,
                          sums: Tensor | None = None) -> Tensor:
    x = _checked(x, w_t)
    if x.shape[0] * w_t.shape[1] == 0:
        return x.new_empty(x.shape[0], w_t.shape[1])
    return kernel.launch_index(x, idx, w_t, bias, plan(x, w_t.shape[1], idx.shape[1], 0, 0, counters, sums))


@torch.library.custom_op("policyzoo::sparse_gemv_threshold", mutates_args=())
def _sparse_gemv_threshold_op(x: Tensor, t: Tensor, w_t: Tensor, bias: Tensor | None, segment: int,
                              counters: Tensor | None = None, sums: Tensor | None = None) -> Tensor:
    x = _checked(x, w_t)
    b, d_out = x.shape[0], w_t.shape[1]
    if b * d_out == 0:
        return x.new_empty(b, d_out)
    strides = threshold_strides(t, b, d_out)
    block_b = row_block(b, current(GemvConfig))
    launch = plan(x, d_out, x.shape[1], block_b, segment if strides[1] else 0, counters, sums)
    return kernel.launch_scan(x, None, t, strides, w_t, bias, launch)


@torch.library.custom_op("policyzoo::sparse_gemv_mask", mutates_args=())
def _sparse_gemv_mask_op(x: Tensor, keep: Tensor, w_t: Tensor, bias: Tensor | None, counters: Tensor | None = None,
                         sums: Tensor | None = None) -> Tensor:
    x = _checked(x, w_t)
    b, d_out = x.shape[0], w_t.shape[1]
    if b * d_out == 0:
        return x.new_empty(b, d_out)
    launch = plan(x, d_out, x.shape[1], row_block(b, current(GemvConfig)), 0, counters, sums)
    return kernel.launch_scan(x, keep, None, (0, 0), w_t, bias, launch)


def _gemv_fake(x, w_t, *args, **kwargs):
    return x.new_empty(x.shape[0], w_t.shape[1])


_sparse_gemv_index_op.register_fake(lambda x, idx, w_t, *args, **kwargs: _gemv_fake(x, w_t))
_sparse_gemv_threshold_op.register_fake(lambda x, t, w_t, *args, **kwargs: _gemv_fake(x, w_t))
_sparse_gemv_mask_op.register_fake(lambda x, keep, w_t, *args, **kwargs: _gemv_fake(x, w_t))


def _scratch(workspace: Workspace | None) -> tuple[Tensor | None, Tensor | None]:
    return buffer(workspace, "gemv_counters"), buffer(workspace, "gemv_sums")


@routed(reference.sparse_gemv_index)
def sparse_gemv_index(x: Tensor, idx: Tensor, w_t: Tensor, bias: Tensor | None = None, *,
                      workspace: Workspace | None = None) -> Tensor:
    """``[B, d_out]`` from the kept features ``idx [B, k]`` (distinct per row) and input-major
    ``w_t [d_in, d_out]``; see `reference.sparse_gemv_index`."""
    return torch.ops.policyzoo.sparse_gemv_index(x, idx, w_t, bias, *_scratch(workspace))


@routed(reference.sparse_gemv_threshold)
def sparse_gemv_threshold(x: Tensor, t: Tensor | float, w_t: Tensor, bias: Tensor | None = None, segment: int = 0, *,
                          workspace: Workspace | None = None) -> Tensor:
    """``[B, d_out]`` over the inputs with ``|x| >= t`` (compared in fp32), input-major
    ``w_t [d_in, d_out]``; ``t`` one threshold, one per row ``[B, 1]``, or one per output column
    ``[1, d_out]`` constant over runs of ``segment`` columns (q|k|v in one pass). A ``t`` tensor on
    x's device avoids a copy. Rows of a batch share each weight row they keep (one read for the
    union). See `reference.sparse_gemv_threshold`."""
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
    threshold_strides(t, x.shape[0], w_t.shape[1])  # bad shapes fail here, before the op
    check_segment(t, w_t.shape[1], segment)
    return torch.ops.policyzoo.sparse_gemv_threshold(x, t, w_t, bias, int(segment), *_scratch(workspace))


def _sparse_gemv_mask_reference(x: Tensor, keep: Tensor, w_t: Tensor, bias: Tensor | None = None) -> Tensor:
    return reference.sparse_linear(x, w_t.t(), bias, keep)


@routed(_sparse_gemv_mask_reference)
def sparse_gemv_mask(x: Tensor, keep: Tensor, w_t: Tensor, bias: Tensor | None = None, *,
                     workspace: Workspace | None = None) -> Tensor:
    """``[B, d_out]`` over the features where ``keep [B, d_in]`` (bool) is set, input-major ``w_t``:
    `reference.sparse_linear` with ``weight = w_t.t()``."""
    return torch.ops.policyzoo.sparse_gemv_mask(x, keep, w_t, bias, *_scratch(workspace))


@routed(reference.sparse_linear)
def sparse_linear(x: Tensor, weight: Tensor, bias: Tensor | None, keep: Tensor, *,
                  workspace: Workspace | None = None) -> Tensor:
    """``F.linear`` over the kept input features only (``keep``: a bool mask like ``x [..., d_in]``;
    ``weight [d_out, d_in]``, nn.Linear's layout, read through its transposed view); see
    `reference.sparse_linear`."""
    d_in = x.shape[-1]
    y = torch.ops.policyzoo.sparse_gemv_mask(x.reshape(-1, d_in), keep.reshape(-1, d_in), weight.t(), bias,
                                             *_scratch(workspace))
    return y.view(*x.shape[:-1], weight.shape[0])


__all__ = [
    "GemvConfig",
    "GemvPlan",
    "gemv_config",
    "sparse_gemv_index",
    "sparse_gemv_mask",
    "sparse_gemv_threshold",
    "sparse_linear",
]

"""The dense GEMV of decode shapes: the ops ``policyzoo::dense_gemv`` and ``policyzoo::dense_gemv_t``.

``x [..., d_in]`` against a whole weight, read once, in the layout it is stored: output-major
``weight [d_out, d_in]`` (nn.Linear's, `dense_gemv`) or input-major ``w_t [d_in, d_out]``
(`dense_gemv_t`; the sparse GEMV's layout). Meant for the decode projections (q|k|v, o, gate|up,
down, the LM head) at a few batch rows, where cuBLAS reads well under the memory's bandwidth; cuBLAS
(the reference) serves every call off the kernels. Specification: ``reference.py``; kernels:
``kernel.py``.

Launch parameters: `DenseGemvConfig`, completed per call by `dense_gemv_config`. A split-K launch
that sums its slices in its last program needs zeroed arrival counters: the caller's `Workspace`
(``workspace=``, its ``gemv_counters``, shared with the sparse GEMV, which never runs at the same
time), else made for the call.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor

from ...config import LaunchConfig, at_least, booleans, cdiv, current, next_power_of_2, non_negative, positive, powers_of_two
from ...route import HAS_TRITON, check_device, need_triton, routed
from ...workspace import Workspace, buffer, zeroed
from ..sparse_gemv import slice_len
from . import reference

if HAS_TRITON:
    from . import kernel


@dataclasses.dataclass(frozen=True, kw_only=True)
class DenseGemvConfig(LaunchConfig):
    """Launch parameters of the dense GEMV (both layouts). Untuned: the tiles from the shapes are a
    starting point for the probe (``python -m benchmarks.gemv_dense``)."""

    keyword = "dense_gemv"

    block_n: int = 0
    """Outputs per program; 0: from the shapes (output-major: 16 for one row, 64 for row blocks;
    input-major: 64 for one row, 128 for row blocks)."""
    block_k: int = 0
    """Input features per tile of a program's loop; 0: from the shapes (output-major: 512 for one
    row, 64 for row blocks; input-major: 128 for one row, 32 for row blocks; never above d_in rounded
    up to a power of two, 16 at least)."""
    num_warps: int = 0
    """Warps per program; 0: from the shapes (8 for one row output-major, else 4)."""
    num_stages: int = 3
    """Software pipelining of the tile loop."""
    split: int = 0
    """Slices of the inputs per output block (split-K); 0: from the shapes (one row output-major: no
    split; else by `target_programs` and `min_tiles_per_split`)."""
    target_programs: int = 512
    """Programs that a split from the shapes aims at (about four per SM of an H200)."""
    min_tiles_per_split: int = 4
    """Tiles of `block_k` features per slice at least, in a split from the shapes."""
    fuse_epilogue: bool = True
    """Whether the last program of each output block to finish sums the slices (an arrival counter,
    `Workspace`), from `min_fused_split` slices up, instead of an epilogue launch."""
    min_fused_split: int = 2
    """Slices from which the epilogue is fused."""
    sum_block: int = 1024
    """Outputs per program of the split-K epilogue launch."""
    block_b: int = 16
    """Batch rows per program in row blocks (a power of two, 16 at least: tl.dot's size): each weight
    tile is read once for the block's rows."""
    dot_from_rows: int = 2
    """Batch rows from which programs take row blocks through tl.dot; below, one program per row and
    output block (each row reads the weight: L2 may serve the repeats)."""
    decode_rows: int = 0
    """Batch rows up to which a Decoder's dense projections (those it wraps: q|k|v, o, gate|up,
    down) go through this kernel instead of cuBLAS; 0: none. Read once per projection, when a
    Decoder wraps it (`dense_gemv_decode_rows`), so a compiled step never reads it."""

    def __post_init__(self) -> None:
        powers_of_two(self, "sum_block", "block_b")
        powers_of_two(self, "block_n", "block_k", "num_warps", zero=True)
        at_least(self, 16, "tl.dot's size", "block_b")
        positive(self, "num_stages", "target_programs", "min_tiles_per_split", "min_fused_split", "dot_from_rows")
        non_negative(self, "split", "decode_rows")
        booleans(self, "fuse_epilogue")


def dense_gemv_decode_rows() -> int:
    """Batch rows up to which a Decoder's dense decode projections go through `dense_gemv_t` instead
    of cuBLAS: the config in force's `DenseGemvConfig.decode_rows` (0 by default: cuBLAS
    everywhere, until an end-to-end measurement says the kernel wins)."""
    return current(DenseGemvConfig).decode_rows


def row_block(rows: int, cfg: DenseGemvConfig) -> int:
    """Batch rows per program: 1 below `DenseGemvConfig.dot_from_rows` rows, else
    `DenseGemvConfig.block_b` (through tl.dot)."""
    return 1 if rows < cfg.dot_from_rows else cfg.block_b


def dense_gemv_config(d_in: int, d_out: int, rows: int, input_major: bool) -> DenseGemvConfig:
    """The launch parameters of a call over ``d_in`` inputs, ``d_out`` outputs and ``rows`` batch rows,
    output-major or ``input_major``: the config in force (`config.current`) with the tiles, `split`
    settled and `fuse_epilogue` true only where the epilogue is fused for it.

    `block_n` and `block_k` 0 take the tiles from the shapes (see `DenseGemvConfig`); row blocks
    (tl.dot, from `dot_from_rows` rows) raise both to 16 at least. ``split`` 0 splits the inputs
    until about `target_programs` programs (output blocks x row programs), each slice keeping
    `min_tiles_per_split` tiles at least; a split is then rounded to whole tiles per slice, which can
    leave fewer slices. The epilogue is fused from `min_fused_split` slices.
    """
    return _choose(current(DenseGemvConfig), d_in, d_out, rows, input_major)


@functools.lru_cache(maxsize=1024)  # a launch's Python time: the same few shapes at every decode step
def _choose(cfg: DenseGemvConfig, d_in: int, d_out: int, rows: int, input_major: bool) -> DenseGemvConfig:
    block_b = row_block(rows, cfg)
    dot = block_b > 1
    # One row output-major: narrow blocks of long rows, 8 warps, no split, the fastest config of the
    # o, down and LM head shapes in `benchmarks.gemv_dense` on the H100 and the H200 alike.
    row_reader = not dot and not input_major
    if not cfg.block_n:
        cfg = dataclasses.replace(cfg, block_n=(128 if dot else 64) if input_major else (64 if dot else 16))
    if not cfg.block_k:
        block_k = (32 if dot else 128) if input_major else (64 if dot else 512)
        cfg = dataclasses.replace(cfg, block_k=min(block_k, max(16, next_power_of_2(d_in))))
    if not cfg.num_warps:
        cfg = dataclasses.replace(cfg, num_warps=8 if row_reader else 4)
    if dot:
        cfg = dataclasses.replace(cfg, block_n=max(cfg.block_n, 16), block_k=max(cfg.block_k, 16))
    split = cfg.split or (1 if row_reader else 0)
    if split == 0:
        programs = cdiv(d_out, cfg.block_n) * cdiv(max(rows, 1), block_b)
        split = max(1, min(cdiv(cfg.target_programs, programs), d_in // (cfg.min_tiles_per_split * cfg.block_k)))
    split = cdiv(max(d_in, 1), slice_len(d_in, split, cfg.block_k))
    fuse = cfg.fuse_epilogue and split > 1 and split >= cfg.min_fused_split
    return dataclasses.replace(cfg, split=split, fuse_epilogue=fuse)


def _checked(x: Tensor, w: Tensor, bias: Tensor | None, input_major: bool) -> Tensor:
    """``x [B, d_in]`` with a unit last stride, after the checks both ops make."""
    need_triton()
    check_device(x)
    _check_shapes(x, w, bias, input_major, flat=True)
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_shapes(x: Tensor, w: Tensor, bias: Tensor | None, input_major: bool, flat: bool = False) -> None:
    """ValueError unless ``x [..., d_in]`` (``[B, d_in]`` when ``flat``), the weight
    (``[d_in, d_out]`` when ``input_major``, else ``[d_out, d_in]``) and ``bias [d_out]`` agree, in
    one dtype."""
    d_in, d_out = ((w.shape[0], w.shape[1]) if input_major else (w.shape[1], w.shape[0])) if w.dim() == 2 else (-1, -1)
    layout = "w_t [d_in, d_out]" if input_major else "weight [d_out, d_in]"
    if (x.dim() != 2 if flat else x.dim() < 1) or w.dim() != 2 or x.shape[-1] != d_in:
        raise ValueError(f"expected x [{'B' if flat else '...'}, d_in] and {layout}, got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != d_out):
        raise ValueError(f"expected bias [d_out] with d_out={d_out}, got {tuple(bias.shape)}")
    dtypes = {x.dtype, w.dtype} | ({bias.dtype} if bias is not None else set())
    if len(dtypes) > 1:
        raise ValueError(f"x, the weight and bias must share a dtype, got {sorted(map(str, dtypes))}")


def _run(x: Tensor, w: Tensor, bias: Tensor | None, counters: Tensor | None, input_major: bool) -> Tensor:
    x = _checked(x, w, bias, input_major)
    b, d_in = x.shape
    d_out = w.shape[1] if input_major else w.shape[0]
    if b * d_out == 0:
        return x.new_empty(b, d_out)
    cfg = dense_gemv_config(d_in, d_out, b, input_major)
    block_b = row_block(b, cfg)
    done = zeroed(counters, cdiv(d_out, cfg.block_n) * cdiv(b, block_b), x.device) if cfg.fuse_epilogue else None
    return kernel.launch(x, w, bias, cfg, block_b, done, input_major)


# The ops write the workspace's ``counters`` and leave them zero: to torch they do not mutate them.
@torch.library.custom_op("policyzoo::dense_gemv", mutates_args=())
def _dense_gemv_op(x: Tensor, weight: Tensor, bias: Tensor | None, counters: Tensor | None = None) -> Tensor:
    return _run(x, weight, bias, counters, input_major=False)


@torch.library.custom_op("policyzoo::dense_gemv_t", mutates_args=())
def _dense_gemv_t_op(x: Tensor, w_t: Tensor, bias: Tensor | None, counters: Tensor | None = None) -> Tensor:
    return _run(x, w_t, bias, counters, input_major=True)


_dense_gemv_op.register_fake(lambda x, weight, *args, **kwargs: x.new_empty(x.shape[0], weight.shape[0]))
_dense_gemv_t_op.register_fake(lambda x, w_t, *args, **kwargs: x.new_empty(x.shape[0], w_t.shape[1]))


@routed(reference.dense_gemv)
def dense_gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, workspace: Workspace | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., d_in]`` and output-major ``weight [d_out, d_in]``
    (nn.Linear's layout; read coalesced when contiguous) → ``[..., d_out]`` in x's dtype; see
    `reference.dense_gemv`."""
    _check_shapes(x, weight, bias, input_major=False)
    d_in = x.shape[-1]
    y = torch.ops.policyzoo.dense_gemv(x.reshape(-1, d_in), weight, bias, buffer(workspace, "gemv_counters"))
    return y.view(*x.shape[:-1], weight.shape[0])


@routed(reference.dense_gemv_t)
def dense_gemv_t(x: Tensor, w_t: Tensor, bias: Tensor | None = None, *, workspace: Workspace | None = None) -> Tensor:
    """``x @ w_t + bias`` for ``x [..., d_in]`` and input-major ``w_t [d_in, d_out]`` (read coalesced
    when contiguous, not through the transposed view of an nn.Linear weight) → ``[..., d_out]`` in
    x's dtype; see `reference.dense_gemv_t`."""
    _check_shapes(x, w_t, bias, input_major=True)
    d_in = x.shape[-1]
    y = torch.ops.policyzoo.dense_gemv_t(x.reshape(-1, d_in), w_t, bias, buffer(workspace, "gemv_counters"))
    return y.view(*x.shape[:-1], w_t.shape[1])


__all__ = ["DenseGemvConfig", "dense_gemv", "dense_gemv_config", "dense_gemv_decode_rows", "dense_gemv_t"]

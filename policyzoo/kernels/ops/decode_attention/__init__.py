"""Decode attention over a `Selection`, softmax or 1.5-entmax: the op ``policyzoo::decode_attention``.

`decode_attention` returns ``(out, lse)``, `decode_attention_entmax15` ``(out, tau)``; both are the
op, in ``mode="softmax"`` or ``"entmax15"``. Specification: ``reference.py``; kernels: ``kernel.py``
(split-K, Triton). A `Selection` is not an op argument type, so it travels unpacked (indices, count,
log_weight, block). Launch parameters: `AttentionConfig`, completed per call by `attention_config`.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor

from ....selection import Selection
from ...config import LaunchConfig, at_least, cdiv, current, next_power_of_2, non_negative, positive, powers_of_two
from ...route import HAS_TRITON, need_triton, routed
from . import reference

if HAS_TRITON:
    from . import kernel


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionConfig(LaunchConfig):
    """Launch parameters of the split-K decode-attention kernels."""

    keyword = "attention"

    # The tiles, stages and split below are the fastest of a grid of 42 on dense layers of 2K-128K
    # tokens (32 q / 8 KV heads, head dim 128, caches rotated past the L2 cache, an H100): about 64
    # chunks a KV head, tiles of 32 tokens for chunks of up to 128, two stages. Against the earlier
    # 64-token tiles, three stages and chunks of 128 tokens at least: 4K 14.9 -> 12.4 µs, 2K 11.4 ->
    # 9.6, 8K 19.2 -> 18.2, 32K and 128K within 1%.
    block_t: int = 0
    """Selection tokens per tile of the chunk kernels (a power of two, 16 at least: tl.dot's size);
    0: from the chunk (`SHORT_CHUNK_TILE` for chunks of up to `SHORT_CHUNK_TOKENS` tokens, else 64)."""
    num_warps: int = 4
    """Warps of the kernels that read keys or values."""
    num_stages: int = 2
    """Software pipelining of their tile loop."""
    chunk: int = 0
    """Selection entries per split-K program; 0: from the shapes (`target_programs`, `min_chunk_tokens`)."""
    target_programs: int = 512
    """Chunks x KV heads x rows that a split from the shapes aims at."""
    min_chunk_tokens: int = 32
    """Tokens per chunk program at least, in a split from the shapes."""
    # One merge step over every partial beat fixed steps of 32 at 32K and 128K tokens.
    block_c: int = 0
    """Chunk partials per step of the softmax merge; 0: all of them in one step, up to `max_block_c`."""
    max_block_c: int = 128
    """The widest merge step that ``block_c = 0`` takes."""
    merge_warps: int = 0
    """Warps of the merge launch; 0: from the merge step's partial outputs (`MERGE_VALUES_PER_WARP`)."""
    # The threshold search is a sequential loop per (row, head): wide steps keep it short (a 2K-token
    # selection is one step per pass).
    block_m: int = 4096
    """Scratch entries per step of the 1.5-entmax threshold search."""
    tau_warps: int = 8
    """Warps of the threshold search."""
    # The bracket starts < 1 wide, so an entry misplaced after 16 halvings lies within 2^-16 of tau and
    # weighs < 2^-32; the closed form then gives tau to fp32 precision anyway.
    n_bisect: int = 16
    """Bisection steps of the threshold search (they only have to find the support)."""

    def __post_init__(self) -> None:
        powers_of_two(self, "num_warps", "max_block_c", "block_m", "tau_warps")
        powers_of_two(self, "block_c", "block_t", "merge_warps", zero=True)
        positive(self, "num_stages", "target_programs", "min_chunk_tokens", "n_bisect")
        non_negative(self, "chunk")
        if self.block_t:
            at_least(self, 16, "tl.dot's minimum", "block_t")


# A merge step holds ``block_c x head_dim`` fp32 partial outputs in registers. 128 values a thread
# fit (64 x 128 in 2 warps: 166 registers); 256 spill (128 x 128 in 2 warps, or 64 x 256: 255
# registers and 112-144 bytes of stack a thread, Triton 3.6, sm_90), and so do 128 x 256 in 8 warps
# with Triton 3.9: a step holds 128 x 128 values at most.
MERGE_VALUES_PER_WARP = 32 * 128
MERGE_STEP_VALUES = 128 * 128

# Chunks of up to this many tokens are walked in tiles of `SHORT_CHUNK_TILE` (less masked work in a
# chunk of a short context), longer ones in tiles of 64.
SHORT_CHUNK_TOKENS = 128
SHORT_CHUNK_TILE = 32


def attention_config(k_max: int, block: int, rows: int, head_dim: int) -> AttentionConfig:
    """The launch parameters of a call over ``k_max`` selection entries of ``block`` tokens for
    ``rows`` (batch rows x KV heads) and heads of ``head_dim``: the config in force
    (`config.current`) with `chunk`, `block_c`, `block_t` and `merge_warps` chosen where it leaves
    them 0. Chunks: enough programs to fill a GPU (`target_programs`), `min_chunk_tokens` tokens per
    program at least. Merge steps: every chunk partial in one step, up to `max_block_c` and
    `MERGE_STEP_VALUES` partial output values, with a warp per `MERGE_VALUES_PER_WARP` of them
    (2 warps at least). Tiles: by the chunk's tokens (`SHORT_CHUNK_TOKENS`).

    Depends on shapes only, so the grid is static under torch.compile and CUDA graphs.
    """
    return _choose(current(AttentionConfig), k_max, block, rows, head_dim)


@functools.lru_cache(maxsize=1024)  # a launch's Python time: the same few shapes at every decode step
def _choose(cfg: AttentionConfig, k_max: int, block: int, rows: int, head_dim: int) -> AttentionConfig:
    chunk = cfg.chunk
    if chunk == 0:
        splits = min(cdiv(k_max * block, cfg.min_chunk_tokens), cdiv(cfg.target_programs, max(rows, 1)))
        chunk = max(1, cdiv(k_max, max(1, splits)))
    n_chunks = max(1, cdiv(k_max, chunk))
    d = next_power_of_2(head_dim)
    block_c = cfg.block_c or min(cfg.max_block_c, max(16, MERGE_STEP_VALUES // d), max(16, next_power_of_2(n_chunks)))
    block_t = cfg.block_t or (SHORT_CHUNK_TILE if chunk * block <= SHORT_CHUNK_TOKENS else 64)
    merge_warps = cfg.merge_warps or max(2, block_c * d // MERGE_VALUES_PER_WARP)
    return dataclasses.replace(cfg, chunk=chunk, block_c=block_c, block_t=block_t, merge_warps=merge_warps)


@torch.library.custom_op("policyzoo::decode_attention", mutates_args=())
def _decode_attention_op(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    indices: Tensor,
    count: Tensor,
    log_weight: Tensor | None,
    block: int,
    start: Tensor,
    length: Tensor,
    scale: float,
    mode: str = "softmax",
    slots: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    need_triton()
    cfg = attention_config(indices.shape[-1], block, q.shape[0] * keys.shape[1], q.shape[-1])
    return kernel.decode_attention(q, keys, values, indices, count, log_weight, block, start, length, scale, mode, slots,
                                   cfg)


@_decode_attention_op.register_fake
def _(q, keys, values, indices, count, log_weight, block, start, length, scale, mode="softmax", slots=None):
    b, h, d = q.shape
    return q.new_empty(b, h, d), q.new_empty(b, h, dtype=torch.float32)


def _attend(q, keys, values, sel: Selection, start, length, scale, mode: str, slots) -> tuple[Tensor, Tensor]:
    return torch.ops.policyzoo.decode_attention(
        q, keys, values, sel.indices, sel.count, sel.log_weight, sel.block, start, length, float(scale), mode, slots
    )


@routed(reference.decode_attention)
def decode_attention(
    q: Tensor, keys: Tensor, values: Tensor, sel: Selection, start: Tensor, length: Tensor, scale: float,
    slots: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Softmax decode attention over a Selection → ``(out, lse)``; see `reference.decode_attention`
    (``slots``: the entries' slots in a page cache whose ``keys`` and ``values`` are passed)."""
    return _attend(q, keys, values, sel, start, length, scale, "softmax", slots)


@routed(reference.decode_attention_entmax15)
def decode_attention_entmax15(
    q: Tensor, keys: Tensor, values: Tensor, sel: Selection, start: Tensor, length: Tensor, scale: float,
    slots: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """1.5-entmax decode attention over a Selection → ``(out, tau)``; see
    `reference.decode_attention_entmax15` (the same op as `decode_attention`, ``mode="entmax15"``)."""
    return _attend(q, keys, values, sel, start, length, scale, "entmax15", slots)


__all__ = ["AttentionConfig", "attention_config", "decode_attention", "decode_attention_entmax15"]

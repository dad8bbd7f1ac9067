"""The key-sketch page bound: the op ``policyzoo::sketch_page_bound``, an upper bound of each page's
best logit from the 4-bit key sketch, of every page or of listed pages.

Specification (and the sketch's encoding): ``reference.py``; kernel: ``kernel.py``. The kernel tiles
a page as a power of two: other page sizes take the reference. Launch parameters:
`SketchScoreConfig`, completed per call by `sketch_score_config`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import torch
from torch import Tensor

from ...config import LaunchConfig, current, non_negative, one_of, powers_of_two
from ...route import HAS_TRITON, need_triton, routed
from . import reference

if HAS_TRITON:
    from . import half2, kernel


@dataclasses.dataclass(frozen=True, kw_only=True)
class SketchScoreConfig(LaunchConfig):
    """Launch parameters of the key-sketch page bound: a program holds ``block_p`` pages of codes."""

    keyword = "sketch_score"
    METHODS: ClassVar[tuple[str, ...]] = ("sum", "dot", "keys", "rows", "half2")

    # "half2" with 8 pages a program and one warp: on an H100 (Triton 3.6) it made one 128K layer's
    # sketch selection 21% faster than "rows" (88 against 111 µs) and `Quest(0.1, bound="sketch")`
    # 7% faster in `generate` (benchmarks/results/2026-12-07-h100-run39).
    method: str = "half2"
    """``"sum"``: the products summed on CUDA cores; ``"dot"``: a batched tl.dot per page of the codes
    (fp16, exact) with the page's weights ``q·step`` in fp16, their rounding added back (pages of 16
    or more; smaller ones take the sum); ``"keys"``: the sketch's keys decoded in fp16 and one tl.dot
    of the program's tokens with the group's queries in fp16, the roundings' worst case added back
    (``block_p·page`` of 16 or more; else the sum); ``"rows"``: the codes read as 32-bit words, each
    thread summing whole rows of a few tokens of one page in fp32 (codes of a multiple of 4 bytes a
    token; else the sum, in its own best tile); ``"half2"``: each thread holds a page's tokens and a run
    of four code words, the products in packed fp16 pairs with their rounding added back (an upper
    bound up to twice `reference.half2_slack` above the reference; codes of whole runs, groups of up
    to four query heads, pages of at most `HALF2_PAGE` tokens, a positive scale; else ``"rows"``)."""
    block_p: int = 8
    """Pages per program (``"rows"``: at most `ROWS_TOKENS` tokens' worth)."""
    num_warps: int = 1
    """Warps per program."""
    words: int = 4
    """``"rows"``: 32-bit words of a token's codes per step (fewer where they do not divide a row)."""
    token_step: int = 16
    """``"half2"``: a page's tokens a step of the kernel's token loop, unrolled within the step; a
    whole page of 16 is one unrolled step. Triton's compile time grows with the unrolled body (on
    the Llama shape, offline: 43 s for steps of 16, 26 s for 8, 18 s for 4), but the shorter steps
    run 8-10% slower (an H100 at 128K), so the default unrolls the page whole."""
    max_registers: int = 0
    """``"half2"``: the registers a thread may use (ptxas' ``maxnreg``), so that more programs share
    an SM; 0: as many as the compiler takes (255 at the Llama shape, eight warps an SM)."""

    def __post_init__(self) -> None:
        one_of(self, "method", self.METHODS)
        powers_of_two(self, "block_p", "num_warps", "words", "token_step")
        non_negative(self, "max_registers")


# A "rows" program keeps a partial sum per token, word and query head in registers: its pages are
# capped at this many tokens (8 pages of 16), so larger pages do not spill.
ROWS_TOKENS = 128
# The half2 kernel unrolls a page's tokens: larger pages take "rows" (a page of 16 compiles in about
# 40 s, once per shape; the compile time grows with the page).
HALF2_PAGE = 16
# The sum's fastest tile on an H100's 128K layer, which a "rows" call that cannot read words falls back to.
SUM_BLOCK_P, SUM_WARPS = 4, 4


def sketch_score_config(page: int, code_bytes: int, method: str | None = None) -> SketchScoreConfig:
    """The launch parameters of a call on pages of ``page`` tokens whose codes take ``code_bytes`` a
    token: the config in force (`config.current`; its method replaced by ``method`` if given), its
    method ``"rows"`` where ``"half2"`` would not get whole runs of four words or pages of at most
    `HALF2_PAGE` tokens, the sum where tl.dot would get fewer than 16 token rows, or where ``"rows"``
    would not get whole 32-bit words."""
    cfg = current(SketchScoreConfig)
    return _choose(cfg if method is None else dataclasses.replace(cfg, method=method), page, code_bytes)


@functools.lru_cache(maxsize=1024)  # a launch's Python time: the same few shapes at every decode step
def _choose(cfg: SketchScoreConfig, page: int, code_bytes: int) -> SketchScoreConfig:
    if cfg.method == "half2" and (code_bytes % 16 or (code_bytes // 16) & (code_bytes // 16 - 1) or page > HALF2_PAGE):
        cfg = dataclasses.replace(cfg, method="rows")
    if cfg.method == "half2":
        return cfg
    if cfg.method == "rows":
        if code_bytes % 4:
            return dataclasses.replace(cfg, method="sum", block_p=SUM_BLOCK_P, num_warps=SUM_WARPS)
        return dataclasses.replace(cfg, block_p=min(cfg.block_p, max(1, ROWS_TOKENS // page)))
    rows = {"sum": 16, "dot": page, "keys": page * cfg.block_p}[cfg.method]
    return cfg if rows >= 16 else dataclasses.replace(cfg, method="sum")


@torch.library.custom_op("policyzoo::sketch_page_bound", mutates_args=())
def _sketch_page_bound_op(
    q: Tensor, codes: Tensor, page_min: Tensor, page_max: Tensor, start: Tensor, length: Tensor, scale: float,
    agg: str = "none", pages: Tensor | None = None,
) -> Tensor:
    need_triton()
    cfg = sketch_score_config(codes.shape[2] // page_min.shape[2], codes.shape[-1])
    if cfg.method == "half2" and not (half2.fits(codes, q.shape[1] // page_min.shape[1]) and scale > 0):
        cfg = sketch_score_config(codes.shape[2] // page_min.shape[2], codes.shape[-1], method="rows")
    if cfg.method == "rows" and not kernel.rows_fit(codes):  # a view whose rows do not start on a word
        cfg = dataclasses.replace(cfg, method="sum", block_p=SUM_BLOCK_P, num_warps=SUM_WARPS)
    return kernel.sketch_page_bound(q, codes, page_min, page_max, start, length, scale, agg, pages, cfg)


@_sketch_page_bound_op.register_fake
def _(q, codes, page_min, page_max, start, length, scale, agg="none", pages=None):
    b, h, _ = q.shape
    _, h_kv, p, _ = page_min.shape
    return q.new_empty(b, h if agg == "none" else h_kv, p if pages is None else pages.shape[-1], dtype=torch.float32)


def _power_of_two_page(q, codes, page_min, *args, **kwargs) -> bool:
    page = codes.shape[2] // page_min.shape[2]
    return page & (page - 1) == 0  # the kernel tiles a page as a power of two


@routed(reference.sketch_page_bound, takes=_power_of_two_page)
def sketch_page_bound(
    q: Tensor, codes: Tensor, page_min: Tensor, page_max: Tensor, start: Tensor, length: Tensor, scale: float,
    agg: str = "none", pages: Tensor | None = None,
) -> Tensor:
    """Upper bound of each page's best logit from the 4-bit key sketch → ``float32[B, H, P]`` (or the
    group's max ``[B, H_kv, P]`` with ``agg="max"``), or of the listed ``pages int[B, H_kv, K]`` only;
    see `reference.sketch_page_bound`."""
    return torch.ops.policyzoo.sketch_page_bound(q, codes, page_min, page_max, start, length, float(scale), agg, pages)


__all__ = ["SketchScoreConfig", "sketch_score_config", "sketch_page_bound"]

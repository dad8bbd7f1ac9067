"""Launch configurations of the Triton kernels, as values, and a scoped override.

Each kernel module reads its launch parameters from one frozen dataclass here: `AttentionConfig`
(`decode_attention.py`), `SelectTopConfig` (`select_top.py`), `GemvConfig` (`sparse_gemv.py`),
`PageScoreConfig` and `SketchScoreConfig` (`page_score.py`), `EntmaxThresholdConfig` (`entmax_threshold.py`),
`GatheredLogitsConfig` (`gathered_logits.py`), `AttentionEdgesConfig` (`attention_edges.py`) and
`PageFetchConfig` (`page_fetch.py`).
(`cache_append.py` takes its warps from the page size and head dim alone: it has no config.) A
launch takes its config from its module's shape rule (`attention_config`, `select_top_config`,
`gemv_config`, `page_score_config`, `entmax_threshold_config`, `gathered_logits_config`): the
config in force for that kernel (`current`), completed for the call. Fields that leave the choice to the shapes (a 0,
``method="auto"``) are chosen, and a choice the call cannot take is adapted (no tl.dot for head dims
under 16, no histograms for rows that are not bf16, no page block longer than the row). Every other
field is used as it is.

The config in force is the dataclass's defaults, or, inside ``with override(...)``, the config the
innermost override gives for that kernel::

    with kernels.config.override(attention=AttentionConfig(block_t=128)):
        ...  # every decode-attention launch here uses tiles of 128 tokens, the other defaults

An override replaces the kernel's config as a whole: fields it does not set take the dataclass
defaults, not an outer override's values (start from ``dataclasses.replace(current(K), ...)`` to
keep those). It is a `contextvars` variable: scopes nest (an inner override replaces the configs
it names and keeps the outer ones for the other kernels), the configs before the scope come back
when it exits, by an exception too, and other threads (and asyncio tasks) keep their own.

A config is read when a kernel launches, inside the custom op: a CUDA graph replays the launches it
captured, whatever is in force at replay. Nothing here or in the kernel modules is assigned at run
time. This module imports no triton, so configs can be made, checked and recorded anywhere.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import ClassVar, TypeVar


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _require(cfg: object, names: tuple[str, ...], ok, what: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not (_is_int(value) and ok(value)):
            raise ValueError(f"{type(cfg).__name__}.{name} must be {what}, got {value!r}")


def _positive(cfg: object, *names: str) -> None:
    _require(cfg, names, lambda v: v > 0, "a positive int")


def _non_negative(cfg: object, *names: str) -> None:
    _require(cfg, names, lambda v: v >= 0, "an int >= 0")


def _powers_of_two(cfg: object, *names: str, zero: bool = False) -> None:
    """Triton's block sizes (``tl.arange``) and warp counts are powers of two; ``zero`` also allows
    0, which leaves the choice to the shape rule."""
    _require(cfg, names, lambda v: (zero and v == 0) or _power_of_two(v), "a power of two" + (" or 0" if zero else ""))


def _one_of(cfg: object, name: str, known: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in known:
        raise ValueError(f"{type(cfg).__name__}.{name} must be one of {known}, got {value!r}")


# Defaults: bf16 on an H200 (Llama-3.1-8B shapes unless said otherwise).


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """Launch parameters of the split-K decode-attention kernels (`decode_attention.py`). Tiles of
    64 tokens with 4 warps read ~2.5 TB/s at batch 4 with 2K selected tokens and ~4 TB/s with 32K
    (D=128, GQA 4)."""

    block_t: int = 64
    """Selection tokens per tile of the chunk kernels (a power of two, 16 at least: tl.dot's size)."""
    num_warps: int = 4
    """Warps of the kernels that read keys or values."""
    num_stages: int = 3
    """Software pipelining of their tile loop (the CUDA default)."""
    chunk: int = 0
    """Selection entries per split-K program; 0: from the shapes (`target_programs`, `min_chunk_tokens`)."""
    target_programs: int = 512
    """Chunks x KV heads x rows that a split from the shapes aims at."""
    min_chunk_tokens: int = 128
    """Tokens per chunk program at least, in a split from the shapes."""
    # One step over every partial with 2 warps measured 40.0 µs at 32K against 42.1 for steps of 32
    # with 4 warps (131.5 against 133.4 at 128K).
    block_c: int = 0
    """Chunk partials per step of the softmax merge; 0: all of them in one step, up to `max_block_c`."""
    max_block_c: int = 128
    """The widest merge step that ``block_c = 0`` takes."""
    merge_warps: int = 2
    """Warps of the merge launch."""
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
        _powers_of_two(self, "block_t", "num_warps", "max_block_c", "merge_warps", "block_m", "tau_warps")
        _powers_of_two(self, "block_c", zero=True)
        _positive(self, "num_stages", "target_programs", "min_chunk_tokens", "n_bisect")
        _non_negative(self, "chunk")
        if self.block_t < 16:
            raise ValueError(f"AttentionConfig.block_t must be 16 at least (tl.dot's minimum), got {self.block_t}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SelectTopConfig:
    """Launch parameters of `select_top.py`. Its row-length limits are hard limits of the kernel, not
    choices: `select_top.MAX_BLOCK_N` for a row held in registers; longer bf16 rows, up to
    `select_top.MAX_HIST_N`, always take the histograms."""

    METHODS: ClassVar[tuple[str, ...]] = ("auto", "program", "histogram")

    # 14,336 bf16 entries took 10.8 µs by histograms in chunks of 512 (11.4 in 1,024, 12.3 in 2,048)
    # against 17.9 µs in one program; 4,096 entries 9.6 against 6.85. The two lines cross near 7K
    # entries (interpolated, not measured), hence 8,192.
    method: str = "auto"
    """``"program"``: one program per row, the row held in registers. ``"histogram"``: bf16 rows
    spread over programs of `hist_chunk` entries, two 256-bin histograms of their 16-bit keys, four
    launches (other rows take one program). ``"auto"``: histograms for bf16 rows of `hist_min_n`
    entries or more, one program otherwise."""
    hist_min_n: int = 8192
    """Entries from which ``"auto"`` takes the histograms."""
    hist_chunk: int = 512
    """Entries per program of the histogram method."""
    # 8 warps beat 4 on 4,096 bf16 entries (7.5-7.6 against 7.8-8.7 µs) and 16 on 8 rows of 8,192 fp32
    # (13.7 against 15.0 µs); 1 and 2 warps took 35.5 and 14.2 µs on 4,096 entries.
    num_warps: int = 0
    """Warps per program of the one-program method; 0: by the entries held (4 below 4,096, else 8)."""
    interp_steps: int = 16
    """Steps of the threshold search that interpolate before it halves the bracket (0: halve only)."""

    def __post_init__(self) -> None:
        _one_of(self, "method", self.METHODS)
        _positive(self, "hist_min_n")
        _powers_of_two(self, "hist_chunk")
        _powers_of_two(self, "num_warps", zero=True)
        _non_negative(self, "interp_steps")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemvConfig:
    """Launch parameters of the sparse GEMV (`sparse_gemv.py`). With the tiles from the shapes,
    batch 1 and half the inputs kept read 1.7-2.9 TB/s of the kept weight rows on an H200 (q|k|v,
    o, gate|up and down of Llama-3.1-8B), 1.3-1.4x faster than the dense cuBLAS GEMV; row blocks
    (batch 4 and 16) read 1.7-3.8 TB/s of the union of their rows' kept rows."""

    # Tiles from the shapes, at batch 1 / in row blocks: 64x128 / 128x32 where the outputs are few,
    # 64x64 / 256x16 from `wide_d_out` outputs. Over 37 tile shapes and 2-8 warps, these were the
    # fastest or within 1% on every Llama-3.1-8B group, at batch 1, 4 and 16 (the results README).
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
    # The weight loads' masks depend on the activations loaded in the same iteration: depths 1 to 5
    # measured within 4% of each other at batch 1.
    num_stages: int = 3
    """Software pipelining of the tile loop."""
    # The weight loads wait on the compare of activations loaded in the same iteration, which is why
    # pipelining depth changed nothing. Off: on an H200 it gained 1-3% on q|k|v, o and down of an 8B
    # model and lost 40% on gate|up (64x64 tiles).
    prefetch: bool = False
    """Scanning kernels: load the next tile's activations, and decide which of its features are
    kept, while this tile's weights are in flight."""
    # A [block_k, block_n] fp32 accumulator takes most of a thread's registers (4 programs per SM at
    # 64x128): few loads in flight. Summing each tile at once needs a cross-thread reduction per
    # iteration, but leaves room for many more programs (TEAL's layout). Off: slower than the
    # default loop on every 8B group measured on an H200.
    tile_sum: bool = False
    """Scanning kernels at one row: sum each tile's products over its features at once (an
    accumulator of `block_n` floats) rather than once after the loop."""
    # TEAL's kernel: one small tile per program, its sum added atomically into the output. Partials
    # summed by the last program cost a serial loop over the slices, too long from some 16 slices.
    # Off: 13-20% slower than the default loop at best on the 8B groups (H200).
    atomic_sum: bool = False
    """Scanning kernels: the slices of the features add their sums into one fp32 sum per output
    with atomic adds (the last program to arrive casts it), rather than each writing its partial.
    The order of the adds varies between launches, so the outputs are not bitwise reproducible.
    Needs the reserved scratch buffers (`kernels.scratch`); without them, partials."""
    split: int = 0
    """Slices of the kept features per output block (split-K); 0: from the shapes (`target_programs`,
    `min_tiles_per_split`)."""
    # One wave (132 SMs x 4 programs of 122 registers per thread); 1024, two waves, measured 24.2
    # against 20.9 µs on the down projection at keep 0.5, the other shapes within 0.5 µs.
    target_programs: int = 512
    """Programs that a split from the shapes aims at."""
    min_tiles_per_split: int = 4
    """Tiles of `block_k` features per slice at least, in a split from the shapes."""
    sum_block: int = 1024
    """Outputs per program of the split-K epilogue launch."""
    # Summing in the last program saved 0.3-0.65 µs at keep 0.5 where the inputs split 4-8 ways (q|k|v,
    # o, down) and cost 1.9 µs on gate|up, which splits 2 ways over 896 programs (each pays its atomic,
    # for one launch saved).
    fuse_epilogue: bool = True
    """Whether the last program of each output block to finish sums the slices (an arrival counter,
    `kernels.scratch`), from `min_fused_split` slices up, instead of an epilogue launch."""
    min_fused_split: int = 3
    """Slices from which the epilogue is fused."""
    block_b: int = 16
    """Batch rows per program of the threshold and mask kernels at batch > 1 (a power of two, 16 at
    least: tl.dot's size). A program reads each weight row once for the union of its rows."""
    # 2: a single row through tl.dot measured 1.3-1.5x slower than the loop on every 8B group (H200),
    # despite Triton pipelining its weight tiles as dot operands.
    dot_from_rows: int = 2
    """Batch rows from which the scanning kernels take row blocks through tl.dot (`block_b` rows per
    program, the absent rows masked); 1 takes them for a single row too, whose weight tiles Triton
    then pipelines as tl.dot operands."""

    def __post_init__(self) -> None:
        _powers_of_two(self, "num_warps", "sum_block", "block_b")
        _powers_of_two(self, "block_n", "block_k", zero=True)
        _positive(self, "wide_d_out")
        if self.block_b < 16:
            raise ValueError(f"GemvConfig.block_b must be 16 at least (tl.dot's size), got {self.block_b}")
        _positive(self, "num_stages", "target_programs", "min_tiles_per_split", "min_fused_split", "dot_from_rows")
        _non_negative(self, "split")
        for name in ("fuse_epilogue", "prefetch", "tile_sum", "atomic_sum"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GemvConfig.{name} must be a bool, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PageScoreConfig:
    """Launch parameters of the Quest page bound (`page_score.py`). Over 8,192 pages (8 KV heads,
    GQA 4, D=128, bf16 summaries) tl.dot over 64 pages with 2 warps took 9.7 µs, the per-head loop
    10.2 µs at best (32 pages, 2 warps)."""

    METHODS: ClassVar[tuple[str, ...]] = ("dot", "loop")

    method: str = "dot"
    """``"dot"``: the bound's two dot products per page with tl.dot (head dims under 16, below its
    minimum, take the loop); ``"loop"``: the G query heads in turn over a tile held in registers."""
    block_p: int = 64
    """Pages per program (16 at least with tl.dot)."""
    num_warps: int = 2
    """Warps per program."""

    def __post_init__(self) -> None:
        _one_of(self, "method", self.METHODS)
        _powers_of_two(self, "block_p", "num_warps")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SketchScoreConfig:
    """Launch parameters of the key-sketch page bound (`page_score.sketch_page_bound`): a program
    holds ``block_p`` pages of codes."""

    METHODS: ClassVar[tuple[str, ...]] = ("sum", "dot", "keys")

    method: str = "sum"
    """``"sum"``: the products summed on CUDA cores; ``"dot"``: a batched tl.dot per page of the codes
    (fp16, exact) with the page's weights ``q·step`` in fp16, their rounding added back (pages of 16
    or more; smaller ones take the sum); ``"keys"``: the sketch's keys decoded in fp16 and one tl.dot
    of the program's tokens with the group's queries in fp16, the roundings' worst case added back
    (``block_p·page`` of 16 or more)."""
    block_p: int = 4
    """Pages per program."""
    num_warps: int = 4
    """Warps per program."""

    def __post_init__(self) -> None:
        _one_of(self, "method", self.METHODS)
        _powers_of_two(self, "block_p", "num_warps")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EntmaxThresholdConfig:
    """Launch parameters of the pooled Gaussian entmax threshold (`entmax_threshold.py`)."""

    block_p: int = 1024
    """Pages per block of a pass (registers per thread: block_p / (32·num_warps) pages); a shorter
    row takes one block of next_pow2(P) pages, 32 at least."""
    num_warps: int = 8
    """Warps for a full block; a smaller block takes one per 128 pages (1 at least)."""

    def __post_init__(self) -> None:
        _powers_of_two(self, "block_p", "num_warps")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatheredLogitsConfig:
    """Launch parameters of the exact logits of gathered keys (`gathered_logits.py`), the second
    stage of a two-stage page policy."""

    METHODS: ClassVar[tuple[str, ...]] = ("dot", "loop")

    method: str = "dot"
    """``"dot"``: the G query heads against a tile of keys with tl.dot (head dims under 16 take the
    loop); ``"loop"``: the heads in turn over the tile held in registers."""
    block_t: int = 64
    """Slots (key rows) per program (16 at least with tl.dot)."""
    num_warps: int = 4
    """Warps per program."""

    def __post_init__(self) -> None:
        _one_of(self, "method", self.METHODS)
        _powers_of_two(self, "block_t", "num_warps")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionEdgesConfig:
    """Launch parameters of the attention graph's edge search (`attention_edges.py`), a prefill-time
    kernel: a program takes ``block_q`` queries of one head against tiles of ``block_k`` keys."""

    block_q: int = 64
    """Queries per program (16 at least: tl.dot)."""
    block_k: int = 64
    """Keys per tile (16 at least: tl.dot)."""
    num_warps: int = 4
    """Warps per program."""
    num_stages: int = 2
    """Software pipeline stages of the key loop."""

    def __post_init__(self) -> None:
        _powers_of_two(self, "block_q", "block_k", "num_warps")
        _positive(self, "num_stages")
        if min(self.block_q, self.block_k) < 16:
            raise ValueError(f"AttentionEdgesConfig tiles must be 16 at least (tl.dot), got {self.block_q}x{self.block_k}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PageFetchConfig:
    """Launch parameters of the page fetch (`page_fetch.py`): copies of host pages into a page cache's
    device slots. The programs are persistent, each taking every ``programs``-th page of the list:
    on an H200, 32 programs reading pinned host pages in place drew 50 GB/s, the host link's rate."""

    programs: int = 32
    """Persistent programs (each copies one page at a time)."""
    num_warps: int = 4
    """Warps per program."""

    def __post_init__(self) -> None:
        _positive(self, "programs")
        _powers_of_two(self, "num_warps")


Config = (AttentionConfig | SelectTopConfig | GemvConfig | PageScoreConfig | SketchScoreConfig | EntmaxThresholdConfig
          | GatheredLogitsConfig | AttentionEdgesConfig | PageFetchConfig)
C = TypeVar("C", AttentionConfig, SelectTopConfig, GemvConfig, PageScoreConfig, SketchScoreConfig, EntmaxThresholdConfig,
            GatheredLogitsConfig, AttentionEdgesConfig, PageFetchConfig)

# The keyword of each kernel's config in `override` (and in the sweep's records).
KERNELS: Mapping[str, type] = MappingProxyType({
    "attention": AttentionConfig,
    "select_top": SelectTopConfig,
    "gemv": GemvConfig,
    "page_score": PageScoreConfig,
    "sketch_score": SketchScoreConfig,
    "entmax_threshold": EntmaxThresholdConfig,
    "gathered_logits": GatheredLogitsConfig,
    "attention_edges": AttentionEdgesConfig,
    "page_fetch": PageFetchConfig,
})

_DEFAULTS: Mapping[type, Config] = MappingProxyType({kind: kind() for kind in KERNELS.values()})
_OVERRIDES: contextvars.ContextVar[Mapping[type, Config]] = contextvars.ContextVar(
    "policyzoo_kernel_overrides", default=MappingProxyType({})
)


@contextmanager
def override(**configs: Config) -> Iterator[None]:
    """Launch the named kernels with these configs inside the ``with`` block (keywords: `KERNELS`),
    e.g. ``override(attention=AttentionConfig(block_t=128), select_top=SelectTopConfig(method="program"))``.

    Each config replaces that kernel's config as given (see the module docstring); its fields that
    leave a choice to the shapes are still filled in per call by the kernel's shape rule."""
    for name, cfg in configs.items():
        kind = KERNELS.get(name)
        if kind is None:
            raise TypeError(f"override() got an unknown kernel {name!r}; known: {', '.join(KERNELS)}")
        if type(cfg) is not kind:
            raise TypeError(f"override({name}=...) takes a {kind.__name__}, got {type(cfg).__name__}")
    merged = {**_OVERRIDES.get(), **{type(cfg): cfg for cfg in configs.values()}}
    token = _OVERRIDES.set(MappingProxyType(merged))
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


def current(kind: type[C]) -> C:
    """The config in force for the kernel of config class ``kind``: the innermost override's, else
    the defaults, ``kind()``."""
    return _OVERRIDES.get().get(kind) or _DEFAULTS[kind]


def active() -> dict[str, Config]:
    """The overrides in force, by kernel (`KERNELS`); kernels at their defaults are left out."""
    overrides = _OVERRIDES.get()
    return {name: overrides[kind] for name, kind in KERNELS.items() if kind in overrides}


__all__ = [
    "AttentionConfig",
    "SelectTopConfig",
    "GemvConfig",
    "PageScoreConfig",
    "EntmaxThresholdConfig",
    "GatheredLogitsConfig",
    "AttentionEdgesConfig",
    "PageFetchConfig",
    "KERNELS",
    "override",
    "current",
    "active",
]

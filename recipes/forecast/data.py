"""The training text: loading, chunking, the held-out split and each chunk's query positions."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from policyzoo import assets

from .errors import UsageError
from .geometry import Geometry

MIN_BLOCKS = 4  # query positions start this many blocks into a chunk: fewer leaves no candidates
# Blocks of query positions a chunk must offer after those: at 4 blocks of context a query has one or
# two blocks to choose among (the sinks' block and the window's are forced), and a chunk of exactly
# MIN_BLOCKS blocks has one query position, which trains nothing.
MIN_QUERY_BLOCKS = 4


def load_texts(dataset: str | None, config: str | None, split: str, column: str):
    """A `datasets.Dataset` with the text in ``column``: the embedded essays (one document; no
    network) unless ``dataset`` names one for `datasets.load_dataset`."""
    from datasets import Dataset, load_dataset

    if dataset is None:
        return Dataset.from_dict({column: [assets.essays_text()]})
    texts = load_dataset(dataset, config, split=split)
    if column not in texts.column_names:
        raise UsageError(f"--text-column: the dataset {dataset!r} has no column {column!r} (it has {', '.join(texts.column_names)})")
    return texts


def make_chunks(texts: Any, tokenizer: Any, column: str, seq_len: int, max_chunks: int | None = None):
    """The texts tokenised (`Dataset.map`), documents joined by the EOS token, cut into chunks of
    ``seq_len`` tokens (the tail shorter than a chunk is dropped): a `Dataset` with ``input_ids``."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def tokenize(batch: dict) -> dict:
        return {"input_ids": [tokenizer(t, add_special_tokens=False).input_ids + eos for t in batch[column]]}

    def group(batch: dict) -> dict:
        ids = [t for doc in batch["input_ids"] for t in doc]
        n = len(ids) // seq_len * seq_len
        return {"input_ids": [ids[i : i + seq_len] for i in range(0, n, seq_len)]}

    tokens = texts.map(tokenize, batched=True, remove_columns=texts.column_names, desc="tokenize")
    chunks = tokens.map(group, batched=True, desc=f"chunks of {seq_len}")
    if max_chunks is not None and len(chunks) > max_chunks:
        chunks = chunks.select(range(max_chunks))
    return chunks


def split_holdout(n_chunks: int, fraction: float) -> tuple[list[int], list[int]]:
    """Training and held-out chunk indices: the last ``fraction`` of the chunks (at least one) are
    held out, so evaluation reads text the heads never saw."""
    held = max(1, round(n_chunks * fraction))
    if n_chunks - held < 1:
        raise UsageError(f"--holdout {fraction} of {n_chunks} chunk(s) leaves no training chunk (more text, a shorter --seq-len or a smaller --holdout)")
    return list(range(n_chunks - held)), list(range(n_chunks - held, n_chunks))


def draw_positions(seq_len: int, count: int, geo: Geometry, generator: torch.Generator) -> tuple[Tensor, int]:
    """``(positions int64[P], offset)`` of one chunk: ``count`` query positions drawn uniformly
    without replacement among those with at least `MIN_BLOCKS` blocks of context (earlier ones have
    almost nothing to choose), sorted; and the chunk's slot offset, uniform in ``[0, block)``."""
    first = MIN_BLOCKS * geo.block - 1
    pool = torch.arange(first, seq_len)
    take = torch.randperm(len(pool), generator=generator)[: min(count, len(pool))]
    offset = int(torch.randint(geo.block, (), generator=generator))
    return pool[take].sort().values, offset

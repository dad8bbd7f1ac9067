"""Examples: what training and evaluation keep of one captured chunk, and the store that keeps
them in memory across epochs (or rebuilds them)."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .capture import capture
from .data import draw_positions
from .geometry import Geometry
from .objective import candidate_blocks, oracle_scores, slot_page_means, teacher_distribution


@dataclass
class Example:
    """What training and evaluation need of one chunk at its sampled positions (CPU tensors):
    small enough to keep in memory across epochs (the model is frozen, so it never changes)."""

    inputs: Tensor  # [L, P, d]: head i's input, the hidden state entering layer max(i - 1, 0)
    rotary: tuple[Tensor, Tensor] | None  # [P, D_rot]
    means: Tensor  # [L, H_kv, pages, D]
    counts: Tensor  # [pages]
    scales: Tensor  # [L]: the selecting layer's softmax scale, as `Forecast.scores` reads it
    teacher: Tensor  # [L, P, H_kv, NB]
    candidates: Tensor  # [P, NB]
    positions: Tensor  # [P]
    offset: int
    oracle: Tensor  # [L, P, H_kv, NB]: block scores of the layer's own queries (`oracle_scores`)

    def nbytes(self) -> int:
        parts = [self.inputs, self.means, self.counts, self.scales, self.teacher, self.candidates, self.positions, self.oracle]
        parts += list(self.rotary or ())
        return sum(t.numel() * t.element_size() for t in parts)


def make_example(model: nn.Module, ids: Tensor, positions: Tensor, offset: int, geo: Geometry) -> Example:
    """Capture the chunk ``ids [T]`` and build its `Example` at ``positions`` with slot ``offset``."""
    cap = capture(model, ids)
    n = cap.hidden.shape[0]
    below = [max(i - 1, 0) for i in range(n)]  # head i reads the hidden state entering layer i - 1
    inputs = cap.hidden[below][:, positions]
    rotary = None if cap.rotary is None else (cap.rotary[0][positions], cap.rotary[1][positions])
    means, counts = slot_page_means(cap.keys, offset, geo.stride)
    teacher = torch.stack([teacher_distribution(cap.queries[i][:, positions], cap.keys[i], positions, cap.scales[i], geo, offset) for i in range(n)])
    candidates = candidate_blocks(positions, teacher.shape[-1], geo, offset)
    scales = torch.tensor([cap.scales[b] for b in below])
    oracle = oracle_scores(cap.queries[:, :, positions], means, counts, scales, geo)
    return Example(inputs, rotary, means, counts, scales, teacher, candidates, positions, offset, oracle)


class ExampleStore:
    """Examples by chunk index, kept in memory up to ``max_bytes`` and rebuilt (the same positions
    and offset: they are drawn from the chunk's own seed) when they did not fit."""

    def __init__(self, model: nn.Module, chunks: Any, args: argparse.Namespace, geo: Geometry, max_bytes: int) -> None:
        self.model, self.chunks, self.args, self.geo, self.max_bytes = model, chunks, args, geo, max_bytes
        self.kept: dict[int, Example] = {}
        self.bytes = 0
        self.built = 0
        self.build_s = 0.0

    def __getitem__(self, index: int) -> Example:
        if index in self.kept:
            return self.kept[index]
        start = time.perf_counter()
        g = torch.Generator().manual_seed(self.args.seed * 1_000_003 + index)
        ids = torch.tensor(self.chunks[index]["input_ids"], dtype=torch.long)
        positions, offset = draw_positions(len(ids), self.args.positions, self.geo, g)
        example = make_example(self.model, ids, positions, offset, self.geo)
        self.built += 1
        self.build_s += time.perf_counter() - start
        if self.bytes + example.nbytes() <= self.max_bytes:
            self.kept[index] = example
            self.bytes += example.nbytes()
        return example

"""Random decode states for timing: a step's speed does not depend on the keys' values at a fixed
budget, so benchmarks and gate calibration time steps over random keys and values instead of a
prefilled prompt (a 1M-token prefill takes minutes; filling takes a second)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .session import DecodeSession


class RandomPrefix(Sequence[tuple[Tensor, ...]]):
    """``n`` random keys and values per row for each layer of ``session``'s model, made as each layer
    is read (one layer in memory at a time), with random queries for a policy that builds state in
    a prefill of its own (`DecodeSession.needs_own_prefill`). Drawn in the model's dtype: a float32
    draw and its copy would be 24 GiB at 1M tokens on an 8B model."""

    def __init__(self, session: "DecodeSession", n: int, batch: int, generator: torch.Generator | None = None) -> None:
        self.session, self.n, self.batch, self.generator = session, n, batch, generator
        self.queries = session.needs_own_prefill()

    def __len__(self) -> int:
        return self.session.num_layers

    def __getitem__(self, layer: int) -> tuple[Tensor, ...]:  # type: ignore[override]
        if not 0 <= layer < len(self):
            raise IndexError(layer)
        s = self.session

        def draw(heads: int) -> Tensor:
            return torch.randn((self.batch, heads, self.n, s.head_dim), generator=self.generator, device=s.device, dtype=s.dtype)

        kv = (draw(s.num_kv_heads), draw(s.num_kv_heads))
        return (*kv, draw(s.num_heads)) if self.queries else kv


@torch.no_grad()
def fill_random(
    session: "DecodeSession", n: int, *, batch: int = 1, capacity: int | None = None, generator: torch.Generator | None = None
) -> None:
    """Start a sequence batch on ``session`` of ``n`` random keys and values per row, summaries
    included, in a cache of exactly ``capacity`` tokens (default ``n + 64``): the kernels' grids
    follow the capacity (empty pages still cost programs), so a short context timed on a cache left
    by a longer one would read slow. A policy that builds state in its own prefill gets it from
    random queries.

    The next step decodes a random token id of each row (not 0): a step's speed does depend on its
    activations where a projection sparsifier keeps inputs by magnitude, and token 0 is often a
    padding id whose embedding is zero (the sparsifiers would keep nothing, and the greedy choice
    of a zero state is token 0 again)."""
    capacity = capacity if capacity is not None else n + 64
    if capacity < n:
        raise ValueError(f"capacity ({capacity}) must hold the {n} filled tokens")
    start = torch.zeros(batch, dtype=torch.long, device=session.device)
    session.load_prefix(RandomPrefix(session, n, batch, generator), start, capacity=capacity, exact=True, slot=0)
    tokens = torch.randint(1, max(session.vocab_size - 1, 2), (batch,), generator=generator,
                           device=generator.device if generator is not None else "cpu")
    session.feed(tokens.to(session.device))


__all__ = ["RandomPrefix", "fill_random"]

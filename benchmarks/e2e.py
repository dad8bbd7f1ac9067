"""End-to-end decode speed: `Decoder.generate` as a user calls it, beside its compiled step alone.

A user's `generate` has an EOS id set and a streamer attached; the figure is the per-token time
between the streamer's deliveries, after the first few (the prefill and the pipeline's start are
excluded). Beside it, the same session's step timed alone (`DecodeSession.time_step`: CUDA events,
no host in the loop) at the same context. When `generate` keeps up with the device, the two agree.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from policyzoo import Decoder

SKIP = 4  # deliveries left out at the start: the prefill, and steps enqueued before the first read


@dataclass
class StampStreamer:
    """An HF-protocol streamer that records when each ``put`` arrives (the first is the prompt)."""

    times: list[float] = field(default_factory=list)
    tokens: int = 0
    ended: bool = False

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())
        self.tokens += 1

    def end(self) -> None:
        self.ended = True


@dataclass(frozen=True)
class GenerateTiming:
    """Per-token milliseconds of one `generate` call, from its streamer's timestamps."""

    mean_ms: float  # (last delivery - delivery SKIP) / steps between them
    median_ms: float  # median gap between consecutive deliveries after SKIP
    tokens: int  # new tokens delivered (fewer than asked if every row hit the EOS id)
    wall_s: float  # the whole call, prefill included


def time_generate(dec: Decoder, input_ids: torch.Tensor, new_tokens: int, eos_token_id: int) -> GenerateTiming:
    """Run ``dec.generate`` once with ``eos_token_id`` and a `StampStreamer`, and time its tokens."""
    if new_tokens <= SKIP + 2:
        raise ValueError(f"new_tokens must exceed {SKIP + 2} to leave steps to time")
    streamer = StampStreamer()
    t0 = time.perf_counter()
    dec.generate(input_ids, new_tokens, streamer=streamer, eos_token_id=eos_token_id)
    wall = time.perf_counter() - t0
    stamps = streamer.times[1:]  # the first put is the prompt, before the prefill
    steady = stamps[SKIP:]
    if len(steady) < 2:
        raise RuntimeError(f"generate stopped after {len(stamps)} tokens (the EOS id came early): nothing to time")
    gaps = [b - a for a, b in zip(steady, steady[1:])]
    mean = (steady[-1] - steady[0]) / (len(steady) - 1)
    return GenerateTiming(mean * 1e3, statistics.median(gaps) * 1e3, len(stamps), wall)


def random_prompt(batch: int, context: int, vocab: int, device: str | torch.device, seed: int = 0) -> torch.Tensor:
    """``int64[batch, context]`` random token ids in ``[1, vocab - 1)`` (the last id is kept for EOS)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(1, vocab - 1, (batch, context), generator=g).to(device)


def measure(dec: Decoder, batch: int, context: int, new_tokens: int = 64, step_calls: int = 20, step_reps: int = 10) -> dict:
    """One row: `generate` per-token time (a first call compiles and captures, a second is timed),
    then the compiled step alone at the same context, and their ratio."""
    vocab = dec.session.vocab_size
    ids = random_prompt(batch, context, vocab, dec.device)
    eos = vocab - 1  # set, as chat users set it; the prompt never holds it
    t0 = time.perf_counter()
    dec.generate(ids, new_tokens, eos_token_id=eos)  # compile, warm up, capture
    setup_s = time.perf_counter() - t0
    gen = time_generate(dec, ids, new_tokens, eos)
    step_ms = dec.session.time_step(calls=step_calls, reps=step_reps)
    return {
        "generate_ms": gen.mean_ms,
        "generate_median_ms": gen.median_ms,
        "step_ms": step_ms,
        "generate/step": gen.mean_ms / step_ms,
        "tokens": gen.tokens,
        "generate_wall_s": gen.wall_s,
        "setup_s": setup_s,
    }

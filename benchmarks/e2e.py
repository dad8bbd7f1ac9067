"""End-to-end decode speed: `Decoder.generate` as a user calls it, beside its compiled step alone.

A user's `generate` has an EOS id set and a streamer attached; the figure is the per-token time
between the streamer's deliveries, after the first few (the prefill and the pipeline's start are
excluded). Beside it, the same session's step timed alone (`timing.time_step`: CUDA events,
no host in the loop) at the same context. When `generate` keeps up with the device, the two agree.
"""

from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from policyzoo import Decoder
from policyzoo.compiled import CompileFallbackWarning
from policyzoo.decoder import dynamic_capacity_refused
from policyzoo.timing import time_step

SKIP = 4  # deliveries left out at the start: the prefill, and steps enqueued before the first read


@dataclass
class StampStreamer:
    """An HF-protocol streamer that records when each ``put`` arrives (the first is the prompt).
    With ``announce``, it reports the first new token's arrival as it happens: the prefill is then
    over, so a long setup shows whether the prefill or the compile takes the time."""

    times: list[float] = field(default_factory=list)
    tokens: int = 0
    ended: bool = False
    announce: Callable[[str], None] | None = None

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())
        self.tokens += 1
        if self.announce is not None and self.tokens == 2:
            self.announce(f"first token {self.times[1] - self.times[0]:.1f} s after the prompt (the prefill)")

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


def measure(dec: Decoder, batch: int, context: int, new_tokens: int = 64, step_calls: int = 20, step_reps: int = 10,
            log: Callable[[str], None] | None = None) -> dict:
    """One row: `generate` per-token time (a first call compiles and captures, a second is timed),
    then the compiled step alone at the same context, and their ratio. ``log`` gets a line as the
    set-up call starts and as its prefill ends (``prefill_s`` in the row). ``fallbacks``: the
    `CompileFallbackWarning`s raised meanwhile (a compiled step that runs parts eagerly is not the
    step users get), the first one's text in ``fallback``."""
    vocab = dec.session.vocab_size
    ids = random_prompt(batch, context, vocab, dec.device)
    eos = vocab - 1  # set, as chat users set it; the prompt never holds it
    if log is not None:
        log(f"set-up generate (prefill, compile, warm-up, capture) at context {context}, batch {batch}")
    setup = StampStreamer(announce=log)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CompileFallbackWarning)
        t0 = time.perf_counter()
        dec.generate(ids, new_tokens, streamer=setup, eos_token_id=eos)  # compile, warm up, capture
        setup_s = time.perf_counter() - t0
        prefill_s = setup.times[1] - t0 if len(setup.times) > 1 else float("nan")
        gen = time_generate(dec, ids, new_tokens, eos)
        dec.session.rewind(context)  # the step alone from the prompt's end, in the room generate had
        step_ms = time_step(dec.session, calls=min(step_calls, new_tokens - 1), reps=step_reps)
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, CompileFallbackWarning)]
    for w in caught:  # the others as they would have been shown
        if not issubclass(w.category, CompileFallbackWarning):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    for text in fallbacks:
        warnings.warn(text, CompileFallbackWarning, stacklevel=2)
    return {
        "fallbacks": len(fallbacks),
        **({"fallback": fallbacks[0][:300]} if fallbacks else {}),
        "generate_ms": gen.mean_ms,
        "generate_median_ms": gen.median_ms,
        "step_ms": step_ms,
        "generate/step": gen.mean_ms / step_ms,
        "tokens": gen.tokens,
        "generate_wall_s": gen.wall_s,
        "setup_s": setup_s,
        "prefill_s": prefill_s,
    }


def check_generate(make: Callable[[], Decoder], batch: int = 3, context: int = 200, new_tokens: int = 24) -> dict:
    """Correctness of the fast `generate` on the device: a compiled Decoder (CUDA-graph replays, the
    token outbox) against an eager one on a left-padded batch whose rows stop at an EOS id at
    different steps, greedy and sampled with a seeded generator. ``make()`` builds a Decoder.

    Tokens are compared exactly, but a compiled step's fused kernels round differently from the eager
    ones, so on bf16 weights a near-tie can flip a token: ``logit_err`` (the largest difference of
    first decode step's logits, relative to their spread) says whether a mismatch is rounding. Each
    call of ``make`` must wrap a model of its own (a Decoder takes over the model it wraps). A third
    Decoder compiled with a dynamic cache capacity (as the sweep's `generate` section compiles) must
    give the static build's tokens (None where it cannot be built: two-stage policies on CUDA)."""
    eager, compiled = make(), make().compile()
    device = eager.device

    def run(dec: Decoder, **kwargs) -> torch.Tensor:
        if dec.kv is not None:  # a sampling policy (SSA): each request from the same stream
            dec.kv.reset_random()
        return dec.generate(ids, new_tokens, **kwargs)

    ids = random_prompt(batch, context, eager.session.vocab_size, device, seed=1)
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, : row * 37] = 0  # left padding, not a multiple of the page size
    free = run(eager, attention_mask=mask)
    eos = [int(free[row, context + 3 + 4 * row]) for row in range(batch)]  # rows end at different steps
    kwargs = dict(attention_mask=mask, eos_token_id=eos, pad_token_id=0, output_logits=True)
    want, want_logits = run(eager, **kwargs)
    first, first_logits = run(compiled, **kwargs)  # compiles, warms up, captures
    again, _ = run(compiled, **kwargs)  # replays
    dynamic = None if dynamic_capacity_refused(eager) else run(make().compile(dynamic_capacity=True), **kwargs)[0]
    sample = dict(attention_mask=mask, do_sample=True, temperature=0.8, top_p=0.9)
    s_eager = run(eager, generator=torch.Generator(device=device).manual_seed(3), **sample)
    s1 = run(compiled, generator=torch.Generator(device=device).manual_seed(3), **sample)
    s2 = run(compiled, generator=torch.Generator(device=device).manual_seed(3), **sample)
    spread = want_logits[:, 1].float().std().item()  # index 0: the prefill's, eager in both
    err = (first_logits[:, 1].float() - want_logits[:, 1].float()).abs().max().item() / spread
    return {
        "same_tokens_as_eager": bool(torch.equal(first, want)),
        "same_on_replay": bool(torch.equal(first, again)),
        "dynamic_same_as_static": None if dynamic is None else bool(torch.equal(first, dynamic)),
        "sampling_reproducible": bool(torch.equal(s1, s2)),
        "sampled_same_as_eager": bool(torch.equal(s1, s_eager)),
        "stopped_early": first.shape[1] < context + new_tokens,
        "logit_err": err,
    }

"""Choosing the next token, on the device, inside the compiled decode step.

`Sampler` holds the per-request generation settings as device tensors (temperature, nucleus mass,
the end-of-sequence ids as a mask over the vocabulary, the pad id) and each row's finished flag, so
a compiled step reads them without guarding on Python numbers and a captured CUDA graph replays
with any request's settings. `next_tokens` is the one function that turns logits into tokens, in
eager and compiled steps alike.

Sampling is the exponential race: ``argmax_i p_i / E_i`` with ``E_i ~ Exp(1)`` i.i.d. draws the
index ``i`` with probability ``p_i``, exactly as a multinomial draw does. The draws (``noise``) are
made before each step from the request's generator (`Sampler.draw`), outside the compiled region:
the tokens then depend only on the generator's seed, whether the step runs eagerly, compiled or as a
CUDA-graph replay.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingMode:
    """The Python-level shape of the sampling code: a compiled step specialises on it (two
    requests with the same mode share a compiled step and CUDA graph; their temperatures, nucleus
    masses, EOS ids and pad ids are tensors)."""

    do_sample: bool = False
    nucleus: bool = False  # top_p < 1


class Sampler:
    """Device tensors of one batch: generation settings and each row's finished flag."""

    def __init__(self, batch: int, vocab: int, device: torch.device | str) -> None:
        self.batch, self.vocab = batch, vocab
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.eos = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.pad = torch.zeros((), dtype=torch.long, device=device)
        self.temperature = torch.ones((), dtype=torch.float32, device=device)
        self.top_p = torch.ones((), dtype=torch.float32, device=device)
        self.noise = torch.ones(batch, vocab, dtype=torch.float32, device=device)
        # The last choice for the host: the tokens, then whether every row has finished (one copy).
        self.report = torch.zeros(batch + 1, dtype=torch.long, device=device)
        self.mode = SamplingMode()
        self.generator: torch.Generator | None = None
        if self.finished.device.type == "cuda":
            for t in self.tensors():
                torch._dynamo.mark_static_address(t)

    def tensors(self) -> list[Tensor]:
        return [self.finished, self.eos, self.pad, self.temperature, self.top_p, self.noise, self.report]

    def configure(
        self,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        eos: list[int] = (),  # type: ignore[assignment]
        pad: int = 0,
        generator: torch.Generator | None = None,
    ) -> None:
        """Set a request's settings (in place) and clear the finished flags."""
        check_settings(do_sample=do_sample, temperature=temperature, top_p=top_p, generator=generator, device=self.noise.device)
        if not isinstance(eos, (list, tuple)) or not all(is_token(i) for i in eos):
            raise TypeError(f"eos_token_id must be a list of ints, got {eos!r}")
        bad = [i for i in eos if not 0 <= i < self.vocab]
        if bad:
            raise ValueError(f"eos_token_id {bad[0]} is outside the vocabulary (0..{self.vocab - 1})")
        if not is_token(pad):
            raise TypeError(f"pad_token_id must be an int, got {pad!r}")
        if not 0 <= pad < self.vocab:
            raise ValueError(f"pad_token_id {pad} is outside the vocabulary (0..{self.vocab - 1})")
        self.mode = SamplingMode(do_sample=do_sample, nucleus=do_sample and top_p < 1.0)
        f32 = torch.finfo(torch.float32)
        self.temperature.fill_(float(min(temperature, f32.max)))  # beyond it: uniform all the same
        self.top_p.fill_(float(max(top_p, f32.tiny)))  # not 0 in fp32: the nucleus keeps the top token
        self.eos.zero_()
        if eos:
            self.eos[torch.tensor(list(eos), device=self.eos.device)] = True
        self.pad.fill_(pad)
        self.finished.zero_()
        self.generator = generator

    def draw(self) -> None:
        """Fresh exponential draws for the next token choice (sampling only; eager, outside the
        compiled step, from the request's generator)."""
        if self.mode.do_sample:
            self.noise.exponential_(generator=self.generator)

    def choose(self, logits: Tensor) -> Tensor:
        """The next token of every row from ``logits [B, V]`` (`next_tokens`); finished rows get the
        pad id, and rows that choose an EOS id are finished from now on (in place). ``report``
        receives the tokens and whether all rows have finished."""
        token = next_tokens(logits, self.noise, self.temperature, self.top_p, self.mode)
        token = torch.where(self.finished, self.pad, token)
        self.finished |= self.eos[token]
        self.report[:-1] = token
        self.report[-1] = self.finished.all()
        return token


def check_settings(
    *, do_sample: object, temperature: object, top_p: object, generator: object, device: torch.device | str
) -> None:
    """Raise a `TypeError` or `ValueError` naming the argument unless the sampling settings are valid:
    a bool ``do_sample``, a finite ``temperature > 0``, ``top_p`` in (0, 1], and ``generator`` None or
    a `torch.Generator` for ``device``'s type (the draws are made on the device). Greedy decoding
    (``do_sample=False``) reads neither ``temperature`` nor ``top_p``, so there ``temperature=0`` and
    ``top_p=0`` are accepted too, as Hugging Face's ``generate`` accepts them."""
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be a bool, got {do_sample!r}")
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    # Greedy decoding reads neither, so the values that mean "no sampling" elsewhere pass there too.
    low = 0 <= temperature if not do_sample else 0 < temperature  # type: ignore[operator]
    if not (low and temperature < math.inf):  # type: ignore[operator]
        raise ValueError(f"temperature must be a {'positive' if do_sample else 'non-negative'} finite number, got {temperature}")
    if not (0.0 <= top_p <= 1.0 if not do_sample else 0.0 < top_p <= 1.0):  # type: ignore[operator]
        raise ValueError(f"top_p must be in {'(0, 1]' if do_sample else '[0, 1]'}, got {top_p}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator is not None and generator.device.type != torch.device(device).type:
        raise ValueError(f"generator is on {generator.device} but the model is on {device}")


def is_token(value: object) -> bool:
    """An int token id (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def next_tokens(logits: Tensor, noise: Tensor, temperature: Tensor, top_p: Tensor, mode: SamplingMode) -> Tensor:
    """``int64[B]``: greedy argmax, or a draw from ``softmax(logits / temperature)`` restricted to
    the nucleus of mass ``top_p`` (the smallest set of top tokens whose mass reaches it; the top
    token always stays), by the exponential race over ``noise [B, V]`` (``Exp(1)`` draws).

    Greedy ties go to the lowest index, as `torch.argmax`'s (`first_argmax`)."""
    if not mode.do_sample:
        return first_argmax(logits)
    logits = logits.float() / temperature
    if mode.nucleus:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        p = torch.softmax(sorted_logits, dim=-1)
        drop = p.cumsum(-1) - p >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -torch.inf))
    probs = torch.softmax(logits, dim=-1)
    return first_argmax(probs / noise.clamp(min=1e-30))  # a draw of exactly 0 must not make 0/0


# Entries per chunk of `first_argmax`'s first stage: a vocabulary of 128K becomes 32 chunks.
ARGMAX_CHUNK = 4096


def first_argmax(x: Tensor, chunk: int = ARGMAX_CHUNK) -> Tensor:
    """``int64[B]``: ``x.argmax(-1)`` of ``x [B, V]`` (ties to the lowest index) in two stages: the
    first maximum of each chunk of ``chunk`` entries, then the first chunk that holds the row's
    maximum. Inductor reduces an argmax over a row with one program (it splits sums and maxima over
    long rows, not index reductions), which on a vocabulary of 128K takes tens of microseconds at
    batch 1; as chunks the first stage takes one program per chunk."""
    b, v = x.shape
    n = -(-v // chunk)
    if n == 1:
        return x.argmax(-1)
    padded = torch.nn.functional.pad(x, (0, n * chunk - v), value=-math.inf)
    best, where = padded.view(b, n, chunk).max(-1)  # each chunk's first maximum
    first = best.argmax(-1, keepdim=True)  # the first chunk holding the row's maximum
    return (first * chunk + where.gather(-1, first)).squeeze(-1)

"""`TokenOutbox`: generated tokens on their way to the host, without a host sync per step.

After each step the device's report (the chosen tokens and whether every row has finished,
`sampling.Sampler.report`) is copied without blocking into pinned host memory, and a CUDA event
marks the copy. The host reads a step only once its event has completed, ``in_flight`` steps behind
the one it just enqueued, so the device always has the next step queued while the host feeds the
streamer and checks for the end: the host never waits for a step it does not need yet. The first
step whose report says every row has finished is the last one kept; steps enqueued after it are
dropped, so the caller sees exactly the tokens of a synchronous loop that stops there.

On the CPU every copy is synchronous and a step is read as soon as it is pushed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class TokenOutbox:
    """Reports of up to ``steps`` decode steps of ``batch`` rows, delivered in order to ``streamer``
    (the HF streamer protocol: ``put(tokens)`` per step; the caller sends the prompt and ``end``)
    and ``on_token`` (a callback per delivered step, e.g. a progress bar)."""

    def __init__(self, batch: int, steps: int, device: torch.device, streamer: Any = None, on_token: Any = None, in_flight: int = 2) -> None:
        self.batch, self.steps, self.in_flight = batch, steps, in_flight
        self.cuda = device.type == "cuda"
        self.host = torch.zeros(steps, batch + 1, dtype=torch.long, pin_memory=self.cuda)
        self.events = [torch.cuda.Event() for _ in range(in_flight + 1)] if self.cuda else []
        self.streamer, self.on_token = streamer, on_token
        self.pushed = 0  # steps whose report was sent to the host
        self.delivered = 0  # steps read and handed on
        self.finished = False  # a delivered step had every row finished: nothing after it counts

    def push(self, report: Tensor) -> None:
        """Send one step's report (``int64[batch + 1]`` on the device) to the host, without blocking."""
        if self.pushed >= self.steps:
            raise RuntimeError(f"outbox holds {self.steps} steps")
        self.host[self.pushed].copy_(report, non_blocking=self.cuda)
        if self.cuda:
            self.events[self.pushed % len(self.events)].record()
        self.pushed += 1

    def collect(self, upto: int) -> bool:
        """Deliver every step up to index ``upto`` (waiting for each), and later ones already
        complete; returns whether generation is over (a delivered step finished every row)."""
        while not self.finished and self.delivered < self.pushed:
            if self.delivered > upto and self.cuda and not self.events[self.delivered % len(self.events)].query():
                break
            if self.cuda:
                self.events[self.delivered % len(self.events)].synchronize()
            row = self.host[self.delivered]
            self.delivered += 1
            if self.streamer is not None:
                self.streamer.put(row[: self.batch].clone())
            if self.on_token is not None:
                self.on_token()
            self.finished = bool(row[self.batch])
        return self.finished

    def ready_for_next(self) -> bool:
        """Before enqueuing another step: deliver what is due (the host stays at most `in_flight`
        steps ahead of what it has read) and say whether another step is wanted."""
        # Also frees the ring's slot of the next step: its last user, `in_flight + 1` steps back, is read.
        return not self.collect(self.pushed - 1 - self.in_flight)

    def tokens(self) -> Tensor:
        """Every delivered step's tokens, ``int64[batch, delivered]`` on the CPU (call `collect`
        with the last index first)."""
        return self.host[: self.delivered, : self.batch].t()

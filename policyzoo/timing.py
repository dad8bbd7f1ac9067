"""One timer for every measurement the library takes (gate calibration, benchmarks).

On CUDA, device time between CUDA events after warm-up (the host's enqueue time is not in it
unless the device waits for the host); elsewhere, wall-clock time. A figure is the median over
``reps`` of the mean time of ``calls`` back-to-back calls.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from .session import DecodeSession


def time_ms(
    fn: Callable[[], object],
    *,
    calls: int = 10,
    reps: int = 15,
    warmup: int = 3,
    setup: Callable[[], object] | None = None,
    device: torch.device | str | None = None,
) -> float:
    """Milliseconds per call of ``fn``: the median over ``reps`` of the mean of ``calls`` calls,
    after ``warmup`` calls. ``setup`` runs before the warm-up and before each rep, untimed (a
    decode benchmark rewinds its cache there). ``device`` (default: CUDA when available) picks CUDA
    events or the wall clock."""
    for name, value, low in (("calls", calls, 1), ("reps", reps, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
    if setup is not None:
        setup()
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(times)


def time_step(session: "DecodeSession", *, calls: int = 8, reps: int = 3, warmup: int = 2, rewind: bool = True) -> float:
    """Milliseconds per decode step of ``session`` at its current context, the step as `generate`
    runs it (compiled and replayed when the session is compiled), by `time_ms`: the median over
    ``reps`` of ``calls`` steps, every rep from the current length, or with ``rewind=False`` each rep
    going on from the last (the context grows by the steps taken; offload's page caches then see
    consecutive steps, as in generation, not the same steps again). A compiled session first takes
    the steps that compile and capture it."""
    from .compiled import WARMUP_STEPS

    cache = session.cache
    if cache is None:
        raise RuntimeError("no sequence batch: call prefill(), load_prefix() or synthetic.fill_random() first")
    length = int(cache.length)
    if session.compiled:
        warmup = max(warmup, WARMUP_STEPS + 1)
    steps = max(calls, warmup) if rewind else warmup + calls * reps
    if length + steps > cache.capacity:
        raise ValueError(f"the cache holds {cache.capacity} tokens: no room for {steps} steps after {length}")
    setup = (lambda: session.rewind(length)) if rewind else None
    return time_ms(session.step, calls=calls, reps=reps, warmup=warmup, setup=setup, device=session.device)

"""Worker processes for a policy's CPU work (`CommunityKV` builds and partitions its graphs there).

The session owns one `Workers` and hands it to every layer's `KVState` (``state.workers``), as it
hands the kernels' `Workspace`; a policy asks it for an executor of the size it wants. The processes
start at the first request for more than one, are kept for later prompts, and end when the session
retires (`close`) or is collected. A policy stays a plain configuration: copying or pickling it
carries no processes.
"""

from __future__ import annotations

import os
import weakref
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from typing import Any, Callable

import torch


class Inline(Executor):
    """Runs each job at once, in this process."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        future.set_result(fn(*args, **kwargs))
        return future


INLINE = Inline()


def cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Workers:
    """A pool of worker processes, started when first asked for, one torch thread each.

    ``executor(n)`` returns this process (`INLINE`) for ``n <= 1``, else a pool of ``n`` processes
    (a pool of another size is shut down and replaced). Processes are spawned, not forked: the
    parent may hold CUDA; tensors travel through shared memory.
    """

    def __init__(self) -> None:
        self._size = 0
        self._pool: ProcessPoolExecutor | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def size(self) -> int:
        """Processes running now (0: none started)."""
        return self._size

    def executor(self, size: int) -> Executor:
        if size <= 1:
            return INLINE
        if self._pool is None or self._size != size:
            self.close()
            context = torch.multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(size, mp_context=context, initializer=torch.set_num_threads, initargs=(1,))
            self._size = size
            self._finalizer = weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
        return self._pool

    def close(self) -> None:
        """End the processes (pending jobs are cancelled); a later `executor` starts new ones."""
        if self._finalizer is not None:
            self._finalizer()
        self._pool, self._finalizer, self._size = None, None, 0


__all__ = ["INLINE", "Inline", "Workers", "cpus"]

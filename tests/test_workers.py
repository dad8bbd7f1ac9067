"""`Workers`: the session's worker processes for a policy's CPU work. One process is this process;
more are spawned when first asked for, kept for the next request of the same size, replaced for
another size, and ended by `close` (a later request starts new ones)."""

from __future__ import annotations

import os

from policyzoo.workers import INLINE, Workers, cpus


def test_one_worker_is_this_process_and_runs_a_job_at_once():
    workers = Workers()
    assert workers.executor(1) is INLINE and workers.executor(0) is INLINE and workers.size == 0
    assert INLINE.submit(lambda a, b: a + b, 2, b=3).result() == 5
    assert cpus() >= 1


def test_a_pool_is_kept_for_its_size_replaced_for_another_and_closed():
    workers = Workers()
    pool = workers.executor(2)
    assert workers.size == 2 and workers.executor(2) is pool  # kept for the next prompt
    pids = {pool.submit(os.getpid).result() for _ in range(4)}
    assert os.getpid() not in pids  # the jobs ran in other processes
    workers.close()
    assert workers.size == 0
    fresh = workers.executor(2)
    assert fresh is not pool and fresh.submit(abs, -3).result() == 3
    workers.close()
    workers.close()  # closing twice is harmless

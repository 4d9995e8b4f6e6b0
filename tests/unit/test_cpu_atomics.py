"""cpu_experts/atomics.py: fetch_add under contention from a parallel loop, and the thread
count as compiled code sees it (the act hand-off of kernels.py relies on both)."""

import numba
import numpy as np
from numba import njit, prange

from cpu_experts.atomics import fetch_add, num_threads


@njit(parallel=True)
def _count(counts, n):
    for i in prange(n):
        fetch_add(counts, i % counts.size, np.int32(1))


@njit(parallel=True)
def _last_of_four(done, winners, n):
    """As the gate/up stage: four increments per slot; exactly one caller sees 3."""
    for i in prange(4 * n):
        if fetch_add(done, i // 4, np.int32(1)) == 3:
            fetch_add(winners, i // 4, np.int32(1))


@njit
def _threads():
    return num_threads()


def test_fetch_add_counts_every_increment() -> None:
    counts = np.zeros(7, np.int32)
    _count(counts, 70_000)
    assert counts.tolist() == [10_000] * 7
    done, winners = np.zeros(5000, np.int32), np.zeros(5000, np.int32)
    _last_of_four(done, winners, 5000)
    assert (done == 4).all() and (winners == 1).all()


def test_num_threads_is_numbas() -> None:
    assert _threads() == numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        assert _threads() == 1
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)

"""The host cores: the ones the CPU expert workers leave (cpu_experts/cores.host_cores), where
the GPU worker and the daemon keep to once the worker is up (it reports them in
``ReadyMsg.host_cores``; each process pins itself with :func:`pin_host_process`)."""

from __future__ import annotations

import os


def pin_host_process(cores: list[int]) -> dict:
    """Every thread of this process onto ``cores``, and its BLAS thread pools to as many
    threads as there are such cores; returns what it did (a log line's fields).

    The daemon and the GPU worker ran on any core: the CPU expert workers' cores too, where
    they preempt a worker's thread in the middle of a layer's parallel loop (the others wait
    for it at the loop's end), and the daemon's NumPy ran its BLAS pool's threads (one per
    core of the machine) there too. Threads started later inherit the mask of the thread
    that starts them."""
    from threadpoolctl import threadpool_info, threadpool_limits  # (these processes' only)

    mask = set(cores)
    pinned = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), mask)
            pinned += 1
        except (ProcessLookupError, FileNotFoundError):  # the thread ended meanwhile
            pass
    threadpool_limits(limits=len(mask), user_api="blas")
    blas = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
    return {"cores": sorted(mask), "threads_pinned": pinned, "blas_threads": blas}

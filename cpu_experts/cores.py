"""Which cores each cpu_experts worker runs on: by default one worker per NUMA node, less the
cores kept for the processes that drive the GPU (docs/architecture.md §1: daemon and GPU worker on
cores 0-1, workers from core 2 on)."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable

import numpy as np

# Cores kept free for the daemon and the GPU worker. A worker spins on its ring during a
# step; sharing a core with the GPU worker's Python thread, which enqueues every kernel, made
# a launched step about 6x slower on the H200 machine (docs/cpu_experts.md, "Cores").
RESERVED_CORES = 2
MIN_CORES_TO_RESERVE = 8  # smaller machines share every core


def numa_core_groups() -> list[list[int]]:
    """Usable cores of each NUMA node (one group if the machine reports no nodes)."""
    usable = os.sched_getaffinity(0)
    groups = []
    for path in sorted(glob.glob("/sys/devices/system/node/node[0-9]*/cpulist")):
        cores: list[int] = []
        for part in open(path).read().strip().split(","):
            if part:
                lo, _, hi = part.partition("-")
                cores.extend(range(int(lo), int(hi or lo) + 1))
        if usable.intersection(cores):
            groups.append(sorted(usable.intersection(cores)))
    return groups or [sorted(usable)]


def reserved_cores(usable: list[int]) -> list[int]:
    """The lowest :data:`RESERVED_CORES` usable cores, on machines of at least
    :data:`MIN_CORES_TO_RESERVE`; none on smaller ones."""
    usable = sorted(usable)
    return usable[:RESERVED_CORES] if len(usable) >= MIN_CORES_TO_RESERVE else []


def default_core_groups(num_workers: int | None) -> list[list[int]]:
    """Worker core groups over the usable cores less :func:`reserved_cores`: one group per
    NUMA node when num_workers is None or equals the node count; otherwise those cores split
    into ``num_workers`` contiguous groups of near-equal size."""
    usable = sorted(os.sched_getaffinity(0))
    keep = set(reserved_cores(usable))
    nodes = [g for g in ([c for c in group if c not in keep] for group in numa_core_groups())
             if g]
    if num_workers is None or num_workers == len(nodes):
        return nodes
    free = [c for c in usable if c not in keep]
    if num_workers > len(free):  # more workers than cores: share them all
        return [usable] * num_workers
    return [list(chunk) for chunk in np.array_split(free, num_workers)]


def host_cores(usable: Iterable[int], worker_groups: list[list[int]]) -> list[int]:
    """The usable cores no CPU expert worker runs on, where the workers leave some: the
    daemon and the GPU worker run there (protocol/host_cores.pin_host_process). [] where
    there are no workers or they take every core (a small machine: everything shares)."""
    taken = {int(c) for group in worker_groups for c in group}
    return sorted(set(usable) - taken) if taken else []

"""Which cores each cpu_experts worker runs on: by default one worker per NUMA node."""

from __future__ import annotations

import glob
import os

import numpy as np


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


def default_core_groups(num_workers: int | None) -> list[list[int]]:
    """One group per NUMA node when num_workers is None or equals the node count; otherwise the
    usable cores split into ``num_workers`` contiguous groups of near-equal size."""
    nodes = numa_core_groups()
    if num_workers is None or num_workers == len(nodes):
        return nodes
    usable = sorted(os.sched_getaffinity(0))
    if num_workers > len(usable):  # more workers than cores: share them all
        return [usable] * num_workers
    return [list(chunk) for chunk in np.array_split(usable, num_workers)]

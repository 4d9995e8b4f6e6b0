"""Default core groups of the CPU expert workers keep cores 0-1 for the GPU-driving processes
on machines large enough (docs/architecture.md §1), and share every core on small ones."""

from __future__ import annotations

import os

import pytest

from cpu_experts import cores


def _machine(monkeypatch, usable: list[int], nodes: list[list[int]]) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(usable))
    monkeypatch.setattr(cores, "numa_core_groups",
                        lambda: [[c for c in n if c in usable] for n in nodes])


def test_sixteen_cores_one_node_leave_two_for_the_gpu_worker(monkeypatch):
    _machine(monkeypatch, list(range(16)), [list(range(16))])
    assert cores.default_core_groups(None) == [list(range(2, 16))]
    assert cores.default_core_groups(2) == [list(range(2, 9)), list(range(9, 16))]


def test_two_nodes_reserve_on_the_first(monkeypatch):
    _machine(monkeypatch, list(range(16)), [list(range(8)), list(range(8, 16))])
    assert cores.default_core_groups(None) == [list(range(2, 8)), list(range(8, 16))]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_small_machines_share_every_core(monkeypatch, n):
    _machine(monkeypatch, list(range(n)), [list(range(n))])
    assert cores.default_core_groups(None) == [list(range(n))]
    assert sorted(c for g in cores.default_core_groups(1) for c in g) == list(range(n))


def test_reserved_cores_follow_the_affinity_mask(monkeypatch):
    usable = [4, 5, 6, 7, 8, 9, 10, 11, 12]
    _machine(monkeypatch, usable, [list(range(16))])
    assert cores.reserved_cores(usable) == [4, 5]
    assert cores.default_core_groups(None) == [list(range(6, 13))]
    assert cores.default_core_groups(20) == [usable] * 20  # more workers than cores

"""The CPU-expert benchmark's routings and its per-expert table (scripts/bench_cpu_*.py)."""

from __future__ import annotations

import numpy as np
import pytest

from scripts.bench_cpu_tables import markdown_tables
from scripts.bench_cpu_workload import routings


def test_shared_routing_puts_every_row_on_the_same_distinct_experts():
    layers = routings("shared", E=64, topk=10, rows=16, n=5, seed=3)
    assert len(layers) == 5
    for ids in layers:
        assert ids.shape == (16, 10) and ids.dtype == np.int32
        assert (ids == ids[0]).all()
        assert len(set(ids[0].tolist())) == 10 and ids.min() >= 0 and ids.max() < 64
    assert len({tuple(ids[0]) for ids in layers}) > 1  # a fresh set per layer


@pytest.mark.parametrize("kind", ["random", "skewed"])
def test_other_routings_give_each_row_its_own_distinct_experts(kind):
    ids = routings(kind, E=64, topk=8, rows=16, n=1, seed=1)[0]
    assert all(len(set(row.tolist())) == 8 for row in ids)
    assert len({tuple(row) for row in ids}) > 1


def _rec(routing: str, topk: int, rows: int, us: float) -> dict:
    return {"format": "int4", "I": 512, "E": 512, "routing": routing, "topk": topk,
            "rows": rows, "us_per_layer": us}


def test_the_table_gives_the_cost_of_rows_per_expert():
    table = markdown_tables([_rec("one_expert", 1, 1, 70.0), _rec("one_expert", 1, 16, 150.0),
                             _rec("shared", 10, 1, 250.0), _rec("shared", 10, 16, 400.0)])
    lines = {line.split(" | ")[3]: line for line in table.splitlines() if "(k=" in line}
    one, shared = lines["one_expert (k=1)"], lines["shared (k=10)"]
    assert one.endswith("| 2.14 |") and "| 70 |" in one and "| 150 |" in one
    assert shared.endswith("| 1.60 |") and "| 25 |" in shared and "| 40 |" in shared

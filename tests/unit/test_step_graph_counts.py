"""The CUDA graphs' per-step counts cross the worker -> daemon wire: counters are ints (the
codec refuses a float one; a float capture time there killed the GPU worker on its first
served step on the H200), the capture time travels as a timing."""

import collections

import pytest

from gpu_worker.step_graph import StepGraphs
from protocol.codec import decode, encode
from protocol.errors import ProtocolError
from protocol.messages import StepResult


def test_graph_counts_cross_the_wire() -> None:
    graphs = object.__new__(StepGraphs)  # the counting alone: no GPU needed
    graphs.totals = {"graph_captures": 3, "graph_replays": 10, "graph_refused": 1,
                     "graph_first_runs": 2, "graph_capture_ms": 412.75}
    graphs._taken = {"graph_captures": 0, "graph_replays": 0, "graph_refused": 0,
                     "graph_first_runs": 0, "graph_capture_ms": 0.0}
    graphs.graphs = collections.OrderedDict(a=1, b=2)
    counts, ms = graphs.take_counts()
    got = decode(encode(StepResult(step_id=1, counters=counts, timings_ms=ms)))
    assert got.counters == {"graph_captures": 3, "graph_replays": 10, "graph_refused": 1,
                            "graph_first_runs": 2, "graphs": 2}
    assert got.timings_ms == {"graph_capture": 412.75}
    graphs.totals["graph_replays"] += 4
    counts, ms = graphs.take_counts()  # the part since the last call
    assert (counts["graph_captures"], counts["graph_replays"], ms["graph_capture"]) == (0, 4, 0.0)


def test_float_counter_is_refused() -> None:
    with pytest.raises(ProtocolError, match="expected int"):
        decode(encode(StepResult(step_id=1, counters={"graph_capture_ms": 1.5})))

"""Speculation is exact in the serving dtype (issue 14, "What must hold"): tiny bf16 models of
both architectures on CuPy with every batch-invariant kernel on, three concurrent requests
through the scheduler and the real Runner. Narrow and wide verification with oracle drafts
(the plain run's continuation, one token in two of three steps made wrong) and suffix drafts,
greedy and seeded sampling, each give plain decoding's tokens: over 2,000 compared tokens per
architecture. The speculative runs replay CUDA graphs in capacity buckets, as a server does
(gpu_worker/step_graph.py, graph_buckets.py; the plain reference runs eagerly).
tests/gpu/test_speculation_cupy.py does the same in float64."""

from __future__ import annotations

import pytest

from tests.unit.test_speculation import _drafts, _serve

cupy = pytest.importorskip("cupy")
EMULATED = "cpu-emulator" in cupy.__version__  # scripts/cuda_emu: short runs
MAX_TOKENS = 24 if EMULATED else 120  # per request (less 3 per later request)




def test_speculation_in_bf16_gives_the_tokens_of_plain_decoding(bf16_model):
    model = bf16_model
    compared = 0
    for temperature in (0.0, 0.9):
        plain, _ = _serve(model, "off", temperature, n=MAX_TOKENS)
        tokens = sum(len(ids) for ids, _ in plain)
        for mode in ("narrow", "wide"):
            got, worker = _serve(model, mode, temperature, n=MAX_TOKENS, oracle=plain,
                                 cuda_graphs=True)
            assert got == plain, ("oracle", mode, temperature)
            proposed, accepted = _drafts(worker)
            assert 0 < accepted < proposed
            assert sum(r.counters.get("graph_replays", 0) for r in worker.results) > 0
            got, _ = _serve(model, mode, temperature, n=MAX_TOKENS, min_match=1,
                            cuda_graphs=True)
            assert got == plain, ("suffix", mode, temperature)
            compared += 2 * tokens
    assert EMULATED or compared >= 2000, compared

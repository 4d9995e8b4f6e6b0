"""A whole tiny model with every routed expert on an int4 CPU worker: it runs through the
pool, its outputs differ from the int8 pool's (the format reached the workers), and
speculative decoding still gives exactly the tokens of plain decoding."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from daemon.config import SpeculationSection
from daemon.request import GenerationRequest
from daemon.scheduler import Scheduler
from gpu_worker.engine import Engine, load_model
from gpu_worker.runner import Runner
from protocol.messages import SamplingParams
from scripts.tiny_model import make_tiny_model
from tests.harness import InProcessWorker, drain

SLOTS, CONTEXT = 3, 160  # as tests/unit/test_speculation.py
PROMPTS = [[5, 6, 7, 8] * 6, list(range(20, 44)) + list(range(20, 30)), [3, 1, 4, 1, 5, 9, 2, 6]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m"), "qwen3_moe", seed=4, tokenizer=False)


def _serve(model, experts, mode: str) -> list:
    runner = Runner(model, max_slots=SLOTS, max_context=CONTEXT, block_size=4,
                    extra_blocks=32, experts=experts)
    sched = Scheduler(max_slots=SLOTS, max_context=CONTEXT, max_queue=4, prefill_chunk=16,
                      block_size=4, checkpoint_interval=8, prefix_blocks=32,
                      speculation=SpeculationSection(mode=mode, min_match=1))
    sched.attach(InProcessWorker(runner))
    handles = [sched.submit(GenerationRequest(f"r{i}", p, SamplingParams(temperature=0.0,
                                                                         seed=11 + i), 24))
               for i, p in enumerate(PROMPTS)]
    return asyncio.run(drain(sched, handles))


def test_int4_cpu_experts_serve_and_speculation_stays_exact(tiny):
    ids = np.arange(3, 40) * 7 % 500
    scores = {}
    for fmt in ("int8", "int4"):
        model, experts = load_model(tiny, placement="cpu", cpu_workers=1, cpu_format=fmt)
        try:
            assert experts.pool.weight_format == fmt
            scores[fmt] = Engine(model, max_slots=1, max_len=64, placement=experts).score(ids)
            if fmt == "int4":
                plain = _serve(model, experts, "off")
                assert _serve(model, experts, "wide") == plain
                assert _serve(model, experts, "narrow") == plain
                assert all(len(tokens) == 24 for tokens, _ in plain)
        finally:
            experts.close()
    gpu, _ = load_model(tiny)
    exact = Engine(gpu, max_slots=1, max_len=64).score(ids)
    assert not np.array_equal(scores["int8"], scores["int4"])

    def err(a):
        return float(np.abs(a - exact).max() / np.abs(exact).max())

    assert err(scores["int8"]) < err(scores["int4"]) < 0.2, (err(scores["int8"]),
                                                              err(scores["int4"]))

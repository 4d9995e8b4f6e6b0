"""Per-slot CPU experts on CuPy (WorkerConfig.slot_routing, docs/speculation.md "The draft
budget"): the launched path records on the device what the host path records on the host,
the union of a decode-only step's per-slot experts is the ring's distinct-expert counter, and
the adaptive budget serves on it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from daemon.config import SpeculationSection
from daemon.request import GenerationRequest
from daemon.scheduler import Scheduler
from gpu_worker.engine import Engine
from gpu_worker.runner import Runner
from protocol.messages import SamplingParams, WorkKind
from scripts.tiny_model import make_tiny_model
from tests.harness import InProcessWorker, drain

pytest.importorskip("cupy")
PROMPTS = [list(range(5, 40)), list(range(200, 211)), [7, 9, 11, 13] * 6]


def _serve(path, launched: bool, spec: SpeculationSection | None):
    engine = Engine.from_dir(path, backend="cupy", placement="split", cpu_experts_per_layer=3,
                             cpu_workers=1, max_slots=3, max_len=128)
    try:
        placement = engine.placement
        assert placement.launched
        if not launched:
            placement.use_host_path()
        runner = Runner(engine.model, max_slots=3, max_context=128, block_size=4,
                        extra_blocks=32, experts=placement, slot_routing=True)
        sched = Scheduler(max_slots=3, max_context=128, max_queue=4, prefill_chunk=16,
                          block_size=4, checkpoint_interval=8, prefix_blocks=32,
                          speculation=spec)
        worker = InProcessWorker(runner)
        sched.attach(worker)
        handles = [sched.submit(GenerationRequest(
            f"r{i}", p, SamplingParams(temperature=0.8 if i else 0.0, seed=i), 24, eos=False))
            for i, p in enumerate(PROMPTS)]
        out = asyncio.run(drain(sched, handles))
        return [ids for ids, _ in out], worker, sched
    finally:
        engine.close()


def _routes(worker) -> list[dict[int, tuple[list[int], list[int]]]]:
    return [{r.slot: (r.cpu_experts.tolist(), r.cpu_expert_rows.tolist()) for r in res.slots}
            for res in worker.results]


def _union_is_the_counter(worker) -> int:
    checked = 0
    for plan, res in zip(worker.plans, worker.results, strict=True):
        if plan.slots and all(w.kind == WorkKind.DECODE for w in plan.slots):
            union = np.unique(np.concatenate([r.cpu_experts for r in res.slots]))
            assert len(union) == res.counters["cpu_experts"]
            checked += 1
    return checked


def test_launched_path_records_the_host_paths_slot_experts(tmp_path):
    path = make_tiny_model(tmp_path, "qwen3_next", seed=5, tokenizer=False,
                           moe_intermediate=64, std=0.1)
    launched_tokens, launched, _ = _serve(path, True, None)
    host_tokens, host, _ = _serve(path, False, None)
    assert launched_tokens == host_tokens
    assert _routes(launched) == _routes(host)
    assert _union_is_the_counter(launched) > 5


def test_the_adaptive_budget_serves_on_the_launched_path(tmp_path):
    path = make_tiny_model(tmp_path, "qwen3_next", seed=5, tokenizer=False,
                           moe_intermediate=64, std=0.1)
    spec = SpeculationSection(mode="wide", min_match=1, draft_budget="adaptive")
    tokens, worker, sched = _serve(path, True, spec)
    assert [len(t) for t in tokens] == [24, 24, 24]
    assert _union_is_the_counter(worker) > 0
    routing = sched.draft_plan.budget.routing
    assert routing.universe == worker.results[-1].counters["cpu_experts_held"] > 0

"""The serving path on CuPy with CPU experts: the scheduler drives the real Runner, whose every
forward ends in ExpertPlacement.run_step (the launched CPU-expert path: the GPU rings the workers
and waits for them). Three concurrent requests give the tokens of the host path."""

from __future__ import annotations

import asyncio

import pytest

from daemon.request import GenerationRequest
from daemon.scheduler import Scheduler
from gpu_worker.engine import Engine, load_model
from gpu_worker.runner import Runner
from protocol.messages import SamplingParams
from scripts.tiny_model import make_tiny_model
from tests.harness import InProcessWorker, drain

pytest.importorskip("cupy")


def _serve(path, prompts, launched: bool, shards=None,
           cached: bool = False) -> tuple[list[list[int]], list[dict]]:
    lines: dict[str, dict] = {}
    model, experts = load_model(path, backend="cupy", placement="split",
                                cpu_experts_per_layer=3, cpu_workers=1, cpu_shard_cache=shards,
                                log=lambda event, **f: lines.setdefault(event, f))
    assert lines["load plan"]["cpu_shards_cached"] is cached
    assert lines["load workers ready"].get("during_load", False) is cached  # during the load
    engine = Engine(model, placement=experts, max_slots=3, max_len=128)
    try:
        placement = engine.placement
        assert placement.launched
        if not launched:
            placement.use_host_path()
        runner = Runner(engine.model, max_slots=3, max_context=128, block_size=4,
                        extra_blocks=32, experts=placement)
        sched = Scheduler(max_slots=3, max_context=128, max_queue=4, prefill_chunk=16,
                          block_size=4, checkpoint_interval=8, prefix_blocks=32)
        worker = InProcessWorker(runner)
        sched.attach(worker)
        handles = [sched.submit(GenerationRequest(
            f"r{i}", p, SamplingParams(temperature=0.8 if i else 0.0, seed=i), 24, eos=False))
            for i, p in enumerate(prompts)]
        out = asyncio.run(drain(sched, handles))
        return [ids for ids, _ in out], [r.counters for r in worker.results]
    finally:
        engine.close()


def test_scheduled_requests_launched_path_equal_host_path(tmp_path):
    path = make_tiny_model(tmp_path, "qwen3_next", seed=5, tokenizer=False,
                           moe_intermediate=64, std=0.1)
    prompts = [list(range(5, 40)), list(range(200, 211)), [7, 9, 11, 13] * 6]
    launched, counters = _serve(path, prompts, launched=True, shards=tmp_path / "shards")
    host, _ = _serve(path, prompts, launched=False)
    # the same shards kept: their workers start while the GPU's weights load
    cached, _ = _serve(path, prompts, launched=True, shards=tmp_path / "shards", cached=True)
    assert [len(t) for t in launched] == [24, 24, 24]
    assert launched == host == cached
    steps = [c for c in counters if c.get("moe_layers")]
    assert steps and all(c["cpu_experts"] > 0 and c["gpu_experts"] > 0 for c in steps)
    assert all(c["cpu_expert_bytes"] > 0 for c in steps)

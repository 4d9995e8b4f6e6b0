"""The scheduler's bookkeeping driven against the real Runner in-process (no sockets)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from daemon.config import SpeculationSection
from daemon.prefix_cache import PrefixCache
from daemon.request import GenerationRequest, QueueFull, RequestRejected
from daemon.scheduler import Scheduler
from gpu_worker.engine import Engine
from gpu_worker.runner import Runner
from protocol.messages import SamplingParams
from scripts.tiny_model import make_tiny_model
from tests.harness import InProcessWorker, drain


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m"), "qwen3_next", seed=3, tokenizer=False)


# speculation arms the stateful paths (preemption, prefix reuse) run under too
SPECULATION = {"off": None,
               "wide-suffix": SpeculationSection(mode="wide", min_match=1, num_drafts=3),
               "narrow-mtp": SpeculationSection(mode="narrow", proposer="mtp", num_drafts=2)}


def _setup(model_dir, *, slots=2, interval=8, preemption="swap", prefix_blocks=64,
           speculation=None):
    engine = Engine.from_dir(model_dir, dtype="float64", max_slots=slots, max_len=128)
    runner = Runner(engine.model, max_slots=slots, max_context=128, block_size=4,
                    extra_blocks=prefix_blocks)
    sched = Scheduler(max_slots=slots, max_context=128, max_queue=4, prefill_chunk=16,
                      block_size=4, checkpoint_interval=interval, prefix_blocks=prefix_blocks,
                      preemption=preemption, speculation=speculation)
    worker = InProcessWorker(runner)
    sched.attach(worker)
    return sched, worker, engine


def _req(rid, prompt, n=12, priority=0, seed=1, temperature=0.0):
    return GenerationRequest(rid, list(prompt), SamplingParams(temperature=temperature, seed=seed),
                             n, priority=priority, eos=False)


def _alone(model_dir, prompt, n, temperature=0.0, seed=1):
    engine = Engine.from_dir(model_dir, dtype="float64", max_slots=1, max_len=128)
    return engine.generate(np.array(prompt), params=SamplingParams(temperature=temperature,
                                                                   seed=seed), max_tokens=n)


def test_batched_sampled_requests_equal_alone(model_dir):
    sched, worker, _ = _setup(model_dir)
    prompts = [list(range(5, 25)), list(range(40, 47)), list(range(100, 131))]
    hs = [sched.submit(_req(f"r{i}", p, temperature=0.9, seed=i)) for i, p in enumerate(prompts)]
    got = asyncio.run(drain(sched, hs))
    for i, p in enumerate(prompts):
        assert got[i] == (_alone(model_dir, p, 12, 0.9, i), "length")
    # prefill was chunked at checkpoint boundaries and never mixed two chunks of one slot
    prefill_sizes = [w.num_tokens for plan in worker.plans for w in plan.slots
                     if w.kind == 1]
    assert max(prefill_sizes) <= 8


@pytest.mark.parametrize("spec", list(SPECULATION))
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_priority_preemption_resumes_identically(model_dir, mode, spec):
    sched, worker, _ = _setup(model_dir, slots=1, preemption=mode,
                              speculation=SPECULATION[spec])
    low_prompt, high_prompt = list(range(7, 30)), list(range(60, 70))

    async def go():
        loop = asyncio.create_task(sched.run())
        low = sched.submit(_req("low", low_prompt, 20))
        first = await low.__anext__()  # low is decoding
        high = sched.submit(_req("high", high_prompt, 6, priority=3))
        hi_ids = [t for ev in [e async for e in high] for t in ev.token_ids]
        lo_ids = first.token_ids + [t for ev in [e async for e in low] for t in ev.token_ids]
        loop.cancel()
        return lo_ids, hi_ids

    lo, hi = asyncio.run(go())
    assert lo == _alone(model_dir, low_prompt, 20)
    assert hi == _alone(model_dir, high_prompt, 6)
    ops = [op.op.name for plan in worker.plans for op in plan.cache_ops]
    if mode == "swap":
        assert "SWAP_OUT" in ops and "SWAP_IN" in ops
    else:  # dropped, then prefilled again (prompt + what it had generated)
        assert "SWAP_OUT" not in ops and ops.count("ALLOCATE") == 3


@pytest.mark.parametrize("spec", list(SPECULATION))
def test_prefix_reuse_shares_checkpoints(model_dir, spec):
    sched, worker, _ = _setup(model_dir, slots=1, speculation=SPECULATION[spec])
    base = list(range(3, 30))
    hs = [sched.submit(_req("a", base + [1, 2], 5)), sched.submit(_req("b", base + [9], 5))]
    got = asyncio.run(drain(sched, hs))
    assert got[1][0] == _alone(model_dir, base + [9], 5)
    shares = [op for plan in worker.plans for op in plan.cache_ops if op.op.name == "SHARE_PREFIX"]
    assert len(shares) == 1 and shares[0].num_tokens == 24  # the last boundary before 27


def test_rejections_change_nothing(model_dir):
    sched, _, _ = _setup(model_dir, slots=1)
    with pytest.raises(RequestRejected):
        sched.submit(_req("long", range(120), 20))
    for i in range(4):
        sched.submit(_req(f"q{i}", [1, 2, 3], 2))
    with pytest.raises(QueueFull):
        sched.submit(_req("over", [1, 2, 3], 2))
    with pytest.raises(RequestRejected):
        sched.submit(_req("q0", [1], 2))  # id in use
    assert len(sched.queue) == 4


def test_prefix_cache_lru_is_bounded():
    cache = PrefixCache(max_blocks=4, block_size=4)
    assert cache.add([1] * 8, 1) == []
    assert cache.add([2] * 8, 2) == []
    assert cache.lookup([1] * 8 + [5]) == (1, 8)  # touches entry 1
    assert cache.add([3] * 4, 3) == [2]  # the least recently used goes
    assert cache.lookup([2] * 9) is None and cache.used_blocks == 3
    assert cache.lookup([1] * 8) is None  # a prefix must leave something to prefill

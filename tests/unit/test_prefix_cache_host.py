"""The prefix cache's host tier (``[scheduler] prefix_cache_host_mb``; daemon/prefix_cache.py,
gpu_worker/cache_ops.py): entries the GPU budget pushes out are offloaded to the model
worker's host memory instead of dropped, unless a longer entry supersedes them; a prompt that
hits one gets a copy whose KV and state are the checkpoint's, so its tokens are a cold
start's. The daemon's bookkeeping alone, the worker's copies alone, then both through the
real scheduler and Runner."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from daemon.prefix_cache import PrefixCache
from gpu_worker.cache_ops import CacheOps, PlanError
from gpu_worker.engine import Engine
from protocol.messages import CacheOp, CacheOpKind
from scripts.tiny_model import make_tiny_model
from tests.unit.test_turn_checkpoint import _scheduler, _serve

MB = 2**20
OP = CacheOpKind


def _conv(a: int, n: int) -> list[int]:
    return [(a * 1000 + i) % 997 for i in range(n)]


def _cache(host_mb: int) -> PrefixCache:
    # an entry of 8 tokens: 2 blocks of 1 MB + a 10 MB state = 12 MB; the GPU tier holds two
    return PrefixCache(10_000, 4, block_bytes=MB, state_bytes=10 * MB, max_bytes=24 * MB,
                       host_max_bytes=host_mb * MB)


def test_entries_pushed_out_of_the_gpu_go_to_host_memory_and_are_found_there():
    cache = _cache(host_mb=36)  # three entries
    dropped = [cache.add(_conv(a, 8), a + 1, None) for a in range(4)]
    assert dropped == [[], [], [], []] and cache.take_offloads() == [1, 2]
    assert cache.take_offloads() == []  # taken once
    assert cache.tiers() == {"gpu": (2, 24 * MB), "host": (2, 24 * MB)}
    assert cache.on_host(1) and cache.on_host(2) and not cache.on_host(3)
    assert cache.lookup(_conv(0, 8) + [5]) == (1, 8)
    assert cache.lookup(_conv(3, 8) + [5]) == (4, 8)
    assert cache.hits == {"gpu": 1, "host": 1}
    # two more: one more fits the host tier, then its least recently used entry goes (2:
    # entry 1 was just read)
    assert cache.add(_conv(4, 8), 5, None) == [] and cache.take_offloads() == [3]
    assert cache.add(_conv(5, 8), 6, None) == [2] and cache.take_offloads() == [4]
    assert cache.host_used_bytes == 36 * MB and cache.used_bytes == 24 * MB
    assert cache.lookup(_conv(1, 8) + [5]) is None


def test_the_host_tier_holds_at_most_max_entries_entries_too():
    """Small entries in a large host budget: the daemon's index stays bounded by count."""
    cache = PrefixCache(10_000, 4, max_entries=3, block_bytes=1, state_bytes=1,
                        host_max_bytes=MB)
    dropped = [e for a in range(8) for e in cache.add(_conv(a, 8), a + 1, None)]
    assert cache.tiers()["gpu"][0] == 3 and cache.tiers()["host"][0] == 3
    assert dropped == [1, 2] and cache.take_offloads() == [1, 2, 3, 4, 5]


def test_without_a_host_tier_entries_are_dropped_as_before():
    cache = _cache(host_mb=0)
    assert [cache.add(_conv(a, 8), a + 1, None) for a in range(4)] == [[], [], [1], [2]]
    assert cache.take_offloads() == [] and cache.tiers()["host"] == (0, 0)


def test_a_superseded_entry_is_dropped_not_offloaded():
    """A conversation's shorter checkpoint serves only prompts that leave it before the
    longer one: copying it out is not worth host memory."""
    cache = PrefixCache(10_000, 4, block_bytes=MB, state_bytes=10 * MB, max_bytes=25 * MB,
                        host_max_bytes=100 * MB)
    cache.add(_conv(0, 8), 1, None)
    cache.add(_conv(1, 8), 2, None)
    # entry 3 (13 MB) extends entry 1, which goes (superseded by it) and is not copied out
    assert cache.add(_conv(0, 12), 3, None) == [1]
    assert cache.take_offloads() == [] and cache.tiers()["host"] == (0, 0)


def test_a_weak_end_is_offloaded_only_where_weak_and_superseded_host_entries_make_room():
    cache = _cache(host_mb=24)  # two entries
    for a in range(4):  # ordinary entries: two on the GPU, two on the host
        cache.add(_conv(a, 8), a + 1, None)
    assert cache.take_offloads() == [1, 2]
    cache.add(_conv(4, 8), 5, None, weak=True)  # a weak end pushes entry 3 out of the GPU:
    assert cache.take_offloads() == [3]  # it goes to the host, pushing out entry 1 (LRU)
    assert not cache.on_host(1) and cache.lookup(_conv(0, 8) + [1]) is None
    # another ordinary entry pushes the weak one out of the GPU: the host holds no weak or
    # superseded entry to make room for it, so it is dropped (entries 2 and 3 stay)
    assert cache.add(_conv(5, 8), 6, None) == [5] and cache.take_offloads() == []
    assert cache.on_host(2) and cache.on_host(3)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("m"), "qwen3_next", seed=4, tokenizer=False)
    return Engine.from_dir(path, dtype="float64", max_slots=2, max_len=256).model


def test_an_offloaded_checkpoint_restores_the_same_kv_and_state(model):
    """CHECKPOINT, OFFLOAD (its blocks freed), SHARE_PREFIX into another slot: that slot's KV
    rows and GDN state equal the checkpoint's; DROP_CHECKPOINT forgets it; a second OFFLOAD
    is refused."""
    from gpu_worker.runner import Runner
    from protocol.messages import SamplingParams, SlotWork, StepPlan, WorkKind

    runner = Runner(model, max_slots=2, max_context=64, block_size=4, extra_blocks=16)
    ops: CacheOps = runner.cache_ops
    prompt = np.array([(5 * i + 1) % 400 for i in range(10)], np.int32)
    runner.execute(StepPlan(step_id=1, cache_ops=[CacheOp(op=OP.ALLOCATE, slot=0)], slots=[
        SlotWork(slot=0, request_id="a", kind=WorkKind.PREFILL, input_ids=prompt, start_pos=0,
                 num_tokens=10, prompt_len=10, needs_logits=False,
                 sampling=SamplingParams(temperature=0.0, seed=1))]))
    ops.apply(CacheOp(op=OP.CHECKPOINT, slot=0, num_tokens=10, entry_id=7))
    kv, states = ops.kv, ops.states
    want_kv = tuple(np.array(a) for a in kv.gather(kv.tables[0][:3]))
    want_state = tuple(np.array(s) for s in states.snapshot(0))
    ops.apply(CacheOp(op=OP.FREE, slot=0))
    free = kv.allocator.num_free  # the checkpoint alone holds the 3 blocks now
    ops.apply(CacheOp(op=OP.OFFLOAD, entry_id=7))
    assert ops.entry(7).blocks == [] and ops.entry(7).host_kv is not None
    assert kv.allocator.num_free == free + 3
    ops.apply(CacheOp(op=OP.SHARE_PREFIX, slot=1, num_tokens=10, entry_id=7))
    got_kv = tuple(np.array(a) for a in kv.gather(kv.tables[1][:3]))
    for g, w in zip(got_kv, want_kv, strict=True):
        assert np.array_equal(g, w)
    for g, w in zip(states.snapshot(1), want_state, strict=True):
        assert np.array_equal(np.array(g), w)
    assert ops.lengths[1] == 10
    with pytest.raises(PlanError, match="host memory already"):
        ops.apply(CacheOp(op=OP.OFFLOAD, entry_id=7))
    ops.apply(CacheOp(op=OP.DROP_CHECKPOINT, entry_id=7))
    with pytest.raises(PlanError, match="unknown cache entry"):
        ops.apply(CacheOp(op=OP.SHARE_PREFIX, slot=0, num_tokens=10, entry_id=7))


def next_turn(model, host_mb: int) -> tuple[int, list[int], list]:
    """Three chats' first turns in a GPU tier that holds one history checkpoint, then the
    first chat's next turn: (its cached tokens, its tokens, the cache ops of the run)."""
    prompts = {a: [(7 * i + 3 + 100 * a) % 500 for i in range(21)] for a in range(3)}
    sched, worker = _scheduler(model, prefix_blocks=6)
    p = sched.prefix
    sched.prefix = PrefixCache(p.max_blocks, p.block_size, host_max_bytes=host_mb * MB,
                               block_bytes=MB // 8, state_bytes=MB // 8)

    async def turns() -> list[int]:
        for a in range(3):
            await _serve(sched, prompts[a], 6, f"first{a}", history_len=18)
        return await _serve(sched, prompts[0][:18] + [1, 2, 3, 4], 6, "next0")

    tokens = asyncio.run(turns())
    cached = next(w.cached_len for p in worker.plans for w in p.slots
                  if w.request_id == "next0")
    return cached, tokens, [op.op for plan in worker.plans for op in plan.cache_ops]


def test_a_conversation_pushed_out_of_the_gpu_resumes_from_host_memory(model):
    """Without a host tier the first chat's next turn finds nothing; with one it starts from
    its history (18 tokens), and its tokens are those of the run without a host tier (a cold
    start's)."""
    cold_cached, cold_tokens, cold_ops = next_turn(model, host_mb=0)
    cached, tokens, ops = next_turn(model, host_mb=64)
    assert cold_cached == 0 and OP.OFFLOAD not in cold_ops
    assert cached == 18 and OP.OFFLOAD in ops
    assert tokens == cold_tokens

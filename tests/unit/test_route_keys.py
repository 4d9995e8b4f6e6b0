"""Routing keys (docs/synthetic.md): a request's `user` keys a synthetic model's routing, so
its tokens do not depend on its slot; without one the rows route by slot, as before; the
prefix cache shares a synthetic model's states only within one key, a real model's with all."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from daemon.config import SpeculationSection
from daemon.request import GenerationRequest, user_route_key
from daemon.scheduler import Scheduler
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.runner import Runner
from gpu_worker.weights.routing import RoutingParams
from protocol.messages import CacheOpKind, SamplingParams, SlotWork, WorkKind
from tests.harness import InProcessWorker, drain
from tests.unit.test_synthetic import _synthetic_model

SLOTS = 3
PROMPT = list(range(7, 31))  # 24 tokens: checkpoints at 8 and 16 (interval 8)
FILLERS = [[3, 1, 4, 1, 5, 9, 2, 6] * 3, list(range(60, 80))]


@pytest.fixture(scope="module")
def model():
    return _synthetic_model("qwen3_next", RoutingParams(0.8, 0.5), experts=8, topk=2)


def _serve(model, batches: list[list[GenerationRequest]], *, route_keyed: bool = True,
           speculation: SpeculationSection | None = None):
    """Each batch of requests submitted together and drained, in order, on one scheduler;
    every request's token ids and the worker (its plans and results)."""
    runner = Runner(model, max_slots=SLOTS, max_context=128, block_size=4, extra_blocks=64)
    sched = Scheduler(max_slots=SLOTS, max_context=128, max_queue=8, prefill_chunk=16,
                      block_size=4, checkpoint_interval=8, prefix_blocks=64,
                      speculation=speculation)
    sched.route_keyed = route_keyed  # what READY's ModelInfo.synthetic_routing sets
    worker = InProcessWorker(runner)
    sched.attach(worker)
    out = {}

    async def run() -> None:  # one event loop: the scheduler's wake-up event lives in it
        for reqs in batches:
            got = await drain(sched, [sched.submit(r) for r in reqs])
            out.update({r.request_id: ids for r, (ids, _) in zip(reqs, got, strict=True)})

    asyncio.run(run())
    return out, worker


def _req(rid: str, prompt: list[int], user: str | None = None, n: int = 16):
    return GenerationRequest(rid, list(prompt), SamplingParams(temperature=0.9, seed=5), n,
                             eos=False, user=user)


def _slot_of(worker, rid: str) -> SlotWork:
    return next(w for p in worker.plans for w in p.slots if w.request_id == rid)


def _shared(worker) -> list[int]:
    """The prefix lengths the plans shared (SHARE_PREFIX ops), in order."""
    return [op.num_tokens for p in worker.plans for op in p.cache_ops
            if op.op == CacheOpKind.SHARE_PREFIX]


def test_user_route_key_is_a_stable_63_bit_hash():
    assert user_route_key("agent-0") == 3835311112964728579  # the same in every process
    keys = {user_route_key(u) for u in ("agent-0", "agent-1", "essay-0", "", "é")}
    assert len(keys) == 5 and all(0 <= k < 2**63 for k in keys)


def test_slot_work_refuses_a_key_outside_63_bits():
    work = dict(slot=0, request_id="r", kind=WorkKind.DECODE, input_ids=np.array([1], np.int32),
                start_pos=3, num_tokens=1, needs_logits=True, prompt_len=3,
                sampling=SamplingParams(seed=1))
    assert SlotWork(**work, route_key=2**63 - 1).route_key == 2**63 - 1
    for bad in (2**63, -1):  # on the wire: BAD_VALUE (tests/unit/test_protocol_codec.py)
        with pytest.raises(ValueError, match="route_key"):
            SlotWork(**work, route_key=bad)


def test_a_batch_routes_by_its_keys_and_by_slot_without_them(model):
    parts = [(0, 0, np.arange(1, 6)), (2, 3, np.arange(9, 12))]
    plain = RaggedBatch.build(parts)
    assert [s.route_key for s in plain.segments] == [0, 2]
    slots = np.repeat([0, 2], [5, 3])
    for layer in (0, 1):  # no key: the slot, bit for bit the routing of before
        want = model.routing.choose(layer, slots, plain.positions)
        assert np.array_equal(model.routing.bind_batch(plain).ids(layer), want)
    key = user_route_key("agent-0")
    keyed = RaggedBatch.build(parts, {0: key, 2: None})
    moved = RaggedBatch.build([(1, 0, np.arange(1, 6))], {1: key})  # the same rows, slot 1
    ids, ids_moved = (model.routing.bind_batch(b).ids(1) for b in (keyed, moved))
    assert np.array_equal(ids[:5], ids_moved) and np.array_equal(ids[5:], want[5:])
    assert not np.array_equal(ids[:5], want[:5])


def test_the_same_user_gives_the_same_tokens_in_any_slot(model):
    """Alone a request takes slot 0; after two others, slot 2. With a user its tokens are
    the same in both; without one they are slot-keyed (today's), so they differ."""
    alone, worker = _serve(model, [[_req("a", PROMPT, "agent-0")], [_req("p", PROMPT)]])
    assert _slot_of(worker, "a").slot == _slot_of(worker, "p").slot == 0
    fillers = [_req("f0", FILLERS[0], n=40), _req("f1", FILLERS[1], n=40)]
    busy, worker = _serve(model, [fillers + [_req("a", PROMPT, "agent-0")]])
    assert _slot_of(worker, "a").slot == 2
    assert _slot_of(worker, "a").route_key == user_route_key("agent-0")
    assert _slot_of(worker, "f0").route_key is None  # no user: the worker keys by slot
    assert busy["a"] == alone["a"]
    moved, worker = _serve(model, [fillers + [_req("p", PROMPT)]])
    assert _slot_of(worker, "p").slot == 2 and moved["p"] != alone["p"]
    assert alone["a"] != alone["p"]  # the user's key routes otherwise than slot 0


def test_a_synthetic_model_shares_prefixes_within_one_user_only(model):
    fresh, _ = _serve(model, [[_req("b", PROMPT + [40], "agent-1")]])
    got, worker = _serve(model, [[_req("a", PROMPT, "agent-0")],
                                 [_req("b", PROMPT + [40], "agent-1")],
                                 [_req("a2", PROMPT + [41], "agent-0")]])
    assert _shared(worker) == [24]  # a2 reuses a's prompt; b (another user) nothing
    assert got["b"] == fresh["b"]  # its states are its own key's


def test_a_real_model_shares_prefixes_across_users(model):
    """route_keyed False (READY of a model with a router): a prefix is everyone's."""
    _, worker = _serve(model, [[_req("a", PROMPT, "agent-0")],
                               [_req("b", PROMPT + [40], "agent-1")]], route_keyed=False)
    assert _shared(worker) == [24]


def test_the_mtp_head_routes_by_the_key_too(model):
    """The MTP head's passes (a layer of their own) route by the request's key: in slot 0
    and in slot 2 the request gets the same drafts, step by step, and the same tokens."""
    spec = SpeculationSection(mode="narrow", proposer="mtp", num_drafts=2)
    fillers = [_req("f0", FILLERS[0], n=40), _req("f1", FILLERS[1], n=40)]
    runs = [_serve(model, [reqs + [_req("a", PROMPT, "agent-0")]], speculation=spec)
            for reqs in ([], fillers)]
    drafts = [[r.drafts for res in w.results for r in res.slots if r.request_id == "a"]
              for _, w in runs]
    assert runs[0][0]["a"] == runs[1][0]["a"] and drafts[0] == drafts[1]
    assert sum(map(len, drafts[0])) > 0


@pytest.mark.parametrize("route_keyed", [True, False])
def test_no_checkpoint_of_states_that_mix_two_slots_routing(model, route_keyed):
    """A request without a user, swapped out mid-prompt and back in to another slot, holds
    states of two slots' routing on a synthetic model: its later chunks are not checkpointed
    (a real model's are)."""
    # room for every checkpoint (the finished requests' too): nothing is evicted
    runner = Runner(model, max_slots=2, max_context=128, block_size=4, extra_blocks=256)
    sched = Scheduler(max_slots=2, max_context=128, max_queue=8, prefill_chunk=16,
                      block_size=4, checkpoint_interval=8, prefix_blocks=256)
    sched.route_keyed = route_keyed
    worker = InProcessWorker(runner)
    sched.attach(worker)
    long = list(range(100, 148))  # 48 tokens: six chunks of 8
    reqs = [GenerationRequest("r0", long, SamplingParams(seed=1), 4, eos=False),
            GenerationRequest("r1", FILLERS[0], SamplingParams(seed=2), 4, priority=1,
                              eos=False),
            GenerationRequest("hi", FILLERS[1], SamplingParams(seed=3), 30, priority=5,
                              eos=False)]

    async def go():
        handles = [sched.submit(r) for r in reqs[:2]]
        plan = sched.plan()  # r1 in slot 0, r0 in slot 1: one chunk of r0
        sched.commit(plan, await worker.step(plan), 0.0)
        return await drain(sched, handles + [sched.submit(reqs[2])])  # r0 swapped out

    asyncio.run(go())
    slots = [w.slot for p in worker.plans for w in p.slots if w.request_id == "r0"]
    assert slots[0] == 1 and slots[-1] == 0  # r1 (priority 1) was admitted first
    space = (lambda slot: slot) if route_keyed else (lambda slot: None)
    assert sched.prefix.contains(long[:8], space(1))  # its first chunk, in slot 1
    assert sched.prefix.contains(long[:16], space(0)) is not route_keyed

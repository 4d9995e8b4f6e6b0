"""A finished request's state is kept as a prefix checkpoint (daemon/step_commit.py
``release_finished``): a conversation's next turn, which repeats the prompt and the answer
before its new message, prefills only the new part, and its tokens are those of a cold
start. Real scheduler and Runner on a tiny Qwen3-Next (GDN states restored from the
checkpoint). A request whose accepted drafts ran past its end (an EOS among them) keeps no
checkpoint, its state follows tokens it did not emit:
tests/unit/test_speculation.py::test_drafts_stop_at_eos_and_max_tokens_like_plain_decoding
failed (a refused CHECKPOINT) until release_finished checked for that."""

from __future__ import annotations

import asyncio

import pytest

from daemon.config import SpeculationSection
from daemon.request import GenerationRequest
from daemon.scheduler import Scheduler
from gpu_worker.engine import Engine
from gpu_worker.runner import Runner
from protocol.messages import CacheOpKind, SamplingParams
from scripts.tiny_model import make_tiny_model
from tests.harness import InProcessWorker, drain

PROMPT = [(7 * i + 3) % 500 for i in range(21)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("m"), "qwen3_next", seed=4, tokenizer=False)
    return Engine.from_dir(path, dtype="float64", max_slots=2, max_len=256).model


def _scheduler(model, mode: str = "off",
               prefix_blocks: int = 128) -> tuple[Scheduler, InProcessWorker]:
    runner = Runner(model, max_slots=2, max_context=256, block_size=4, extra_blocks=128)
    sched = Scheduler(max_slots=2, max_context=256, max_queue=8, prefill_chunk=16,
                      block_size=4, checkpoint_interval=8, prefix_blocks=prefix_blocks,
                      speculation=SpeculationSection(mode=mode, min_match=1))
    worker = InProcessWorker(runner)
    sched.attach(worker)
    return sched, worker


async def _serve(sched, prompt: list[int], n: int, rid: str,
                 history_len: int | None = None) -> list[int]:
    req = GenerationRequest(rid, prompt, SamplingParams(temperature=0.8, seed=9), n, eos=False,
                            history_len=history_len)
    return (await drain(sched, [sched.submit(req)]))[0][0]


@pytest.mark.parametrize("mode", ["off", "wide"])
def test_the_next_turn_prefills_only_its_new_message(model, mode):
    sched, worker = _scheduler(model, mode)

    async def turns() -> tuple[list[int], list[int], list[int]]:
        answer = await _serve(sched, PROMPT, 12, "turn1")
        follow = PROMPT + answer + [11, 12, 13]
        return answer, follow, await _serve(sched, follow, 6, "turn2")

    answer, follow, got = asyncio.run(turns())
    ends = [op for p in worker.plans for op in p.cache_ops
            if op.op == CacheOpKind.CHECKPOINT and op.num_tokens > len(PROMPT)]
    assert [op.num_tokens for op in ends] == [len(PROMPT) + len(answer) - 1,
                                              len(follow) + len(got) - 1]  # each turn's
    first = next(w for p in worker.plans for w in p.slots if w.request_id == "turn2")
    assert first.cached_len == len(PROMPT) + len(answer) - 1  # all but the answer's last
    cold, _ = _scheduler(model, mode)
    assert got == asyncio.run(_serve(cold, follow, 6, "turn2"))


@pytest.mark.parametrize("mode", ["off", "wide"])
def test_a_chat_turn_hits_the_checkpoint_where_its_history_ends(model, mode):
    """A chat prompt's last tokens open the answer (a generation prompt the next turn does
    not repeat: history_len, Tokenizer.chat_history_len): a prefill chunk ends there and
    checkpoints it, the whole prompt is kept weak, and the next turn (the history, the
    answer as the template renders it, a new message) prefills only from there, with the
    tokens of a cold start."""
    sched, worker = _scheduler(model, mode)
    history = len(PROMPT) - 3

    async def turns() -> tuple[list[int], list[int]]:
        answer = await _serve(sched, PROMPT, 5, "turn1", history_len=history)
        follow = PROMPT[:history] + [40, 41] + answer + [11, 12, 13]
        return follow, await _serve(sched, follow, 6, "turn2")

    follow, got = asyncio.run(turns())
    chunks = [(w.start_pos, w.num_tokens) for p in worker.plans for w in p.slots
              if w.request_id == "turn1" and w.start_pos < len(PROMPT)]
    assert (history - history % 8, history % 8) in chunks  # ends at the history (8: interval)
    saved = [op.num_tokens for p in worker.plans for op in p.cache_ops_after
             if op.op == CacheOpKind.CHECKPOINT]
    assert history in saved and len(PROMPT) in saved
    assert sched.prefix.lookup(PROMPT[:history] + [99]) is not None
    assert sched.prefix._by_tokens[(None, tuple(PROMPT))] in sched.prefix._weak
    first = next(w for p in worker.plans for w in p.slots if w.request_id == "turn2")
    assert first.cached_len == history
    cold, _ = _scheduler(model, mode)
    assert got == asyncio.run(_serve(cold, follow, 6, "turn2"))


def test_two_conversations_in_a_small_cache_keep_their_history_checkpoints(model):
    """Two chats, one turn each, then each one's next turn, in a cache of 12 blocks (one
    history checkpoint is 5): the weak ends (each prompt whole, each prompt with its answer)
    take only the room of weak and superseded entries, so both next turns start from their
    history. Until session 20 a weak end could push out any entry: neither next turn hit."""
    sched, worker = _scheduler(model, prefix_blocks=12)
    prompts = {a: [(7 * i + 3 + 100 * a) % 500 for i in range(21)] for a in range(2)}

    async def turns() -> None:
        for a in range(2):
            await _serve(sched, prompts[a], 8, f"first{a}", history_len=18)
        for a in range(2):
            await _serve(sched, prompts[a][:18] + [1, 2, 3, 4], 2, f"next{a}")

    asyncio.run(turns())
    assert [next(w.cached_len for p in worker.plans for w in p.slots
                 if w.request_id == f"next{a}") for a in range(2)] == [18, 18]

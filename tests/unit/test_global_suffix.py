"""The global suffix index (daemon/proposers/global_suffix.py, issue 15 item 4): drafts from
text other requests hold, bounded in memory, its hits counted under their own source in
/metrics, the tokens those of plain decoding."""

from __future__ import annotations

import random

import pytest

from daemon.metrics import Metrics
from daemon.proposers.global_suffix import GlobalSuffixIndex
from daemon.proposers.suffix import SuffixProposer
from gpu_worker.engine import Engine
from scripts.tiny_model import make_tiny_model
from tests.unit.spec_serve import serve
from tests.unit.test_metrics import _value


def test_it_proposes_what_followed_in_another_segment():
    index = GlobalSuffixIndex(100, 2, 4)
    a, b = index.new_segment(), index.new_segment()
    index.extend(a, [1, 2, 3, 4, 5, 6])
    assert index.propose([9, 2, 3], 3) == [4, 5, 6]
    assert index.propose([9, 2, 3], 3, exclude=a) == []  # the asker's own: its own index
    index.extend(b, [7, 2, 3, 8])  # the latest occurrence wins...
    assert index.propose([2, 3], 2) == [8]
    assert index.propose([2, 3], 2, exclude=b) == [4, 5]  # ...but does not hide a's
    index.extend(a, [2, 3, 9])
    assert index.propose([2, 3], 2) == [9] and index.propose([2, 3], 2, exclude=a) == [8]
    assert index.propose([9, 9], 2) == [] and index.propose([2, 3], 0) == []
    assert index.propose([1, 2, 3], 2) == [4, 5]  # the longest match, "1 2 3", is a's


def test_it_agrees_with_the_per_request_index_on_one_segment():
    rng = random.Random(1)
    tokens = [rng.randrange(6) for _ in range(300)]
    index, own = GlobalSuffixIndex(1000, 2, 5), SuffixProposer(2, 5)
    seg = index.new_segment()
    for i in range(0, 300, 7):
        index.extend(seg, tokens[i:i + 7])
        own.extend(tokens[i:i + 7])
        for k in (1, 4):
            assert index.propose(own.history[-5:], k) == own.propose(k)


def test_memory_is_bounded_and_eviction_leaves_no_stale_entries():
    rng = random.Random(2)
    index = GlobalSuffixIndex(50, 2, 4)
    segs = [index.new_segment() for _ in range(6)]
    texts = {s: [] for s in segs}
    for _ in range(40):  # interleaved growth; extending makes a segment the most recent
        s = rng.choice(segs)
        chunk = [rng.randrange(8) for _ in range(rng.randrange(1, 6))]
        index.extend(s, chunk)
        texts[s] += chunk
        assert index.num_tokens == sum(map(len, index.segments.values())) <= 50
    assert index.evicted_segments > 0
    # one entry per n-gram (with a continuation) and surviving segment that holds it, at its
    # latest occurrence there: nothing of an evicted segment stays, nothing else is lost
    latest = {(n, tuple(h[e - n:e]), s): e for s, h in index.segments.items()
              for n in range(2, 5) for e in range(n, len(h))}
    assert index.num_entries() == len(latest) > 0
    for (n, gram, s), end in latest.items():
        held = index._index[n][hash(gram)]
        assert (s << 32 | end) in ([held] if isinstance(held, int) else held)
    for s, h in index.segments.items():  # and what survives is each segment's latest text
        assert texts[s][-len(h):] == h


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("m"), "qwen3_next", seed=6,
                           tokenizer=False)
    return Engine.from_dir(path, dtype="float64", max_slots=2, max_len=256).model


def _shared_text(model):
    """B's prompt and plain output, and A's prompt that holds B's prompt tail + output (as a
    file two agents read, one of them writing it out again)."""
    b_prompt = list(range(40, 64))
    (b_out, _), = serve(model, [b_prompt], n=30)[0]
    a_prompt = [7, 7, 3] + b_prompt[-6:] + b_out + [5, 1]
    return a_prompt, b_prompt


@pytest.mark.parametrize("tokens", [65536, 0])
def test_shared_text_drafts_under_their_own_source(model, tokens):
    a_prompt, b_prompt = _shared_text(model)
    plain, _, _ = serve(model, [a_prompt, b_prompt], n=[20, 30])
    metrics = Metrics()
    got, worker, sched = serve(model, [a_prompt, b_prompt], n=[20, 30], mode="wide",
                               metrics=metrics, global_index_tokens=tokens)
    assert got == plain
    sources = {int(s) for p in worker.plans for w in p.slots for s in w.draft_sources}
    hits = _value(metrics, "tandem_spec_verifies_total", source="global_suffix")
    accepted = _value(metrics, "tandem_spec_accepted_by_source_tokens_total",
                      source="global_suffix")
    if tokens == 0:
        assert 3 not in sources and hits is None and sched.draft_plan.index is None
        return
    assert 3 in sources and hits > 0 and accepted >= 10  # B's output is A's prompt
    assert sched.draft_plan.index.num_tokens <= tokens


def test_an_opted_out_request_is_not_indexed(model):
    a_prompt, b_prompt = _shared_text(model)
    plain, _, _ = serve(model, [a_prompt, b_prompt], n=[20, 30])
    metrics = Metrics()
    got, worker, _ = serve(model, [a_prompt, b_prompt], n=[20, 30], mode="wide",
                           metrics=metrics, speculation=[False, True])
    assert got == plain
    assert not any(len(w.draft_ids) for p in worker.plans for w in p.slots
                   if w.request_id == "r0")
    assert _value(metrics, "tandem_spec_verifies_total", source="global_suffix") is None

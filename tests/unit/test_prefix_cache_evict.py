"""Which prefix checkpoint goes when the cache is full (daemon/prefix_cache.py): a superseded
entry (a longer entry of its space begins with it) before any other, least recently used
first, so agents whose conversations grow keep each one's deepest checkpoint."""

from __future__ import annotations

import random

import pytest

from daemon.prefix_cache import PrefixCache


def _agent(a: int, n: int) -> list[int]:
    """Agent ``a``'s conversation, its first ``n`` tokens."""
    return [(a * 1000 + i) % 997 for i in range(n)]


def test_growing_conversations_keep_each_agents_deepest_checkpoint():
    """Three agents take turns; each turn reads its cached prefix, then checkpoints twice as
    its conversation grows by 16 tokens. Six entries: with least-recently-used alone the
    third agent's checkpoints were all gone by its second turn (the other two agents' new
    ones pushed them out while their own shallow ones stayed)."""
    cache, entry, hits = PrefixCache(max_blocks=10_000, block_size=4, max_entries=6), 0, []
    for turn in range(1, 5):
        for a in range(3):
            prompt = _agent(a, 16 * turn + 1)
            hit = cache.lookup(prompt)
            hits.append(None if hit is None else hit[1])
            for n in (16 * turn - 8, 16 * turn):
                entry += 1
                cache.add(_agent(a, n), entry)
    assert hits == [None] * 3 + [16] * 3 + [32] * 3 + [48] * 3


def _reference_victim(entries: list[tuple[tuple, int]], below: set) -> tuple:
    """The slow rule over (key, id) in least-recently-used order."""
    def superseded(key) -> bool:
        return key in below or any(
            k[0] == key[0] and len(k[1]) > len(key[1]) and k[1][:len(key[1])] == key[1]
            for k, _ in entries)
    return next((k for k, _ in entries if superseded(k)), entries[0][0])


@pytest.mark.parametrize("seed", range(5))
def test_evictions_follow_the_slow_rule_over_random_traffic(seed):
    rng = random.Random(seed)
    cache = PrefixCache(max_blocks=10_000, block_size=4, max_entries=8)
    order: list[tuple[tuple, int]] = []  # the reference's LRU list of (key, id)
    for entry in range(1, 400):
        space, agent = rng.randrange(2), rng.randrange(4)
        tokens = _agent(agent, rng.choice([8, 16, 24, 32, 40]))
        if rng.random() < 0.4:  # a lookup touches the longest cached prefix
            hit = cache.lookup(tokens + [1], space)
            if hit is not None:
                key = (space, tuple(tokens[:hit[1]]))
                order.append(order.pop(next(i for i, (k, _) in enumerate(order)
                                            if k == key)))
            continue
        if cache.contains(tokens, space):
            continue
        key = (space, tuple(tokens))
        below = {k for k, _ in order if k[0] == space and len(k[1]) < len(tokens)
                 and key[1][:len(k[1])] == k[1]}
        want = []
        if len(order) >= 8:
            victim = _reference_victim(order, below)
            want = [dict(order)[victim]]
            order = [(k, e) for k, e in order if k != victim]
        assert cache.add(tokens, entry, space) == want
        order.append((key, entry))
        assert len(cache) == len(order)


def test_a_finished_requests_end_goes_first_until_a_turn_hits_it():
    """The weak entry (a finished request's prompt and answer) neither pushes out the
    prompt's own checkpoint it extends nor outlives it: a client that sends back other text
    still finds the prompt's checkpoint. Hit once, it is an ordinary entry."""
    cache = PrefixCache(max_blocks=10_000, block_size=4, max_entries=3)
    prompt, answer = _agent(0, 16), _agent(0, 28)  # the answer extends the prompt
    cache.add(prompt, 1)
    cache.add(answer, 2, weak=True)
    cache.add(_agent(1, 16), 3)
    assert cache.add(_agent(2, 16), 4) == [2]  # the weak end goes, not the older prompt
    assert cache.lookup(prompt + [5]) == (1, 16)  # other text after the prompt: still a hit
    # full of ordinary entries: a weak end is not kept (it would push one out)
    assert not cache.admits(len(answer), weak=True) and cache.admits(len(answer))
    assert cache.add(_agent(1, 20), 5) == [3]  # it supersedes agent 1's 16 tokens: they go
    cache = PrefixCache(max_blocks=10_000, block_size=4, max_entries=4)
    for e, (a, n) in enumerate(((1, 8), (1, 16), (0, 16), (2, 16)), 1):
        cache.add(_agent(a, n), e)
    assert cache.admits(len(answer), weak=True)  # agent 1's 8 tokens are superseded
    assert cache.add(answer, 5, weak=True) == [1]
    assert cache.lookup(answer + [7]) == (5, 28)  # the next turn repeats the answer
    assert cache.add(_agent(3, 16), 6) == [2]  # now ordinary: it stays, weak it would go
    assert cache.contains(answer) and cache.contains(_agent(0, 16))


def test_weak_ends_never_push_out_the_agents_next_turn_checkpoints():
    """The 80B's shape in small (session 20, H100 machine: 4,202-7,219 of ~12,000 reusable
    prompt tokens cached): four agents, each turn checkpoints where its history ends (the next
    turn's prefix), then the prompt with the generation prompt and the finished answer come as
    weak ends a little longer. The byte budget holds the four history checkpoints and a
    little more: every agent's next turn hits its own. When a weak end could push out any
    entry (least recently used once no weak or superseded one was left), an end larger than
    the room those gave took another agent's history checkpoint."""
    MB = 2**20
    cache = PrefixCache(10_000, 4, block_bytes=MB, state_bytes=20 * MB, max_bytes=160 * MB)
    entry, hits = 0, []
    for turn in range(1, 4):
        for a in range(4):
            history = _agent(a, 20 * turn)  # 5 blocks + states: 25 MB ... 35 MB at turn 3
            hit = cache.lookup(history + [1], a)
            hits.append(None if hit is None else hit[1])
            for n, weak in ((20 * turn, False), (20 * turn + 3, True), (20 * turn + 9, True)):
                entry += 1
                if cache.admits(n, weak):
                    cache.add(_agent(a, n), entry, a, weak=weak)
            assert cache.used_bytes <= 160 * MB
    assert hits == [None] * 4 + [20] * 4 + [40] * 4

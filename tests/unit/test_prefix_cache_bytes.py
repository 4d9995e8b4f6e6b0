"""GDN checkpoints count against prefix_cache_max_mb (issue 16, item 7): each prefix entry
holds a copy of one slot's recurrent states besides its KV blocks."""

from __future__ import annotations

from daemon.prefix_cache import PrefixCache

MB = 2**20


def test_state_snapshots_count_against_the_byte_budget():
    # 8 MB budget, 1 MB per KV block of 16 tokens, 3 MB of GDN states per entry
    cache = PrefixCache(64, 16, block_bytes=MB, state_bytes=3 * MB, max_bytes=8 * MB)
    assert cache.add(list(range(16)), 1) == []  # 1 block + states = 4 MB
    assert cache.add(list(range(100, 116)), 2) == []  # 8 MB in all
    assert cache.used_bytes == 8 * MB
    assert cache.add(list(range(200, 216)), 3) == [1]  # the oldest goes
    assert cache.used_bytes <= 8 * MB and len(cache) == 2
    assert not cache.fits(16 * 6)  # 6 blocks + states > 8 MB: never kept
    assert cache.fits(16 * 5)


def test_emptied_keeps_the_bounds():
    cache = PrefixCache(64, 16, block_bytes=MB, state_bytes=3 * MB, max_bytes=8 * MB)
    cache.add(list(range(16)), 1)
    fresh = cache.emptied()
    assert len(fresh) == 0 and (fresh.block_bytes, fresh.state_bytes, fresh.max_bytes) == (
        MB, 3 * MB, 8 * MB)

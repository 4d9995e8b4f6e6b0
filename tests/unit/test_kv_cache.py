import numpy as np
import pytest

from gpu_worker.kv_cache import BlockAllocator, CacheFull, KVCache


def _cache(blocks=6, bs=4):
    return KVCache(np, 2, blocks, bs, 1, 2, np.float64)


def _kv(n, base):
    k = np.arange(n * 2, dtype=np.float64).reshape(n, 1, 2) + base
    return k, -k


def test_write_read_across_blocks():
    c = _cache()
    k, v = _kv(10, 0)
    c.write(1, 3, 0, k[:3], v[:3])
    c.write(1, 3, 3, k[3:], v[3:])
    rk, rv = c.read(1, 3, 10)
    assert np.array_equal(rk, k) and np.array_equal(rv, v)
    assert len(c.tables[3]) == 3
    assert not c.read(0, 3, 10)[0].any()  # other layer untouched


def test_shared_prefix_is_copied_on_write():
    c = _cache()
    k, v = _kv(6, 0)
    c.write(0, 0, 0, k, v)
    c.share(1, c.tables[0][:1])  # slot 1 references the first block (positions 0..3)
    assert c.allocator.refcount(c.tables[0][0]) == 2
    k2, v2 = _kv(1, 100)
    c.write(0, 1, 3, k2, v2)  # overwrite position 3 in slot 1 only
    assert np.array_equal(c.read(0, 0, 6)[0], k)
    got = c.read(0, 1, 4)[0]
    assert np.array_equal(got[:3], k[:3]) and np.array_equal(got[3], k2[0])
    assert c.tables[1][0] != c.tables[0][0]


def test_free_returns_blocks_and_full_raises():
    c = _cache(blocks=3)
    c.ensure(0, 12)
    assert c.allocator.num_free == 0 and not c.can_grow(1, 1)
    with pytest.raises(CacheFull):
        c.ensure(1, 1)
    c.free_slot(0)
    assert c.allocator.num_free == 3


def test_allocator_refcounts():
    a = BlockAllocator(2)
    ids = a.allocate(2)
    a.incref(ids[:1])
    a.free(ids)
    assert a.num_free == 1
    a.free(ids[:1])
    assert a.num_free == 2
    with pytest.raises(AssertionError):
        a.free(ids[:1])

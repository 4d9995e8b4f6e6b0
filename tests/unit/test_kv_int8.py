"""int8 KV blocks (docs/architecture.md §6): the row quantizer against a slow formula, copy-on-write
and swaps carrying the scales, a model close to its float-KV self, and speculative decoding
still giving plain decoding's tokens (a row's stored bits do not depend on its batch)."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.engine import Engine
from gpu_worker.kv_cache import KVCache
from gpu_worker.model.batch import RaggedBatch
from scripts.tiny_model import make_tiny_model


def _slow(x: np.ndarray) -> np.ndarray:
    """Quantize then dequantize, value by value: d = fp16(amax/127) per 32, q = rint(x/d)."""
    out = np.empty_like(x)
    flat, res = x.reshape(-1, 32), out.reshape(-1, 32)
    for b in range(flat.shape[0]):
        d = float(np.float16(np.float32(np.abs(flat[b]).max()) / np.float32(127)))
        for j in range(32):
            q = 0.0 if d == 0 else min(127.0, max(-127.0, float(np.rint(np.float32(
                flat[b, j]) / np.float32(d)))))
            res[b, j] = q * d
    return out


def test_rows_read_back_as_the_slow_formula_says():
    rng = np.random.default_rng(0)
    c = KVCache(np, 2, 8, 4, 2, 64, np.float64, quant=True)
    k = rng.standard_normal((10, 2, 64)) * np.logspace(-3, 2, 64)
    v = rng.standard_normal((10, 2, 64))
    k[3] = 0.0  # an all-zero row
    c.write(1, 0, 0, k[:4], v[:4])
    c.write(1, 0, 4, k[4:], v[4:])
    rk, rv = c.read(1, 0, 10)
    np.testing.assert_array_equal(rk, _slow(k))
    np.testing.assert_array_equal(rv, _slow(v))
    assert c.k.dtype == np.int8 and c.ks.dtype == np.float16
    assert np.abs(rv - v).max() <= np.abs(v).max() / 127  # half a step of the largest scale
    with pytest.raises(ValueError, match="multiple of 32"):
        KVCache(np, 1, 2, 4, 1, 48, np.float32, quant=True)


def test_copy_on_write_and_gather_carry_the_scales():
    rng = np.random.default_rng(1)
    c = KVCache(np, 1, 8, 4, 1, 32, np.float32, quant=True)
    k, v = rng.standard_normal((2, 6, 1, 32)).astype(np.float32)
    c.write(0, 0, 0, k, v)
    want = c.read(0, 0, 6)
    c.share(1, c.tables[0])
    c.write(0, 1, 5, k[:1] * 50, v[:1])  # into the shared second block: slot 1 copies it
    np.testing.assert_array_equal(c.read(0, 0, 6)[0], want[0])
    np.testing.assert_array_equal(c.read(0, 1, 5)[0], want[0][:5])
    saved = c.gather(c.tables[0])
    assert len(saved) == 4
    c.ensure(2, 6)
    c.scatter(c.tables[2], saved)
    np.testing.assert_array_equal(c.read(0, 2, 6)[1], want[1])


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_moe"])
def model_path(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m"), request.param, seed=4,
                           tokenizer=False, head_dim=32)


def test_the_model_with_int8_kv_stays_close_to_float_kv(model_path):
    engine = Engine.from_dir(model_path, dtype="float64", max_slots=1, max_len=64)
    model = engine.model
    ids = np.arange(3, 43) * 7 % 500
    out = {}
    for name, int8 in (("float", False), ("int8", True)):
        caches = model.new_caches(1, 64, 16, kv_int8=int8)
        first = model.forward(RaggedBatch.build([(0, 0, ids[:30])]), caches,
                              np.arange(30)).logits
        rest = model.forward(RaggedBatch.build([(0, 30, ids[30:])]), caches,
                             np.arange(10)).logits
        out[name] = np.concatenate([first, rest])
    diff = np.abs(out["int8"] - out["float"]).max() / np.abs(out["float"]).max()
    assert 0 < diff < 0.02, diff
    agree = (out["int8"].argmax(-1) == out["float"].argmax(-1)).mean()
    assert agree >= 0.9, agree


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_speculation_with_int8_kv_gives_the_tokens_of_plain_decoding(model_path, temperature):
    from tests.unit.test_speculation import CONTEXT, SLOTS, _drafts, _serve

    model = Engine.from_dir(model_path, dtype="float64", max_slots=SLOTS,
                            max_len=CONTEXT).model
    plain, _ = _serve(model, "off", temperature, kv_int8=True)
    for mode in ("narrow", "wide"):
        got, worker = _serve(model, mode, temperature, oracle=plain, kv_int8=True)
        assert got == plain, mode
        proposed, accepted = _drafts(worker)
        assert 0 < accepted < proposed

"""The prefix cache's host tier on CuPy in bf16 (tests/unit/test_prefix_cache_host.py on the
NumPy backend): a checkpoint copied from the device to host memory (OFFLOAD) and back into
new KV blocks (SHARE_PREFIX) gives the next turn a cold start's tokens, for both
architectures (bf16 rows are the same bits however a prompt is chunked)."""

from __future__ import annotations

import pytest

from protocol.messages import CacheOpKind
from tests.unit.test_prefix_cache_host import next_turn

pytest.importorskip("cupy")  # before the module's bf16 model is built (conftest.bf16_model)


def test_a_turn_from_host_memory_gives_a_cold_starts_tokens_in_bf16(bf16_model):
    cold_cached, cold_tokens, _ = next_turn(bf16_model, host_mb=0)
    cached, tokens, ops = next_turn(bf16_model, host_mb=64)
    assert cold_cached == 0
    assert cached == 18 and CacheOpKind.OFFLOAD in ops
    assert tokens == cold_tokens

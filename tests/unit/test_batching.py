"""A ragged batch of several slots gives bit-identical logits to each slot run alone (float64)."""

import numpy as np
import pytest

from gpu_worker.engine import Engine
from scripts.tiny_model import make_tiny_model

# Per step: (slot, start, number of tokens) for every slot that takes part.
SCHEDULE = [
    [(0, 0, 9), (1, 0, 3)],
    [(0, 9, 1), (1, 3, 6), (2, 0, 5)],
    [(0, 10, 1), (1, 9, 1), (2, 5, 1), (3, 0, 12)],
    [(0, 11, 1), (1, 10, 1), (2, 6, 4), (3, 12, 1)],
    [(0, 12, 1), (1, 11, 1), (2, 10, 1), (3, 13, 1)],
]


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_next"])
def model_dir(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=5,
                           tokenizer=False, experts=8, topk=3, layers=4)


def _run(engine, steps, tokens):
    """Run the schedule; return {(slot, position): logits row}."""
    out = {}
    for step in steps:
        parts = [(slot, start, tokens[slot][start:start + n]) for slot, start, n in step]
        rows = np.arange(sum(n for _, _, n in step))
        logits = engine.forward(parts, rows).logits
        r = 0
        for slot, start, n in step:
            for i in range(n):
                out[(slot, start + i)] = logits[r]
                r += 1
    return out


def test_ragged_batch_is_bit_identical_to_each_slot_alone(model_dir):
    rng = np.random.default_rng(0)
    tokens = {s: rng.integers(0, 512, size=16) for s in range(4)}
    batched = Engine.from_dir(model_dir, dtype="float64", max_slots=4, max_len=32)
    together = _run(batched, SCHEDULE, tokens)
    for slot in range(4):
        alone = Engine.from_dir(model_dir, dtype="float64", max_slots=4, max_len=32)
        mine = [[part for part in step if part[0] == slot] for step in SCHEDULE]
        single = _run(alone, [s for s in mine if s], tokens)
        for key, row in single.items():
            assert np.array_equal(row, together[key]), f"slot {slot} position {key[1]} differs"
    assert len(together) == sum(n for step in SCHEDULE for _, _, n in step)


def test_float32_batch_matches_closely(model_dir):
    """Without exact mode, batching changes at most rounding."""
    rng = np.random.default_rng(1)
    tokens = {s: rng.integers(0, 512, size=16) for s in range(4)}
    a = _run(Engine.from_dir(model_dir, max_slots=4, max_len=32), SCHEDULE, tokens)
    b = _run(Engine.from_dir(model_dir, dtype="float64", max_slots=4, max_len=32), SCHEDULE,
             tokens)
    worst = max(np.abs(a[k] - b[k]).max() for k in a)
    assert 0 < worst < 1e-5

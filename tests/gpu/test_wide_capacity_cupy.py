"""Wide speculation's capacities on the CuPy backend (float64, batch-invariant rows): every
layout up to 4 slots x 4 drafts, six drafted slots taking turns, one pass for one drafted
slot; the tests of tests/unit/test_wide_capacity.py, run with a CuPy model."""

from __future__ import annotations

import pytest

from gpu_worker.engine import Engine
from scripts.tiny_model import make_tiny_model
from tests.unit.test_wide_capacity import (  # noqa: F401 (collected here with this model)
    CONTEXT,
    test_every_layout_up_to_four_slots_by_four_drafts_gives_plain_tokens,
    test_one_drafted_slot_costs_one_pass_and_goes_solo_when_alone,
    test_six_drafted_slots_take_turns_in_one_pass_with_plain_tokens,
)

cupy = pytest.importorskip("cupy")


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_moe"])
def model(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("m"), request.param, seed=5,
                           tokenizer=False)
    return Engine.from_dir(path, dtype="float64", backend="cupy", max_slots=6,
                           max_len=CONTEXT).model

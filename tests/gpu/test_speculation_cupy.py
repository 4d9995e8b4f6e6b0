"""Speculative verification on the CuPy backend (float64, batch-invariant rows): narrow and
wide steps with suffix, MTP and oracle drafts give plain decoding's tokens, through the
scheduler and the real Runner, as tests/unit/test_speculation.py proves on NumPy."""

from __future__ import annotations

import pytest

from gpu_worker.engine import Engine
from scripts.tiny_model import make_tiny_model
from tests.unit.test_speculation import CONTEXT, SLOTS, _drafts, _serve

cupy = pytest.importorskip("cupy")


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_moe"])
def model(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("m"), request.param, seed=4,
                           tokenizer=False)
    return Engine.from_dir(path, dtype="float64", backend="cupy", max_slots=SLOTS,
                           max_len=CONTEXT).model


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_verification_on_the_gpu_gives_the_tokens_of_plain_decoding(model, temperature):
    plain, _ = _serve(model, "off", temperature)
    for mode in ("narrow", "wide"):
        got, worker = _serve(model, mode, temperature, oracle=plain)
        assert got == plain, ("oracle", mode)
        proposed, accepted = _drafts(worker)
        assert 0 < accepted < proposed
        got, _ = _serve(model, mode, temperature, min_match=1)
        assert got == plain, ("suffix", mode)
        if model.mtp is not None:
            got, worker = _serve(model, mode, temperature, proposer="mtp", num_drafts=3)
            assert got == plain, ("mtp", mode)
            assert _drafts(worker)[0] > 0

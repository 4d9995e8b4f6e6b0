"""The shipped model (models/tandem-tiny): Tandem's NumPy backend reproduces transformers'
logits and the training script's MTP logits (reference_logits.npz, computed in float32 by
transformers and the training code after training), and answers a coding prompt with code."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from daemon.config import DEFAULT_MODEL
from gpu_worker.engine import Engine
from gpu_worker.model.batch import RaggedBatch

pytestmark = pytest.mark.parity
TOL = 1e-4  # |logits| reach ~18 here; the bound for that regime is 1e-3


@pytest.fixture(scope="module")
def reference():
    return np.load(DEFAULT_MODEL / "reference_logits.npz")


@pytest.fixture(scope="module")
def engine():
    return Engine.from_dir(DEFAULT_MODEL, max_slots=1, max_len=128)


@pytest.mark.parametrize("seq", [0, 1])
def test_logits_and_mtp_match_the_training_reference(engine, reference, seq):
    ids = reference["input_ids"][seq].astype(np.int64)
    n = ids.size
    engine.caches.reset_slot(0)
    out = engine.model.forward(RaggedBatch.build([(0, 0, ids)]), engine.caches, np.arange(n))
    pos = reference["positions"]
    assert np.abs(reference["logits"][seq]).max() > 5
    np.testing.assert_allclose(out.logits[pos], reference["logits"][seq], rtol=0, atol=TOL)
    np.testing.assert_allclose(out.hidden[pos], reference["hidden_final"][seq], rtol=0, atol=TOL)
    top = np.take_along_axis(out.logits, reference["top32_idx"][seq], axis=1)
    np.testing.assert_allclose(top, reference["top32_val"][seq], rtol=0, atol=TOL)

    # MTP row t: token t+1 at position t with the main model's h_t; predicts token t+2
    mtp = engine.model.mtp_forward(RaggedBatch.build([(0, 0, ids[1:])]), out.hidden[:n - 1],
                                   engine.caches)
    np.testing.assert_allclose(mtp.logits[pos], reference["mtp_logits"][seq], rtol=0, atol=TOL)
    top = np.take_along_axis(mtp.logits, reference["mtp_top32_idx"][seq], axis=1)
    np.testing.assert_allclose(top, reference["mtp_top32_val"][seq], rtol=0, atol=TOL)


def test_logits_match_transformers_directly(engine):
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32)
    ids = np.arange(100, 164) * 37 % 8000
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0].numpy()
    np.testing.assert_allclose(engine.score(ids), ref, rtol=0, atol=TOL)


def test_chat_prompt_gets_python_code(engine):
    from daemon.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(DEFAULT_MODEL)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that reverses a string"}])
    from protocol.messages import SamplingParams

    out = engine.generate(tok.encode(prompt), params=SamplingParams(temperature=0),
                          max_tokens=96, eos_ids=tuple(tok.eos_token_ids))
    text = tok.decode(out)
    assert "def " in text and "return" in text, text

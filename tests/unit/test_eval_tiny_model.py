"""scripts/eval_tiny_model.py: window offsets, stopping rules, and its measurements on the
shipped tandem-tiny against transformers' reference logits."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "tandem-tiny"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("eval_tiny_model",
                                                  ROOT / "scripts" / "eval_tiny_model.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["eval_tiny_model"] = mod
    spec.loader.exec_module(mod)
    return mod


ev = _load()


@pytest.mark.parametrize(("n_tokens", "windows", "head", "tail", "total"), [
    # torch.linspace(0, n_tokens - 514, windows).long() (torch 2.x, CPU)
    (680727, 128, [0, 5356, 10712], [669501, 674857, 680213], 43533573),
    (680727, 100, [0, 6870, 13741], [666471, 673342, 680213], 34010602),
    (67133, 128, [0, 524, 1049], [65569, 66094, 66619], 4263553),
    (723629, 32, [0, 23326, 46652], [676462, 699788, 723115], 11569825),
])
def test_offsets_match_torch_linspace(n_tokens: int, windows: int, head: list[int],
                                      tail: list[int], total: int) -> None:
    offs = ev.eval_offsets(n_tokens, 512, windows)
    assert offs[:3].tolist() == head and offs[-3:].tolist() == tail
    assert int(offs.sum()) == total


def test_offsets_fused_multiply_add_cases() -> None:
    # plain float32 (no FMA) gets these two one lower than torch does
    assert ev.eval_offsets(680727, 512, 100)[62] == 425991
    assert ev.eval_offsets(723629, 512, 32)[24] == 559830


def test_offsets_short_stream() -> None:
    assert ev.eval_offsets(1000, 512, 128).tolist() == [0]


def test_stopping_rules() -> None:
    # the training script's rule stops at trailing indentation of the second line
    assert ev.transformers_rule("    x = 1\n   ")
    assert not ev.transformers_rule("    x = 1\n")
    assert not ev.transformers_rule("    x = 1")
    assert not ev.full_body_rule("    x = 1\n   ")
    assert ev.full_body_rule("    x = 1\n\ndef")
    assert ev.body_of("    x = 1\n\ndef f():\n    pass") == "    x = 1\n"
    assert ev.compiles("def f():\n", "    return 1")
    assert not ev.compiles("def f():\n", "    return (1")
    assert not ev.compiles("def f():\n", "  \n")


@pytest.fixture(scope="module")
def engine():  # noqa: ANN201
    from gpu_worker.engine import Engine

    eng = Engine.from_dir(MODEL, dtype="float32", max_slots=1, max_len=128)
    yield eng
    eng.close()


def test_window_matches_transformers_reference(engine) -> None:  # noqa: ANN001
    """Top-1, MTP top-1 and MTP agreement of a reference sequence equal those of
    transformers' top-32 tables in reference_logits.npz."""
    ref = np.load(MODEL / "reference_logits.npz")
    for b in range(ref["input_ids"].shape[0]):
        ids = ref["input_ids"][b].astype(np.int64)  # 48 tokens: a window of seq 47
        r = ev.eval_window(engine, ids, True)
        main = ref["top32_idx"][b, :, 0]  # transformers' argmax at t, predicts t+1
        mtp = ref["mtp_top32_idx"][b, :, 0]  # MTP argmax at t, predicts t+2
        assert r["n"] == 47 and r["mtp_n"] == 46
        assert r["top1"] == int((main[:47] == ids[1:]).sum())
        assert r["mtp_top1"] == int((mtp[:46] == ids[2:]).sum())
        assert r["agree"] == int((mtp[:46] == main[1:47]).sum())
        logits = engine.score(ids[:47]).astype(np.float64)
        lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        nll = float((lse - logits[np.arange(47), ids[1:]]).sum())
        assert r["nll"] == pytest.approx(nll, rel=1e-6)


def test_greedy_completion_matches_engine_generate(engine) -> None:  # noqa: ANN001
    from daemon.tokenizer import Tokenizer
    from gpu_worker.sampling import SamplingParams

    tok = Tokenizer.from_dir(MODEL)
    eos = tuple(tok.eos_token_ids)
    prompt = tok.encode('def add(a, b):\n    """Return the sum of a and b."""\n')
    out, hf_stop = ev.greedy_completion(engine, tok, prompt, 24, eos)
    ref = engine.generate(prompt, params=SamplingParams(temperature=0), max_tokens=24,
                          eos_ids=eos)
    assert out == ref[: len(out)]
    assert hf_stop is None or 1 <= hf_stop <= len(out)

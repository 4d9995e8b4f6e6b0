"""scripts/eval_tiny_model.py (eval_heldout, eval_compile, compile_rule): window offsets,
stopping rules, and its measurements on the shipped tandem-tiny against transformers'
reference logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from scripts import compile_rule as rule
from scripts import eval_compile, eval_heldout

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "tandem-tiny"



@pytest.mark.parametrize(("n_tokens", "windows", "head", "tail", "total"), [
    # torch.linspace(0, n_tokens - 514, windows).long() (torch 2.x, CPU)
    (680727, 128, [0, 5356, 10712], [669501, 674857, 680213], 43533573),
    (680727, 100, [0, 6870, 13741], [666471, 673342, 680213], 34010602),
    (67133, 128, [0, 524, 1049], [65569, 66094, 66619], 4263553),
    (723629, 32, [0, 23326, 46652], [676462, 699788, 723115], 11569825),
])
def test_offsets_match_torch_linspace(n_tokens: int, windows: int, head: list[int],
                                      tail: list[int], total: int) -> None:
    offs = eval_heldout.eval_offsets(n_tokens, 512, windows)
    assert offs[:3].tolist() == head and offs[-3:].tolist() == tail
    assert int(offs.sum()) == total


def test_offsets_fused_multiply_add_cases() -> None:
    # plain float32 (no FMA) gets these two one lower than torch does
    assert eval_heldout.eval_offsets(680727, 512, 100)[62] == 425991
    assert eval_heldout.eval_offsets(723629, 512, 32)[24] == 559830


def test_offsets_short_stream() -> None:
    assert eval_heldout.eval_offsets(1000, 512, 128).tolist() == [0]


def test_body_rules() -> None:
    # the body ends at the first non-blank line at column 0, not at the second line's indent
    assert not rule.body_ended("    x = 1\n   ")
    assert not rule.body_ended("    if x:\n        y = 1\n\n    return y\n")
    assert rule.body_ended("    x = 1\n\ndef")
    assert rule.body_of("    x = 1\n\ndef f():\n    pass") == "    x = 1\n"
    assert rule.extract_body("    x = 1\n\ndef f():\n    pass", "dedent") == "    x = 1\n"
    assert rule.extract_body("    x = 1\n    return x", "eos") == "    x = 1\n    return x"
    # cut by the token limit: the trailing partial line goes, complete lines stay
    assert rule.extract_body("    x = 1\n    return (x", "limit") == "    x = 1\n"
    assert rule.extract_body("    x = 1\n    y = 2\n", "limit") == "    x = 1\n    y = 2\n"
    assert rule.extract_body("    return (x", "limit") == ""
    # the old rule fired at the indentation of the second line
    assert eval_compile.first_line_rule("    x = 1\n   ")
    assert not eval_compile.first_line_rule("    x = 1\n")


def test_compiles() -> None:
    assert rule.compiles("def f():\n", "    return 1")
    assert rule.compiles("def f(x):\n", "    if x:\n        return 1\n    return 2\n")
    assert not rule.compiles("def f(x):\n", "    if x:\n")  # a block header cut off
    assert not rule.compiles("def f():\n", "    return (1")
    assert not rule.compiles("def f():\n", "  \n")


class _FakeTok:
    """Token i decodes to PIECES[i]; ids >= len(PIECES) are special (EOS)."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.pieces[i] for i in ids if i < len(self.pieces))


class _FakeEngine:
    """Emits a scripted token sequence greedily (one-hot logits)."""

    def __init__(self, script: list[int], vocab: int) -> None:
        self.script, self.vocab, self.step = script, vocab, 0
        self.forwards = 0

    def _row(self) -> np.ndarray:
        row = np.zeros((1, self.vocab), dtype=np.float32)
        row[0, self.script[self.step]] = 1.0
        self.step += 1
        return row

    def prefill(self, slot: int, ids: np.ndarray) -> np.ndarray:
        self.step = 0
        return self._row()

    def forward(self, parts: list) -> object:
        self.forwards += 1
        return type("Out", (), {"logits": self._row()})()


PIECES = ["    ", "if x", ":", "\n", "        ", "return 1", "return 2", "def", " g", "(", "\n\n",
          "x = ["]
EOS = 12


def _run(script: list[int], max_new: int = 160) -> tuple[list[int], str, str]:
    tok, eng = _FakeTok(PIECES), _FakeEngine(script, 13)
    out, stop, _ = eval_compile.greedy_completion(eng, tok, [1, 2], max_new, (EOS,))  # type: ignore[arg-type]
    return out, stop, rule.extract_body(tok.decode(out, skip_special_tokens=True), stop)


def test_greedy_completion_stops_at_dedent() -> None:
    # "    if x:\n        return 1\n    return 2\n\ndef g(" -> stops at "def", a 2-line
    # indentation does not stop it (the old rule would have stopped after "\n        ")
    script = [0, 1, 2, 3, 4, 5, 3, 0, 6, 10, 7, 8, 9, 3]
    out, stop, body = _run(script)
    assert stop == "dedent" and out == script[:11]
    assert body == "    if x:\n        return 1\n    return 2\n"
    assert rule.compiles("def f(x):\n", body)


def test_greedy_completion_stops_at_eos() -> None:
    script = [0, 1, 2, 3, 4, 5, EOS, 3]
    out, stop, body = _run(script)
    assert stop == "eos" and out == script[:6]  # EOS excluded
    assert body == "    if x:\n        return 1"
    assert rule.compiles("def f(x):\n", body)


def test_greedy_completion_cut_by_limit() -> None:
    script = [0, 1, 2, 3, 4, 5, 3, 0, 11, 0]
    out, stop, body = _run(script, max_new=9)
    assert stop == "limit" and out == script[:9]
    # "    x = [" is the partial last line: dropped
    assert body == "    if x:\n        return 1\n"
    assert rule.compiles("def f(x):\n", body)
    # a column-0 line exactly at the limit ends the body (not cut)
    out, stop, body = _run([0, 5, 3, 7, 0], max_new=4)
    assert stop == "dedent" and body == "    return 1"


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
        r = eval_heldout.eval_window(engine, ids, True)
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
    from protocol.messages import SamplingParams

    tok = Tokenizer.from_dir(MODEL)
    eos = tuple(tok.eos_token_ids)
    prompt = tok.encode('def add(a, b):\n    """Return the sum of a and b."""\n')
    out, stop, old_stop = eval_compile.greedy_completion(engine, tok, prompt, 24, eos)
    ref = engine.generate(prompt, params=SamplingParams(temperature=0), max_tokens=24,
                          eos_ids=eos)
    assert out == ref[: len(out)]
    assert stop in ("dedent", "eos", "limit")
    assert (stop == "limit") == (len(out) == 24 and not rule.body_ended(tok.decode(out)))
    assert old_stop is None or 1 <= old_stop <= len(out)

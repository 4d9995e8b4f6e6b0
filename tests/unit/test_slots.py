"""A request's text: incremental detokenizing, stop strings held back while they may match."""

from __future__ import annotations

import pytest

from daemon.request import GenerationRequest, RequestHandle
from daemon.sequence import Sequence
from daemon.tokenizer import Tokenizer
from protocol.messages import SamplingParams
from scripts.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_dir(make_tiny_model(tmp_path_factory.mktemp("t"), "qwen3_moe"))


def _seq(tok, stop=(), max_tokens=100, eos=frozenset()):
    req = GenerationRequest("r", [1], SamplingParams(temperature=0), max_tokens, stop=stop)
    return Sequence(req, RequestHandle("r", lambda _: None), 0, tok.detokenizer(), eos, 0)


def _stream(seq, ids):
    text = []
    for t in ids:
        ev = seq.add_tokens([t])
        if ev is not None:
            text.append(ev.text)
        if seq.finished:
            break
    return "".join(text)


def test_stop_string_split_across_tokens_never_leaks(tok):
    text = "def f(x):\n    return x + 1\n\nprint(f(2))"
    ids = tok.encode(text)
    seq = _seq(tok, stop=("\n\nprint",))
    out = _stream(seq, ids)
    assert out == "def f(x):\n    return x + 1"
    assert seq.finished == "stop"


def test_without_stop_the_stream_equals_full_decode(tok):
    text = "naïve café — 東京 🙂 done"
    ids = tok.encode(text)
    seq = _seq(tok, max_tokens=len(ids))
    assert _stream(seq, ids) == tok.decode(ids) and seq.finished == "length"


def test_eos_ends_without_emitting_it(tok):
    ids = tok.encode("abc")
    seq = _seq(tok, eos=frozenset({ids[1]}))
    seq.add_tokens(ids)
    assert seq.finished == "stop" and seq.generated == ids[:1]

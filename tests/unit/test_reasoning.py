"""A leading <think> block of a chat answer -> reasoning_content (daemon/openai_reasoning.py):
the whole-text split, and the streaming split giving the same text however it is cut."""

from __future__ import annotations

import pytest

from daemon.openai_format import Formatter
from daemon.openai_reasoning import ReasoningStream, split_reasoning

CASES = [  # answer -> (reasoning or None, content)
    ("<think>\n\n</think>\n\nHello!", ("", "Hello!")),
    ("<think>\nFirst, reverse.\nThen return.\n</think>\n\n```python\nx\n```",
     ("First, reverse.\nThen return.", "```python\nx\n```")),
    ("\n<think>a < b </thin k></think>rest\n", ("a < b </thin k>", "rest\n")),
    ("No reasoning here.", (None, "No reasoning here.")),
    ("Mid <think>not a block</think> text", (None, "Mid <think>not a block</think> text")),
    ("<think>\ncut by max_tokens", ("cut by max_tokens", "")),
    ("<thi", (None, "<thi")),
    ("", (None, "")),
    ("<think></think>", ("", "")),
]


@pytest.mark.parametrize("text,want", CASES)
def test_split(text, want):
    assert split_reasoning(text) == want


def _streamed(pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    stream = ReasoningStream()
    out = [p for piece in pieces for p in stream.feed(piece)] + stream.finish()
    return ("".join(t for k, t in out if k == "reasoning"),
            "".join(t for k, t in out if k == "content"), out)


@pytest.mark.parametrize("text,want", CASES)
def test_stream_gives_the_same_split_however_the_text_is_cut(text, want):
    reasoning, content = want
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in cuts:
        got_r, got_c, out = _streamed(pieces)
        assert (got_r, got_c) == (reasoning or "", content), pieces
        assert all(t for _, t in out)  # no empty pieces
        kinds = [k for k, _ in out]
        assert kinds == sorted(kinds, key=lambda k: k == "content")  # reasoning first


def test_stream_gives_reasoning_before_the_block_closes():
    stream = ReasoningStream()
    assert stream.feed("<think>\nstep one") == [("reasoning", "step one")]
    assert stream.feed(" and two\n</th") == [("reasoning", " and two")]  # "\n</th" held
    assert stream.feed("ink>\n\nok") == [("content", "ok")]


def test_formatter_shapes():
    fmt = Formatter("chat", "r1", "m", 0)
    chunk = fmt.chunk(reasoning="thinking")
    assert chunk["choices"][0]["delta"] == {"reasoning_content": "thinking"}
    msg = fmt.response("hi", "stop", {}, reasoning="why")["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "hi", "reasoning_content": "why"}
    msg = fmt.response("hi", "stop", {}, reasoning="")["choices"][0]["message"]
    assert "reasoning_content" not in msg  # an empty block is not reported

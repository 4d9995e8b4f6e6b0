"""Reasoning in chat answers, as Qwen3's templates produce it: a leading

    <think>
    ...
    </think>

block becomes the message's ``reasoning_content`` (the field vLLM and OpenAI-compatible
clients read), the rest its ``content``. Only a block at the very start of the answer
(after optional whitespace) counts; an answer cut inside it (max_tokens) is all reasoning.
``[server] split_reasoning = false`` leaves answers untouched.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning or None when the answer has no leading block, content)."""
    stream = ReasoningStream()
    pieces = stream.feed(text) + stream.finish()
    reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
    content = "".join(t for kind, t in pieces if kind == "content")
    return (reasoning if stream.had_block else None), content


class ReasoningStream:
    """The same split over a stream of text pieces: :meth:`feed` returns ``(kind, text)``
    pieces ("reasoning" or "content") as soon as they are certain; text that may still be the
    start of a tag (or newlines that may precede the closing one) is held back until the
    next piece or :meth:`finish`. Newlines around the reasoning and before the content are
    dropped, as Qwen3's template writes them."""

    def __init__(self) -> None:
        self.state = "start"  # start -> think -> after -> content; or start -> content
        self.held = ""
        self.had_block = False
        self._reasoned = False  # some reasoning text was given out

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.held += text
        out: list[tuple[str, str]] = []
        while self.held:
            if self.state == "start":
                body = self.held.lstrip()
                if body.startswith(OPEN):
                    self.held, self.state, self.had_block = body[len(OPEN):], "think", True
                elif OPEN.startswith(body):  # whitespace, or the tag's beginning: wait
                    return out
                else:
                    self.state = "content"
            elif self.state == "think":
                end = self.held.find(CLOSE)
                if end >= 0:
                    self._reasoning(out, self.held[:end], last=True)
                    self.held, self.state = self.held[end + len(CLOSE):], "after"
                    continue
                cut = len(self.held) - _tag_prefix(self.held, CLOSE)
                sure = self.held[:cut].rstrip("\n")
                if sure:
                    self._reasoning(out, sure)
                    self.held = self.held[len(sure):]
                return out
            elif self.state == "after":
                rest = self.held.lstrip("\n")
                self.held = rest
                if rest:
                    self.state = "content"
            else:
                out.append(("content", self.held))
                self.held = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What is still held: an unclosed block's text is reasoning, anything else content."""
        held, self.held = self.held, ""
        out: list[tuple[str, str]] = []
        if self.state == "think":
            self._reasoning(out, held, last=True)
        elif self.state != "after" and held:
            out.append(("content", held))
        return out

    def _reasoning(self, out: list[tuple[str, str]], text: str, last: bool = False) -> None:
        if not self._reasoned:
            text = text.lstrip("\n")
        if last:
            text = text.rstrip("\n")
        if text:
            out.append(("reasoning", text))
            self._reasoned = True


def _tag_prefix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a beginning of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0

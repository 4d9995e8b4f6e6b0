"""Tool calls in model output, as Qwen's chat templates ask for them:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

become OpenAI `tool_calls` entries. Only for requests that sent `tools`. A block that is not
valid JSON with a string "name", or that calls a function the request did not offer in
`tools`, is not a tool call: it stays in the content untouched.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str, names: Collection[str] | None = None,
                     ) -> tuple[str, list[dict[str, Any]]]:
    """(content without the parsed blocks, tool calls); (text, []) when there are none.
    `names`: the functions that may be called (None: any)."""
    calls: list[dict[str, Any]] = []

    def take(match: re.Match[str]) -> str:
        call = _call(match.group(1))
        if call is None or (names is not None and call["function"]["name"] not in names):
            return match.group(0)
        calls.append(call)
        return ""

    content = _BLOCK.sub(take, text)
    return (content.strip() if calls else text), calls


def _call(body: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": args}}


class ToolCallStream:
    """Streamed text -> content that can go out now; text from the first `<tool_call>` on is
    held back (as is a tail that may be the start of one) until `finish()` parses it."""

    def __init__(self, names: Collection[str] | None = None) -> None:
        self.names = names
        self.held = ""
        self.in_call = False

    def feed(self, text: str) -> str:
        self.held += text
        if self.in_call:
            return ""
        i = self.held.find(OPEN)
        if i >= 0:
            self.in_call = True
            out, self.held = self.held[:i], self.held[i:]
            return out
        keep = next((k for k in range(min(len(OPEN) - 1, len(self.held)), 0, -1)
                     if self.held.endswith(OPEN[:k])), 0)
        cut = len(self.held) - keep
        out, self.held = self.held[:cut], self.held[cut:]
        return out

    def finish(self, parse: bool = True) -> tuple[str, list[dict[str, Any]]]:
        """(content still to send, tool calls) at the end of the stream; `parse=False` (an
        answer cut short) sends the held text as it is."""
        held, self.held = self.held, ""
        return parse_tool_calls(held, self.names) if parse else (held, [])

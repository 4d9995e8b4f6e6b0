"""OpenAI's response shapes: completion / chat completion objects and their stream chunks."""

from __future__ import annotations

import dataclasses
from typing import Any

from daemon.request import Usage


@dataclasses.dataclass(frozen=True, slots=True)
class Formatter:
    """Builds the JSON objects of one request (`kind` "completion" or "chat")."""

    kind: str
    request_id: str
    model: str
    created: int

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created,
                "model": self.model}

    @staticmethod
    def usage(usage: Usage | None, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """OpenAI's usage object; the counts are a fallback when the engine sent none."""
        if usage is not None:
            prompt_tokens, completion_tokens = usage.prompt_tokens, usage.completion_tokens
        cached = usage.cached_tokens if usage is not None else 0
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def response(self, text: str, finish_reason: str, usage: dict[str, Any],
                 tool_calls: list[dict[str, Any]] | None = None,
                 reasoning: str | None = None) -> dict[str, Any]:
        """The whole (non-streamed) answer; chat's ``reasoning`` goes to reasoning_content."""
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:
                message = {"role": "assistant", "content": text or None,
                           "tool_calls": tool_calls}
            if reasoning:
                message["reasoning_content"] = reasoning
            choice = {"index": 0, "message": message, "logprobs": None,
                      "finish_reason": finish_reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage}

    def chunk(self, *, text: str = "", role: bool = False, finish_reason: str | None = None,
              tool_calls: list[dict[str, Any]] | None = None, reasoning: str = "",
              include_usage: bool = False) -> dict[str, Any]:
        """One stream chunk: the assistant role (chat's first chunk), a piece of text or of
        reasoning (chat), tool calls, or the finish reason. With
        stream_options.include_usage every chunk has "usage": null."""
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta = {"role": "assistant", "content": ""}
            elif reasoning:
                delta = {"reasoning_content": reasoning}
            elif text:
                delta = {"content": text}
            elif tool_calls:
                delta = {"tool_calls": [{"index": i, **call}
                                        for i, call in enumerate(tool_calls)]}
            choice = {"index": 0, "delta": delta, "logprobs": None,
                      "finish_reason": finish_reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage}

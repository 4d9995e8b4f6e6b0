"""Validation of OpenAI-style request bodies (`/v1/completions`, `/v1/chat/completions`).

`parse_completion(body)` / `parse_chat(body)` turn a decoded JSON object into a `ParsedRequest`
or raise `ApiError` (HTTP 400) naming the offending field. Fields OpenAI defines but Tandem does
not implement are refused with a message rather than silently ignored; `user` is kept as a
synthetic model's routing key (docs/synthetic.md) and otherwise unused.
A JSON null means "absent" for every optional field.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from protocol.messages import MAX_SEED, PENALTIES_OFF, penalty_error

MAX_STOP = 16
MAX_STOP_CHARS = 256
PRIORITY_RANGE = (-1000, 1000)
ROLES = ("system", "developer", "user", "assistant", "tool")
_COMMON = ("model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
           "stream", "stream_options", "n", "user", "priority", "presence_penalty",
           "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs", "ignore_eos",
           "speculation")
COMPLETION_FIELDS = frozenset(_COMMON + ("prompt", "best_of", "echo", "suffix"))
CHAT_FIELDS = frozenset(_COMMON + ("messages", "max_completion_tokens", "tools", "tool_choice",
                                   "parallel_tool_calls", "top_logprobs", "response_format",
                                   "chat_template_kwargs"))


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}.
    `reason` labels the rejection in metrics; None for a request that had been accepted and
    failed later (the scheduler counts those as finished)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 reason: str | None = "invalid_request",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type
        self.code, self.reason, self.headers = code, reason, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(param: str | None, message: str) -> ApiError:
    return ApiError(400, message, param=param)


@dataclasses.dataclass(slots=True)
class ParsedRequest:
    kind: str  # "completion" | "chat"
    model: str | None
    prompt: str | list[int] | None = None  # completion
    messages: list[dict[str, Any]] | None = None  # chat, normalized (string contents)
    tools: list[dict[str, Any]] | None = None
    enable_thinking: bool | None = None
    max_tokens: int | None = None  # None: as much as the context and limits allow
    temperature: float | None = None  # None: the model's generation_config default
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None  # None: a random seed
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    include_progress: bool = False  # stream_options.include_progress: prompt-progress events
    priority: int = 0
    ignore_eos: bool = False  # vLLM's extension: generate past EOS (benchmarks)
    speculation: bool = True  # Tandem's: false opts this request out of speculative decoding
    user: str | None = None  # OpenAI's: a synthetic model's routing key, else unused


# ---- scalar checks ------------------------------------------------------------------------------
def _int(body: dict, key: str, lo: int | None = None, hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad(key, f"'{key}' must be an integer, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise bad(key, f"'{key}' must be in [{lo}, {hi}], got {value}" if hi is not None
                  else f"'{key}' must be >= {lo}, got {value}")
    return value


def _num(body: dict, key: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise bad(key, f"'{key}' must be a number, got {value!r}")
    if value > hi or value < lo or (lo_open and value == lo):
        raise bad(key, f"'{key}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}")
    return float(value)


def _bool(body: dict, key: str) -> bool | None:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise bad(key, f"'{key}' must be true or false, got {value!r}")
    return value


def _unsupported(body: dict, key: str, allowed: tuple[Any, ...], what: str) -> None:
    value = body.get(key)
    if value is not None and value not in allowed:
        raise bad(key, f"'{key}' is not supported: {what}")


# ---- common fields ------------------------------------------------------------------------------
def _common(body: Any, kind: str, known: frozenset[str]) -> ParsedRequest:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    for key in body:
        if key not in known:
            endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
            raise bad(key, f"unknown field '{key}' for {endpoint}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"'model' must be a string, got {model!r}")
    n = _int(body, "n", 1)
    if n is not None and n != 1:
        raise bad("n", f"'n' must be 1: multiple choices per request are not supported, got {n}")
    for key in ("presence_penalty", "frequency_penalty"):
        _num(body, key, -2.0, 2.0)
    for key, off in PENALTIES_OFF.items():  # the ZeroMQ API refuses them alike
        if body.get(key) is not None and body[key] != off:
            raise bad(key, penalty_error(key))
    _unsupported(body, "logit_bias", ({},), "logit_bias is not implemented")
    _unsupported(body, "logprobs", (False, 0), "log probabilities are not returned")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", f"'user' must be a string, got {user!r}")
    top_k = _int(body, "top_k", -1)
    stream = bool(_bool(body, "stream"))
    return ParsedRequest(
        kind=kind, model=model, max_tokens=_int(body, "max_tokens", 1),
        temperature=_num(body, "temperature", 0.0, 100.0), top_p=_num(body, "top_p", 0.0, 1.0,
                                                                         lo_open=True),
        top_k=0 if top_k == -1 else top_k, min_p=_num(body, "min_p", 0.0, 1.0),
        seed=_int(body, "seed", 0, MAX_SEED), stop=_stop(body.get("stop")), stream=stream,
        include_usage=_stream_options(body.get("stream_options"), stream),
        include_progress=_stream_options(body.get("stream_options"), stream, "include_progress"),
        priority=_int(body, "priority", *PRIORITY_RANGE) or 0,
        ignore_eos=bool(_bool(body, "ignore_eos")),
        speculation=_bool(body, "speculation") is not False, user=user)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", f"'stop' must be a string or a list of strings, got {value!r}")
    if len(stops) > MAX_STOP:
        raise bad("stop", f"'stop' may hold at most {MAX_STOP} strings, got {len(stops)}")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise bad("stop", f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
    return tuple(stops)


def _stream_options(value: Any, stream: bool, option: str = "include_usage") -> bool:
    if value is None:
        return False
    if not stream:
        raise bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
    if not isinstance(value, dict):
        raise bad("stream_options", f"'stream_options' must be an object, got {value!r}")
    for key in value:
        if key not in ("include_usage", "include_progress"):
            raise bad("stream_options", f"unknown field 'stream_options.{key}'")
    return bool(_bool(value, option))


# ---- /v1/completions ----------------------------------------------------------------------------
def parse_completion(body: Any) -> ParsedRequest:
    req = _common(body, "completion", COMPLETION_FIELDS)
    _unsupported(body, "best_of", (1,), "'best_of' must be 1")
    _unsupported(body, "echo", (False,), "echoing the prompt is not implemented")
    _unsupported(body, "suffix", ("",), "insertion (suffix) is not implemented")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt", "'prompt' must not be empty")
    elif isinstance(prompt, list):
        if prompt and all(isinstance(p, str | list) for p in prompt):
            raise bad("prompt", "batch prompts are not supported: send one prompt per request")
        if not prompt:
            raise bad("prompt", "'prompt' must not be empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise bad("prompt", "'prompt' must be a string or a list of token ids (integers "
                      ">= 0)")
    else:
        raise bad("prompt", "'prompt' is required: a string or a list of token ids"
                  if prompt is None else f"'prompt' must be a string or a list of token ids, "
                  f"got {type(prompt).__name__}")
    req.prompt = prompt
    return req


# ---- /v1/chat/completions -----------------------------------------------------------------------
def parse_chat(body: Any) -> ParsedRequest:
    req = _common(body, "chat", CHAT_FIELDS)
    mct = _int(body, "max_completion_tokens", 1)
    if mct is not None and req.max_tokens is not None and mct != req.max_tokens:
        raise bad("max_completion_tokens", "'max_tokens' and 'max_completion_tokens' differ")
    req.max_tokens = req.max_tokens or mct
    _unsupported(body, "top_logprobs", (0,), "log probabilities are not returned")
    _unsupported(body, "parallel_tool_calls", (True,), "tool calls cannot be limited to one")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise bad("response_format", "'response_format' is not supported: only "
                  "{\"type\": \"text\"} (constrained JSON output is not implemented)")
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("auto", "none"):
        raise bad("tool_choice", "'tool_choice' must be \"auto\" or \"none\" (forcing a tool "
                  "call is not supported)")
    req.messages = _messages(body.get("messages"))
    tools = _tools(body.get("tools"))
    req.tools = tools if tools and choice != "none" else None
    req.enable_thinking = _template_kwargs(body.get("chat_template_kwargs"))
    return req


def _messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise bad("messages", "'messages' is required")
    if not isinstance(value, list) or not value:
        raise bad("messages", "'messages' must be a non-empty list of message objects")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(value)]


_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content",
                 "refusal"}


def _message(m: Any, where: str) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise bad(where, f"{where} must be an object with 'role' and 'content'")
    for key in m:
        if key not in _MESSAGE_KEYS:
            raise bad(f"{where}.{key}", f"unknown field '{key}' in {where}")
    role = m.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}, got "
                  f"{role!r}")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role,
                           "content": _content(m.get("content"), f"{where}.content",
                                               optional=role == "assistant")}
    for key in ("name", "tool_call_id", "reasoning_content"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise bad(f"{where}.{key}", f"{where}.{key} must be a string")
            out[key] = m[key]
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str)
                and isinstance(c["function"].get("arguments"), str | dict) for c in calls):
            raise bad(f"{where}.tool_calls", f"{where}.tool_calls must be a list of "
                      f"{{\"function\": {{\"name\": string, \"arguments\": JSON string or "
                      f"object}}}} on an assistant message")
        out["tool_calls"] = calls
    return out


def _content(value: Any, where: str, optional: bool) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        if optional:
            return ""
        raise bad(where, f"{where} is required")
    if not isinstance(value, list):
        raise bad(where, f"{where} must be a string or a list of content parts")
    texts = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise bad(f"{where}[{i}]", f"{where}[{i}]: content part type {kind!r} is not "
                      f"supported (this model takes text only)")
        if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
            raise bad(f"{where}[{i}]", f"{where}[{i}] must be {{\"type\": \"text\", "
                      f"\"text\": string}}")
        texts.append(part["text"])
    return "\n".join(texts)


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad("tools", "'tools' must be a list of tool objects")
    for i, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(tool, dict) or tool.get("type") != "function"
                or not isinstance(fn, dict) or not isinstance(fn.get("name"), str)
                or not isinstance(fn.get("parameters", {}), dict)):
            raise bad(f"tools[{i}]", f"tools[{i}] must be {{\"type\": \"function\", "
                      f"\"function\": {{\"name\": string, \"parameters\": object, ...}}}}")
    return value


def _template_kwargs(value: Any) -> bool | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"enable_thinking"}:
        raise bad("chat_template_kwargs", "'chat_template_kwargs' supports only "
                  "{\"enable_thinking\": bool}")
    return _bool(value, "enable_thinking")

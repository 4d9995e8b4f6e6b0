"""The HTTP API's answers that come before the scheduler: bodies, types, prompt shapes, model
names and limits (the shared server: api_test_client.py)."""

from __future__ import annotations

import pytest

from daemon.tokenizer import Tokenizer
from tests.unit import api_test_client
from tests.unit.api_test_client import (
    CHAT,
    COMPLETIONS,
    _chat,
    _client,
    _error,
)

# the shared fixtures (bound here, pytest finds them by module attribute)
client, tokenizer = api_test_client.client, api_test_client.tokenizer


# ---- bodies and types ---------------------------------------------------------------------------
async def test_malformed_json_is_400(client):
    resp = await client.post(CHAT, data=b'{"messages": [', headers={"Content-Type":
                                                                      "application/json"})
    err = await _error(resp, 400)
    assert "not valid JSON" in err["message"]
    assert err["type"] == "invalid_request_error"


async def test_deeply_nested_json_is_400(client):
    err = await _error(await client.post(CHAT, data=b"[" * 2000 + b"]" * 2000,
                                         headers={"Content-Type": "application/json"}), 400)
    assert "nested too deeply" in err["message"]


async def test_body_must_be_an_object(client):
    err = await _error(await client.post(CHAT, json=[1, 2]), 400)
    assert "JSON object" in err["message"]


async def test_oversized_body_is_413(client):
    big = _chat(messages=[{"role": "user", "content": "x" * 5000}])
    err = await _error(await client.post(CHAT, json=big), 413)
    assert "4096 bytes" in err["message"]
    assert err["code"] == "body_too_large"


@pytest.mark.parametrize("fields, param, words", [
    ({"temperature": "hot"}, "temperature", "must be a number"),
    ({"temperature": -0.5}, "temperature", "must be in"),
    ({"top_p": 0}, "top_p", "(0.0, 1.0]"),
    ({"top_p": 1.5}, "top_p", "must be in"),
    ({"top_k": -2}, "top_k", ">= -1"),
    ({"top_k": 2.5}, "top_k", "integer"),
    ({"min_p": 2}, "min_p", "must be in"),
    ({"seed": -1}, "seed", "must be in"),
    ({"seed": True}, "seed", "integer"),
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"max_tokens": "10"}, "max_tokens", "integer"),
    ({"max_tokens": 8, "max_completion_tokens": 9}, "max_completion_tokens", "differ"),
    ({"stop": 5}, "stop", "string or a list"),
    ({"stop": [""]}, "stop", "1 to 256"),
    ({"stop": ["a"] * 17}, "stop", "at most 16"),
    ({"stream": "yes"}, "stream", "true or false"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when"),
    ({"stream": True, "stream_options": {"foo": 1}}, "stream_options", "stream_options.foo"),
    ({"priority": 5000}, "priority", "must be in"),
    ({"model": 3}, "model", "must be a string"),
    ({"user": 3}, "user", "must be a string"),
    ({"ignore_eos": 1}, "ignore_eos", "true or false"),
])
async def test_wrong_types_and_ranges_are_400(client, fields, param, words):
    err = await _error(await client.post(CHAT, json=_chat(**fields)), 400)
    assert err["param"] == param
    assert words in err["message"]


@pytest.mark.parametrize("fields, param, words", [
    ({"n": 2}, "n", "must be 1"),
    ({"logprobs": True}, "logprobs", "not supported"),
    ({"top_logprobs": 3}, "top_logprobs", "not supported"),
    ({"logit_bias": {"5": 1}}, "logit_bias", "not supported"),
    ({"response_format": {"type": "json_object"}}, "response_format", "not supported"),
    ({"tool_choice": "required"}, "tool_choice", "\"auto\" or \"none\""),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "auto"),
    ({"presence_penalty": 0.5}, "presence_penalty", "not implemented"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls", "not supported"),
    ({"functions": []}, "functions", "unknown field 'functions'"),
    ({"reasoning_effort": "high"}, "reasoning_effort", "unknown field"),
    ({"chat_template_kwargs": {"foo": 1}}, "chat_template_kwargs", "enable_thinking"),
])
async def test_unsupported_features_are_400_with_a_message(client, fields, param, words):
    err = await _error(await client.post(CHAT, json=_chat(**fields)), 400)
    assert err["param"] == param
    assert words in err["message"]


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "hi", "best_of": 3}, "best_of", "must be 1"),
    ({"prompt": "hi", "echo": True}, "echo", "not implemented"),
    ({"prompt": "hi", "suffix": "x"}, "suffix", "not implemented"),
    ({"prompt": ["a", "b"]}, "prompt", "batch prompts are not supported"),
    ({"prompt": [[1, 2], [3]]}, "prompt", "batch prompts are not supported"),
    ({"prompt": [1, -2]}, "prompt", "token ids"),
    ({"prompt": [1, "2"]}, "prompt", "token ids"),
    ({"prompt": []}, "prompt", "must not be empty"),
    ({"prompt": ""}, "prompt", "must not be empty"),
    ({}, "prompt", "is required"),
    ({"prompt": {"text": "x"}}, "prompt", "got dict"),
    ({"prompt": [10 ** 6]}, "prompt", "out of range"),
    ({"prompt": "hi", "messages": []}, "messages", "unknown field"),
])
async def test_completion_prompt_shapes(client, body, param, words):
    err = await _error(await client.post(COMPLETIONS, json=body), 400)
    assert err["param"] == param
    assert words in err["message"]


@pytest.mark.parametrize("messages, param, words", [
    (None, "messages", "required"),
    ([], "messages", "non-empty list"),
    ("hi", "messages", "non-empty list"),
    ([{"role": "robot", "content": "x"}], "messages[0].role", "must be one of"),
    ([{"content": "x"}], "messages[0].role", "must be one of"),
    ([{"role": "user"}], "messages[0].content", "is required"),
    ([{"role": "user", "content": 5}], "messages[0].content", "string or a list"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content[0]", "'image_url' is not supported"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0]", "text"),
    ([{"role": "user", "content": "x", "audio": 1}], "messages[0].audio", "unknown field"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls",
     "assistant message"),
    (["hello"], "messages[0]", "must be an object"),
])
async def test_chat_message_shapes(client, messages, param, words):
    body = {"messages": messages} if messages is not None else {"model": "tandem-tiny"}
    err = await _error(await client.post(CHAT, json=body), 400)
    assert err["param"] == param
    assert words in err["message"]


async def test_bad_tools_are_400(client):
    err = await _error(await client.post(CHAT, json=_chat(tools=[{"type": "retrieval"}])), 400)
    assert err["param"] == "tools[0]"


async def test_chat_template_errors_are_400(tokenizer):
    strict = Tokenizer(tokenizer.backend, eos_token_ids=tokenizer.eos_token_ids,
                       chat_template="{% if messages[0].role != 'user' %}"
                                     "{{ raise_exception('conversations start with a user') }}"
                                     "{% endif %}{{ messages[0].content }}")
    c = await _client(strict)
    try:
        body = _chat(messages=[{"role": "assistant", "content": "a"}])
        err = await _error(await c.post(CHAT, json=body), 400)
        assert "conversations start with a user" in err["message"]
        assert (await c.post(CHAT, json=_chat())).status == 503  # renders: reaches the engine
    finally:
        await c.close()


async def test_no_tokenizer_needs_token_ids():
    c = await _client(None)
    try:
        err = await _error(await c.post(COMPLETIONS, json={"prompt": "hi"}), 400)
        assert "list of token ids" in err["message"]
        assert (await c.post(COMPLETIONS, json={"prompt": [5, 6]})).status == 503
    finally:
        await c.close()


# ---- model names, limits -----------------------------------------------------------------------
async def test_unknown_model_is_404(client):
    err = await _error(await client.post(CHAT, json=_chat(model="gpt-4o")), 404)
    assert err["code"] == "model_not_found"
    assert "gpt-4o" in err["message"] and "tandem-tiny" in err["message"]


async def test_alias_is_accepted(tokenizer):
    c = await _client(tokenizer, **{"model.aliases": ["tiny"]})
    try:
        resp = await c.post(CHAT, json=_chat(model="tiny"))
        assert resp.status == 503  # validated, then the absent engine
        models = await (await c.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["tandem-tiny", "tiny"]
        card = await (await c.get("/v1/models/tiny")).json()
        assert card["id"] == "tiny" and card["root"] == "tandem-tiny"
        err = await _error(await c.get("/v1/models/Qwen/Qwen3-8B"), 404)
        assert err["code"] == "model_not_found" and "Qwen/Qwen3-8B" in err["message"]
    finally:
        await c.close()


async def test_prompt_over_max_prompt_tokens_is_400_with_counts(client, tokenizer):
    text = "The quick brown fox jumps over the lazy dog. " * 16
    n = len(tokenizer.encode(text))
    assert n > 240
    err = await _error(await client.post(COMPLETIONS, json={"prompt": text}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert f"{n} tokens" in err["message"] and "240" in err["message"]
    chat = _chat(messages=[{"role": "user", "content": text}])
    err = await _error(await client.post(CHAT, json=chat), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"


async def test_prompt_plus_max_tokens_over_context_is_400_with_counts(client):
    ids = list(range(230))
    err = await _error(await client.post(COMPLETIONS, json={"prompt": ids, "max_tokens": 30}),
                       400)
    assert err["param"] == "max_tokens"
    assert "230 tokens" in err["message"] and "(30)" in err["message"]
    assert "260" in err["message"] and "256" in err["message"]


async def test_max_tokens_over_limit_is_400(client):
    err = await _error(await client.post(COMPLETIONS, json={"prompt": [1], "max_tokens": 33}),
                       400)
    assert "<= 32" in err["message"]


@pytest.mark.parametrize("path, body", [
    (COMPLETIONS, {"prompt": "Hello there", "max_tokens": 8, "temperature": 0, "seed": 3,
                   "stop": ["\n"], "user": "u1", "n": 1, "priority": 2,
                   "presence_penalty": 0, "logprobs": None, "echo": False,
                   "ignore_eos": True}),
    (COMPLETIONS, {"prompt": [1, 2, 3], "stream": True,
                   "stream_options": {"include_usage": True}}),
    (CHAT, _chat(max_completion_tokens=8, top_k=-1, min_p=0.1, stop="x", logprobs=False,
                 response_format={"type": "text"}, tool_choice="auto",
                 chat_template_kwargs={"enable_thinking": False},
                 tools=[{"type": "function", "function": {"name": "get_time",
                                                          "parameters": {"type": "object"}}}],
                 messages=[{"role": "developer", "content": "Be brief."},
                           {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                        {"type": "text", "text": "there"}]},
                           {"role": "assistant", "content": None,
                            "tool_calls": [{"id": "c1", "type": "function", "function": {
                                "name": "get_time", "arguments": "{}"}}]},
                           {"role": "tool", "tool_call_id": "c1", "content": "12:00"}])),
])
async def test_valid_requests_pass_validation_and_meet_the_absent_engine(client, path, body):
    resp = await client.post(path, json=body)
    err = await _error(resp, 503)
    assert err["code"] == "engine_unavailable"
    assert resp.headers["Retry-After"] == "5"
    prefix = "chatcmpl-" if path == CHAT else "cmpl-"
    assert resp.headers["X-Request-Id"].startswith(prefix)

"""Shared pieces of the HTTP API tests (test_api_validation.py, test_api_endpoints.py): a real
aiohttp server on a real socket with the real tokenizer and no scheduler (None), so a request
that passes every check is answered 503."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from daemon.api_http import make_app
from daemon.config import DEFAULT_MODEL, load_config
from daemon.metrics import Metrics
from daemon.tokenizer import Tokenizer

KEY = "sk-test-0123456789"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(DEFAULT_MODEL)


async def _client(tokenizer, **overrides) -> TestClient:
    config = load_config(None, {"model.path": DEFAULT_MODEL, "scheduler.max_context": 256,
                                "limits.max_prompt_tokens": 240, "limits.max_tokens": 32,
                                "server.max_body_bytes": 4096, **overrides})
    metrics = Metrics()
    app = make_app(None, tokenizer, config, metrics,
                   generation_defaults={"temperature": 0.7, "top_p": 0.8})
    client = TestClient(TestServer(app))
    await client.start_server()
    client.metrics = metrics  # type: ignore[attr-defined]
    return client


@pytest.fixture
async def client(tokenizer):
    c = await _client(tokenizer)
    yield c
    await c.close()


@pytest.fixture
async def keyed(tokenizer):
    c = await _client(tokenizer, **{"server.api_keys": [KEY, "another-key-42"]})
    yield c
    await c.close()


async def _error(resp, status: int) -> dict:
    assert resp.status == status, await resp.text()
    body = await resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert resp.headers["X-Request-Id"]
    return body["error"]


def _chat(**fields) -> dict:
    return {"model": "tandem-tiny", "messages": [{"role": "user", "content": "Hello"}], **fields}

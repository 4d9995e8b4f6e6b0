"""Admission limits, stop strings, explicit cancel and API keys through a real server."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from protocol.client import TandemClient
from protocol.errors import BadRequestError
from protocol.messages import penalty_error
from scripts.tiny_model import make_tiny_model
from tests.integration.server import Server, generate_alone

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model"), "qwen3_moe", seed=4)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("srv"), model, scheduler={"max_slots": 1},
                 limits={"max_queue": 1}, server={"api_keys": [KEY]}).start()
    yield srv
    assert srv.stop() == 0


def _body(prompt: str, max_tokens: int, **extra) -> dict:
    return {"model": "tandem-test", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, **extra}


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_api_keys(server):
    async def go():
        async with aiohttp.ClientSession() as s:
            url = server.url + "/v1/completions"
            out = []
            for headers in ({}, {"Authorization": "Bearer wrong"}, AUTH):
                async with s.post(url, json=_body("hi", 2), headers=headers) as r:
                    out.append((r.status, await r.json()))
            async with s.get(server.url + "/health") as r:
                out.append((r.status, None))
            return out

    (s1, e1), (s2, e2), (s3, ok), (s4, _) = asyncio.run(go())
    assert (s1, s2, s3, s4) == (401, 401, 200, 200)
    assert "key" in e1["error"]["message"].lower() and "key" in e2["error"]["message"].lower()
    assert ok["choices"][0]["finish_reason"] in ("length", "stop")


def test_full_queue_answers_503_with_retry_after(server):
    async def go():
        async with aiohttp.ClientSession(headers=AUTH) as s:
            url = server.url + "/v1/completions"
            running = asyncio.create_task(s.post(url, json=_body("one", 300)))
            while server.get("/v1/slots")[1]["slots"][0]["request_id"] is None:
                await asyncio.sleep(0.01)
            queued = asyncio.create_task(s.post(url, json=_body("two", 2)))
            while server.get("/v1/slots")[1]["queue_depth"] < 1:
                await asyncio.sleep(0.01)
            async with s.post(url, json=_body("three", 2)) as r:
                rejected = (r.status, r.headers.get("Retry-After"), await r.json())
            first, second = await running, await queued
            return rejected, first.status, second.status

    (status, retry, err), first, second = asyncio.run(go())
    assert status == 503 and retry and float(retry) > 0
    assert "queue" in err["error"]["message"]
    assert first == 200 and second == 200  # the rejection changed nothing else


def test_stop_string_ends_the_text_before_the_match(server, model):
    full = generate_alone(model, "abc", 30, chat=False)["text"]
    stop = full[10:13]
    assert len(stop) == 3

    async def go():
        async with aiohttp.ClientSession(headers=AUTH) as s:
            async with s.post(server.url + "/v1/completions",
                              json=_body("abc", 30, stop=[stop])) as r:
                return await r.json()

    data = asyncio.run(go())
    choice = data["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == full[:full.find(stop)]


def test_zmq_cancel_frees_the_slot(server):
    with TandemClient(server.zmq_address, timeout=30) as client:
        rid = client.submit("long one", max_tokens=300, temperature=0)
        events = client.stream(rid)
        first = next(events)
        assert first.finish_reason is None
        client.cancel(rid)
        rest = list(events)
        assert rest and rest[-1].finish_reason == "cancelled"
    deadline = time.monotonic() + 5
    while server.get("/v1/slots")[1]["slots"][0]["request_id"] is not None:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def _http_error(server, body: dict) -> tuple[int, str]:
    async def go():
        async with aiohttp.ClientSession(headers=AUTH) as s:
            async with s.post(server.url + "/v1/completions", json=body) as r:
                return r.status, (await r.json())["error"]["message"]

    return asyncio.run(go())


@pytest.mark.parametrize("ask", [
    {"presence_penalty": 0.5},  # penalties: refused alike on both APIs
    {"prompt_ids": [10 ** 6]},  # past the vocabulary the worker reported: never reaches it
])
def test_zmq_refuses_like_http_and_keeps_serving(server, ask):
    http_body = _body("hi", 2, **ask)
    if "prompt_ids" in ask:
        http_body["prompt"] = http_body.pop("prompt_ids")
    status, http_message = _http_error(server, http_body)
    assert status == 400
    with TandemClient(server.zmq_address, timeout=30) as client:
        prompt = None if "prompt_ids" in ask else "hi"
        with pytest.raises(BadRequestError) as err:
            client.generate(prompt, max_tokens=2, temperature=0, **ask)
        assert err.value.message == http_message
        if "presence_penalty" in ask:
            assert http_message == penalty_error("presence_penalty")
        else:
            assert "out of range" in http_message
        assert client.generate("hi", max_tokens=2, temperature=0).finish_reason in (
            "length", "stop")


def test_health_shows_the_worker_heartbeat(server):
    deadline = time.monotonic() + 10
    while True:
        status, body = server.get("/health")
        worker = body["worker"]
        if worker["heartbeats"] >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status == 200 and worker["ready"] and worker["pid"] == server.child_pid(
        "gpu_worker.server")
    assert worker["heartbeats"] >= 2  # one a second while idle (WorkerConfig.heartbeat_s)
    assert 0 <= worker["last_heard_s"] < 3

"""The whole service through real processes, sockets and HTTP, on a tiny float64 model."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from scripts.tiny_model import make_tiny_model
from tests.integration.server import Server, alive, generate_alone

MODEL_NAME = "tandem-test"  # served name set in Server's config
PROMPTS = ["Write a function", "Explain the code below", "def reverse(s):", "import os\nimport"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model"), "qwen3_next", seed=7, layers=4,
                           moe_intermediate=64)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("srv"), model).start()
    yield srv
    assert srv.stop() == 0


async def chat(session, url, prompt, max_tokens=24, stream=True, **extra):
    """Returns (text, finish_reason, usage) of one chat completion."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "stream_options": {"include_usage": True}, **extra}
    if not stream:
        body.pop("stream_options")
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        if not stream:
            data = await r.json()
            return data["choices"][0]["message"]["content"], \
                data["choices"][0]["finish_reason"], data["usage"]
        text, finish, usage = [], None, None
        async for line in r.content:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                text.append(choice["delta"].get("content") or "")
                finish = choice["finish_reason"] or finish
        return "".join(text), finish, usage


def run(coro):
    return asyncio.run(coro)


PLACEMENTS = {
    "gpu": {"placement": "gpu"},
    "cpu-2-workers": {"placement": "cpu", "cpu_workers": 2},
    # the portable kernels here, the best this CPU has in generate_alone: the same bits
    "split": {"placement": "split", "cpu_experts_per_layer": 3, "cpu_workers": 1,
              "cpu_isa": "portable"},
    # the GPU keeps the experts the router picked most over the test's own prompts
    "split-hot": {"placement": "split", "cpu_experts_per_layer": 3, "cpu_workers": 1},
}


def _hot_experts(model: Path, tmp_path: Path) -> Path:
    """`tandem expert-stats` over the prompts of this module."""
    text, out = tmp_path / "prompts.txt", tmp_path / "hot.json"
    text.write_text("\n".join(PROMPTS))
    subprocess.run([sys.executable, "-m", "daemon.cli", "expert-stats", "--model", str(model),
                    "--text", str(text), "--out", str(out)], check=True, timeout=120,
                   capture_output=True)
    return out


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_four_concurrent_streams_equal_generate_alone(placement, model, tmp_path):
    experts = dict(PLACEMENTS[placement])
    if placement == "split-hot":
        experts["hot_experts"] = str(_hot_experts(model, tmp_path))
    srv = Server(tmp_path, model, experts=experts).start()
    try:
        async def go():
            async with aiohttp.ClientSession() as s:
                return await asyncio.gather(*(chat(s, srv.url, p) for p in PROMPTS))

        results = run(go())
        metrics = srv.get("/metrics")[1]
    finally:
        assert srv.stop() == 0
    logged = [json.loads(line) for line in srv.log.read_text().splitlines()]
    worker = [e for e in logged if e.get("event") == "gpu worker ready"]  # READY, as read
    assert worker and worker[0]["padded_passes"] is False  # NumPy: no CUDA graphs, no padding
    if "hot_experts" in experts:
        hot = [e for e in logged if e.get("event") == "hot experts on the gpu"]
        assert hot and hot[0]["router_picks_on_gpu_mean"] > 0.5  # 5 of 8 experts kept
    if "cpu_isa" in experts:
        ready = [e for e in logged if e.get("event") == "cpu expert worker ready"]
        assert ready and all(r["isa"] == experts["cpu_isa"] for r in ready)
    cpu_bytes = re.search(r"^tandem_cpu_expert_weight_bytes_total (\S+)$", metrics, re.M)
    if placement == "gpu":
        assert cpu_bytes is None or float(cpu_bytes.group(1)) == 0
    else:  # the hybrid figures are reported
        assert float(cpu_bytes.group(1)) > 0
        assert re.search(r'^tandem_distinct_experts_per_step\{device="cpu"\} [1-9]', metrics,
                         re.M)
    for prompt, (text, finish, usage) in zip(PROMPTS, results, strict=True):
        alone = generate_alone(model, prompt, 24,
                               experts={k: v for k, v in experts.items() if k != "cpu_isa"})
        assert text == alone["text"], prompt
        assert usage["completion_tokens"] == len(alone["token_ids"])
        assert finish in ("length", "stop")


def test_cancel_one_of_four_leaves_the_others_unchanged(server, model):
    async def go():
        async with aiohttp.ClientSession() as s:
            tasks = [asyncio.create_task(chat(s, server.url, p, max_tokens=60)) for p in PROMPTS]
            deadline = time.monotonic() + 30
            while not all(slot["generated"] >= 2 for slot in server.get("/v1/slots")[1]["slots"]):
                assert time.monotonic() < deadline, "the four streams never all generated"
                await asyncio.sleep(0.01)  # all four are generating
            tasks[1].cancel()  # closes the connection mid-stream: the server cancels
            done = await asyncio.gather(*tasks, return_exceptions=True)
            return done

    done = run(go())
    assert isinstance(done[1], asyncio.CancelledError)
    for i in (0, 2, 3):
        assert done[i][0] == generate_alone(model, PROMPTS[i], 60)["text"]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        slots = server.get("/v1/slots")[1]["slots"]
        if all(s["request_id"] is None for s in slots):
            break
        time.sleep(0.05)
    assert all(s["request_id"] is None for s in slots), slots


def test_prefix_reuse_prefills_only_the_rest(server, model):
    shared = "You are a careful assistant. " * 12

    async def go():
        async with aiohttp.ClientSession() as s:
            first = await chat(s, server.url, shared + "Say one thing.", 12, stream=False)
            second = await chat(s, server.url, shared + "Say another thing.", 12, stream=False)
            return first, second

    first, second = run(go())
    assert second[2]["prompt_tokens_details"]["cached_tokens"] >= 32
    assert second[2]["prompt_tokens_details"]["cached_tokens"] < second[2]["prompt_tokens"]
    assert second[0] == generate_alone(model, shared + "Say another thing.", 12)["text"]
    assert first[0] == generate_alone(model, shared + "Say one thing.", 12)["text"]


def test_a_conversations_next_turn_reuses_its_history(server, model):
    """A chat's second turn finds the checkpoint where the first turn's history ended
    (Tokenizer.chat_history_len), past the first prompt's unrepeated empty thinking block."""
    from daemon.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model)
    for n in range(4, 40):  # a history ending mid-interval (32): only its own checkpoint serves
        messages = [{"role": "system", "content": "You review code. " * n},
                    {"role": "user", "content": "Read utils.py and say what it does."}]
        ids = tok.encode_chat(messages, enable_thinking=False)
        history = tok.chat_history_len(ids, messages, enable_thinking=False)
        if history is not None and 8 <= history % 32 <= 20:
            break
    thinking = {"chat_template_kwargs": {"enable_thinking": False}}

    async def go():
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 8,
                    "temperature": 0, **thinking}
            async with s.post(server.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                answer = (await r.json())["choices"][0]["message"]["content"]
            follow = messages + [{"role": "assistant", "content": answer},
                                 {"role": "user", "content": "Now write its tests."}]
            async with s.post(server.url + "/v1/chat/completions",
                              json={**body, "messages": follow}) as r:
                assert r.status == 200, await r.text()
                return (await r.json())["usage"]

    assert history is not None and 8 <= history % 32 <= 20, history
    usage = run(go())
    assert usage["prompt_tokens_details"]["cached_tokens"] == history


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server):
    async def go():
        out = []
        async with aiohttp.ClientSession() as s:
            url = server.url + "/v1/chat/completions"
            cases = [b"{not json", json.dumps({"messages": "hi"}).encode(),
                     json.dumps({"model": "nope", "messages": [
                         {"role": "user", "content": "x"}]}).encode(),
                     json.dumps({"messages": [{"role": "user", "content": "x"}],
                                 "temperature": -1}).encode(),
                     json.dumps({"messages": [{"role": "user", "content": "x" * 6000}]}).encode(),
                     b"x" * (2 << 20)]
            for body in cases:
                async with s.post(url, data=body,
                                  headers={"Content-Type": "application/json"}) as r:
                    out.append((r.status, (await r.json())["error"]["message"]))
            out.append(await chat(s, server.url, "still there?", 4))
        return out

    *errors, ok = run(go())
    statuses = [status for status, _ in errors]
    assert statuses == [400, 400, 404, 400, 400, 413], errors
    assert all(message for _, message in errors)
    assert ok[1] in ("length", "stop")


def test_zmq_client_and_malformed_frames(server):
    import zmq

    from protocol.client import TandemClient

    with TandemClient(server.zmq_address, timeout=30) as client:
        done = client.generate("hello there", max_tokens=6, temperature=0)
        assert done.finish_reason in ("length", "stop") and done.token_ids
        status = client.status()
        assert status.max_slots == 4
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(server.zmq_address)
    from protocol.codec import decode
    from protocol.messages import ErrorCode, ErrorReply

    # a SUBMIT with a broken body, then one over the 1 MiB body limit
    for body, needle in ((b"\xc1garbage", "MALFORMED"), (b"\x80" + b"x" * (3 << 19), "TOO_LARGE")):
        raw.send_multipart([b"\x30", body])
        assert raw.poll(5000)
        reply = decode(raw.recv_multipart())
        assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.PROTOCOL
        assert needle in reply.message
    raw.close(0)
    with TandemClient(server.zmq_address, timeout=30) as client:
        assert client.generate("again", max_tokens=3, temperature=0).token_ids


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_request_resumes_with_identical_tokens(mode, model, tmp_path):
    srv = Server(tmp_path, model, scheduler={"max_slots": 1, "preemption": mode}).start()
    try:
        async def go():
            async with aiohttp.ClientSession() as s:
                low = asyncio.create_task(chat(s, srv.url, PROMPTS[0], 200, priority=0))
                while srv.get("/v1/slots")[1]["slots"][0]["generated"] < 3:
                    await asyncio.sleep(0.02)
                high = asyncio.create_task(chat(s, srv.url, PROMPTS[2], 8, priority=5))
                high_result = await high
                low_done_first = low.done()
                return await low, high_result, low_done_first

        low, high, low_done_first = run(go())
        assert not low_done_first  # the high-priority request overtook it
        assert low[0] == generate_alone(model, PROMPTS[0], 200)["text"]
        assert high[0] == generate_alone(model, PROMPTS[2], 8)["text"]
        assert "preempted" in srv.log.read_text()
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("victim", ["cpu_experts.worker", "gpu_worker.server"])
def test_killed_worker_errors_in_flight_and_restarts(victim, model, tmp_path):
    srv = Server(tmp_path, model, experts={"placement": "cpu", "cpu_workers": 1}).start()
    try:
        async def go():
            async with aiohttp.ClientSession() as s:
                body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 400,
                        "temperature": 0, "stream": True}
                got_error = False
                async with s.post(srv.url + "/v1/chat/completions", json=body) as r:
                    first = await r.content.readline()
                    assert first.startswith(b"data: ")
                    os.kill(srv.child_pid(victim), signal.SIGKILL)
                    async for line in r.content:
                        if b'"error"' in line:
                            got_error = True
                return got_error

        assert run(go())
        srv.wait_ready(60)
        text = run(_one(srv.url))
        assert text[1] in ("length", "stop")
        assert "restarting the gpu worker" in srv.log.read_text()
    finally:
        pid_tree = srv.proc.pid
        assert srv.stop() == 0
        assert not alive(pid_tree)


async def _one(url):
    async with aiohttp.ClientSession() as s:
        return await chat(s, url, "after restart", 4)


@pytest.mark.parametrize("proposer", ["suffix", "mtp"])
def test_speculation_over_http_equals_generate_alone(model, tmp_path, proposer):
    """Wide speculation behind the real daemon: four concurrent streams (greedy, and one
    sampled) print what plain `tandem generate` prints; drafts were verified and counted in
    /metrics."""
    srv = Server(tmp_path, model, speculation={"mode": "wide", "min_match": 1,
                                               "proposer": proposer}).start()
    try:
        async def go():
            async with aiohttp.ClientSession() as s:
                return await asyncio.gather(
                    *(chat(s, srv.url, p, max_tokens=40) for p in PROMPTS[:3]),
                    chat(s, srv.url, PROMPTS[3], max_tokens=40, temperature=0.8, seed=5))

        results = run(go())
        metrics = srv.get("/metrics")[1]
    finally:
        assert srv.stop() == 0
    drafts = re.search(r"^tandem_spec_draft_tokens_total (\S+)$", metrics, re.M)
    assert drafts and float(drafts.group(1)) > 0
    assert re.search(r"^tandem_spec_accepted_tokens_total \S+$", metrics, re.M)
    verifies = re.search(rf'^tandem_spec_verifies_total{{source="{proposer}"}} (\S+)$', metrics,
                         re.M)
    assert verifies and float(verifies.group(1)) > 0
    assert re.search(rf'^tandem_spec_accepted_by_source_tokens_total{{source="{proposer}"}} ',
                     metrics, re.M)
    for i, (prompt, (text, _, usage)) in enumerate(zip(PROMPTS, results, strict=True)):
        alone = generate_alone(model, prompt, 40, temperature=0.8 if i == 3 else 0.0,
                               seed=5 if i == 3 else 0)
        assert text == alone["text"], prompt
        assert usage["completion_tokens"] == len(alone["token_ids"])


@pytest.mark.parametrize("split", [True, False])
def test_reasoning_block_of_the_embedded_model(tmp_path, split):
    """The embedded model opens every chat answer with an empty <think></think> block: it is
    not part of `content` (streamed or not) unless `[server] split_reasoning = false`."""
    from daemon.config import DEFAULT_MODEL

    srv = Server(tmp_path, DEFAULT_MODEL, server={"split_reasoning": split}).start()
    try:
        async def go():
            async with aiohttp.ClientSession() as s:
                return await asyncio.gather(
                    chat(s, srv.url, "Write a Python function that reverses a string", 16),
                    chat(s, srv.url, "Write a Python function that reverses a string", 16,
                         stream=False))

        (streamed, _, _), (whole, _, _) = run(go())
    finally:
        assert srv.stop() == 0
    assert streamed == whole
    if split:
        assert "<think>" not in whole and "</think>" not in whole and whole.strip()
    else:
        assert whole.startswith("<think>")


def test_int8_kv_through_the_daemon_keeps_speculation_exact(tmp_path):
    """[scheduler] kv_cache_dtype = "int8" reaches the worker; with it, wide speculation
    (suffix and MTP drafts) answers four concurrent streams with plain decoding's text."""
    model = make_tiny_model(tmp_path / "m", "qwen3_next", seed=7, layers=4, head_dim=32)
    answers = {}
    for arm, spec in (("off", {"mode": "off"}), ("suffix", {"mode": "wide", "min_match": 1}),
                      ("mtp", {"mode": "wide", "proposer": "mtp"})):
        (tmp_path / arm).mkdir()
        srv = Server(tmp_path / arm, model, scheduler={"kv_cache_dtype": "int8"},
                     speculation=spec).start()
        try:
            async def go(url=srv.url):
                async with aiohttp.ClientSession() as s:
                    return await asyncio.gather(*(chat(s, url, p, max_tokens=32)
                                                  for p in PROMPTS))

            answers[arm] = [text for text, _, _ in run(go())]
            accepted = re.search(r"^tandem_spec_accepted_tokens_total (\S+)$",
                                 srv.get("/metrics")[1], re.M)
        finally:
            assert srv.stop() == 0
        kv = [json.loads(line) for line in srv.log.read_text().splitlines()
              if '"kv cache"' in line]
        assert kv and kv[0]["dtype"] == "int8", kv
        if arm != "off":
            assert accepted and float(accepted.group(1)) > 0, arm
    assert answers["suffix"] == answers["off"] and answers["mtp"] == answers["off"]
    assert all(answers["off"])

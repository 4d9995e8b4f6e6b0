"""The soak's fuzzers: bad HTTP requests and malformed ZeroMQ frames, from a seeded RNG.

HTTP: valid bodies with one field made wrong (type, size, sign, nesting, lone surrogates),
random bytes, truncated JSON, wrong content types, methods and paths, oversized bodies. The
daemon must answer each with a status below 500, or 503 (overload). ZeroMQ: random frames,
random msgpack under real kind bytes, real messages with a field retyped, removed, added or
made huge, truncated bodies, kinds of the wrong direction, too many frames, oversized parts.
Every answer must decode as a typed daemon -> client message (an ErrorReply, mostly).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

import aiohttp
import msgpack
import zmq

from protocol.codec import decode, encode
from protocol.kinds import DAEMON_TO_CLIENT, MsgKind
from protocol.messages import (
    CancelRequest,
    ChatMessage,
    SamplingParams,
    StatusRequest,
    SubmitRequest,
)

WRONG_VALUES: tuple[Any, ...] = (None, True, -1, 0, 2**31, 2**63 - 1, -2**63, 10**30, 1e308,
                                 -0.0, "", "x" * 5000, "\ud800", [], [1, "a", None], {},
                                 {"a": {"b": [{}]}}, "NaN", 3.5, [[[[[[[[1]]]]]]]])
# msgpack carries neither a lone surrogate nor an int past 64 bits: bytes (bin), an ext value
# and the 64-bit extremes instead
MSGPACK_VALUES = tuple(v for v in WRONG_VALUES if v not in ("\ud800", 10**30)) + (
    b"\xff\xfe", msgpack.ExtType(5, b"xyz"), 2**64 - 1)
HTTP_FIELDS = ("model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k",
               "min_p", "seed", "stop", "stream", "stream_options", "n", "priority",
               "ignore_eos", "tools", "tool_choice", "user", "presence_penalty", "logprobs",
               "response_format", "enable_thinking", "chat_template_kwargs", "bogus")


# ---- HTTP -------------------------------------------------------------------------------------
def http_case(rng: random.Random) -> tuple[str, str, dict[str, str], bytes]:
    """(method, path, headers, body) of one fuzzed request."""
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"max_tokens": 4, "temperature": 0}
    body |= ({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    headers = {"Content-Type": "application/json"}
    roll = rng.randrange(10)
    if roll <= 3:  # one or two fields wrong
        for _ in range(rng.randint(1, 2)):
            body[rng.choice(HTTP_FIELDS)] = rng.choice(WRONG_VALUES)
        if chat and rng.random() < 0.3:
            body["messages"] = [{"role": rng.choice(("user", "root", 5, None)),
                                 "content": rng.choice(WRONG_VALUES)}]
        raw = json.dumps(body).encode()
    elif roll == 4:
        raw = rng.randbytes(rng.randrange(0, 300))
    elif roll == 5:
        full = json.dumps(body).encode()
        raw = full[:rng.randrange(len(full))]
    elif roll == 6:
        headers["Content-Type"] = rng.choice(("text/plain", "application/x-www-form-urlencoded",
                                              "multipart/form-data", "application/xml"))
        raw = json.dumps(body).encode()
    elif roll == 7:
        method, path = rng.choice((("GET", path), ("PUT", path), ("DELETE", "/v1/models"),
                                   ("POST", "/v1/nothing"), ("POST", "/v1/models/x%00"),
                                   ("GET", "/v1/models/" + "a" * 3000), ("PATCH", "/metrics")))
        return method, path, headers, json.dumps(body).encode()
    elif roll == 8:
        depth = rng.choice((100, 1000, 100000))
        raw = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
    else:
        raw = (json.dumps(body).encode() if rng.random() < 0.9 else
               b'{"prompt": "' + b"a" * (2 << 20) + b'"}')  # over max_body_bytes
        if rng.random() < 0.5:
            body["prompt" if not chat else "messages"] = (
                [rng.randrange(-10, 10**6) for _ in range(8)] if not chat else
                [{"role": "user", "content": "\\u" + rng.randbytes(2).hex()}])
            raw = json.dumps(body).encode()
    return "POST", path, headers, raw


async def fuzz_http(url: str, n: int, seed: int, concurrency: int = 8) -> dict:
    """Send ``n`` fuzzed requests; statuses by code, and the 5xx other than 503."""
    rng = random.Random(seed)
    cases = [http_case(rng) for _ in range(n)]
    statuses: Counter = Counter()
    bad: list[dict] = []
    timeout = aiohttp.ClientTimeout(total=120)

    async def one(session: aiohttp.ClientSession, case: tuple) -> None:
        method, path, headers, raw = case
        try:
            async with session.request(method, url + path, headers=headers, data=raw,
                                       timeout=timeout) as r:
                text = await r.text(errors="replace")
                statuses[r.status] += 1
                if r.status >= 500 and r.status != 503:
                    bad.append({"status": r.status, "body": raw[:200].decode("latin-1"),
                                "answer": text[:300]})
        except Exception as exc:  # e.g. the daemon closed the connection: counted, not fatal
            statuses[f"client {type(exc).__name__}"] += 1

    async with aiohttp.ClientSession() as session:
        queue = list(reversed(cases))

        async def worker() -> None:
            while queue:
                await one(session, queue.pop())
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"sent": n, "statuses": {str(k): v for k, v in sorted(statuses.items(), key=str)},
            "server_errors": len(bad), "server_error_examples": bad[:5]}


# ---- ZeroMQ -----------------------------------------------------------------------------------
def _valid(rng: random.Random) -> Any:
    return rng.choice((
        SubmitRequest(request_id=f"f{rng.randrange(10**6)}", prompt="hi", max_tokens=2,
                      sampling=SamplingParams(temperature=0.0)),
        SubmitRequest(request_id="fm", messages=[ChatMessage(role="user", content="x")],
                      max_tokens=2),
        CancelRequest(request_id="nobody"), StatusRequest(query_id="q")))


def zmq_case(rng: random.Random) -> list[bytes]:
    """The frames of one malformed message."""
    frames = [bytes(f) for f in encode(_valid(rng))]
    roll = rng.randrange(8)
    if roll == 0:  # random frames
        return [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randint(1, 3))]
    if roll == 1:  # a real kind, random msgpack
        kind = rng.choice(list(MsgKind)).to_bytes(1, "little")
        return [kind, msgpack.packb(rng.choice(MSGPACK_VALUES), use_bin_type=True)]
    if roll in (2, 3):  # a real message, one field wrong, removed or added
        body = msgpack.unpackb(frames[1], raw=False, strict_map_key=False)
        if isinstance(body, dict) and body:
            key = rng.choice(list(body))
            action = rng.randrange(3)
            if action == 0:
                body[key] = rng.choice(MSGPACK_VALUES)
            elif action == 1:
                del body[key]
            else:
                body["extra_" + str(rng.randrange(9))] = 1
        elif isinstance(body, list) and body:
            body[rng.randrange(len(body))] = rng.choice(MSGPACK_VALUES)
        return [frames[0], msgpack.packb(body, use_bin_type=True), *frames[2:]]
    if roll == 4:  # truncated
        return [frames[0], frames[1][:rng.randrange(len(frames[1]))], *frames[2:]]
    if roll == 5:  # a kind of another direction under a client body
        wrong = rng.choice((MsgKind.STEP_PLAN, MsgKind.READY, MsgKind.TOKEN_EVENT,
                            MsgKind.ERROR_REPLY, MsgKind.HEARTBEAT, 0x7F, 0xFF))
        return [int(wrong).to_bytes(1, "little"), *frames[1:]]
    if roll == 6:  # too many frames
        return frames + [b"\x00" * rng.randrange(8) for _ in range(rng.randint(1, 30))]
    if rng.random() < 0.1:  # an oversized part (over max_body_bytes; 4x it is dropped)
        return [frames[0], b"\x91" + b"\x00" * (rng.choice((2, 5)) << 20)]
    return [frames[0], rng.randbytes(len(frames[1]))]


def fuzz_zmq(address: str, n: int, seed: int, per_socket: int = 250) -> dict:
    """Send ``n`` malformed messages (a fresh connection every ``per_socket``), draining the
    answers; every answer must decode as a daemon -> client message."""
    rng = random.Random(seed)
    ctx = zmq.Context.instance()
    replies: Counter = Counter()
    undecodable: list[str] = []
    sent = 0
    while sent < n:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        try:
            for _ in range(min(per_socket, n - sent)):
                sock.send_multipart(zmq_case(rng))
                sent += 1
                _drain(sock, replies, undecodable, 0)
            deadline = time.monotonic() + 2.0  # the answers still in flight
            while time.monotonic() < deadline:
                _drain(sock, replies, undecodable, 50)
        finally:
            sock.close()
    return {"sent": sent, "replies": dict(replies), "undecodable_replies": len(undecodable),
            "undecodable_examples": undecodable[:5]}


def _drain(sock: zmq.Socket, replies: Counter, undecodable: list[str], wait_ms: int) -> None:
    while sock.poll(wait_ms, zmq.POLLIN):
        frames = sock.recv_multipart()
        try:
            msg = decode(frames, allowed=DAEMON_TO_CLIENT)
        except Exception as exc:  # any failure to read an answer is the daemon's fault
            undecodable.append(f"{type(exc).__name__}: {exc}"[:300])
            continue
        code = getattr(msg, "code", None)
        replies[type(msg).__name__ + (f" {code.name}" if code is not None else "")] += 1
        wait_ms = 0


def merge_rounds(parts: list[dict]) -> dict:
    """One tally of several rounds' (fuzz_http's or fuzz_zmq's): counts summed, the examples
    of the first rounds kept (five)."""
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, dict):
                counts = out.setdefault(key, Counter())
                counts.update(value)
            elif isinstance(value, list):
                out[key] = (out.get(key, []) + value)[:5]
            else:
                out[key] = out.get(key, 0) + value
    return {k: dict(sorted(v.items(), key=str)) if isinstance(v, Counter) else v
            for k, v in out.items()}

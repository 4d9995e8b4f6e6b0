"""The soak's load: seeded jobs, their references (each run alone), and clients over HTTP
(streaming or not) and ZeroMQ that cancel or walk away at random.

Every request the soak sends is one of a few jobs (endpoint, prompt, max_tokens, sampling
with a fixed seed). Each job's answer is computed alone before the load; every request that
completes under load must give exactly that text and token count (no token lost or
duplicated, nothing leaked from a neighbour in the batch). A request that fails must fail
clearly: HTTP 4xx or 503 with a message (an SSE `error` event with one), or a typed ZeroMQ
error.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import time
from collections import Counter
from typing import Any

import aiohttp

from protocol.client import AsyncTandemClient
from protocol.errors import TandemError, TandemTimeoutError

WORDS = ("river stone lamp orchard signal copper winter garden ladder harbor pencil cloud "
         "market violin thunder candle").split()
TIMEOUT_S = 180.0


@dataclasses.dataclass(frozen=True)
class Job:
    chat: bool
    prompt: str
    max_tokens: int
    temperature: float
    seed: int
    speculation: bool = True  # False: the request opts out (the references of a speculating soak)


def make_jobs(seed: int, n: int = 10, max_tokens: int = 48) -> list[Job]:
    """``n`` jobs: chat and plain, greedy and seeded sampling, short and long prompts (a long
    one spans several prefill chunks), up to ``max_tokens`` each."""
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        words = rng.randint(3, 12) if i % 3 else rng.randint(60, 120)
        jobs.append(Job(chat=i % 2 == 0, prompt=" ".join(rng.choice(WORDS) for _ in
                                                          range(words)),
                        max_tokens=min(rng.choice((8, 16, 32, 48)), max_tokens),
                        temperature=0.0 if i % 4 == 0 else 0.8, seed=rng.randrange(1 << 30)))
    return jobs


@dataclasses.dataclass
class Answer:
    text: str  # canonical: JSON of [reasoning, content] (HTTP) or the text (ZeroMQ)
    tokens: int


@dataclasses.dataclass
class Tally:
    """What the requests of one phase came to."""

    completed: int = 0
    mismatched: list[dict] = dataclasses.field(default_factory=list)
    failed_clear: Counter = dataclasses.field(default_factory=Counter)
    failed_unclear: list[dict] = dataclasses.field(default_factory=list)
    cancelled: int = 0
    disconnected: int = 0

    def failed(self, clear: bool, what: str, detail: Any = None) -> None:
        if clear:
            self.failed_clear[what] += 1
        elif len(self.failed_unclear) < 50:
            self.failed_unclear.append({"what": what, "detail": str(detail)[:300]})
        else:
            self.failed_unclear.append({"what": what})

    def as_dict(self) -> dict:
        return {"completed": self.completed, "mismatched": len(self.mismatched),
                "mismatch_examples": self.mismatched[:5], "cancelled": self.cancelled,
                "disconnected": self.disconnected, "failed_clear": dict(self.failed_clear),
                "failed_unclear": len(self.failed_unclear),
                "unclear_examples": self.failed_unclear[:5]}


# ---- HTTP -------------------------------------------------------------------------------------
def http_body(job: Job, stream: bool) -> tuple[str, dict]:
    body: dict[str, Any] = {"max_tokens": job.max_tokens, "temperature": job.temperature,
                            "seed": job.seed, "stream": stream}
    if not job.speculation:
        body["speculation"] = False
    if stream:
        body["stream_options"] = {"include_usage": True}
    if job.chat:
        return "/v1/chat/completions", body | {"messages": [{"role": "user",
                                                              "content": job.prompt}]}
    return "/v1/completions", body | {"prompt": job.prompt}


def _canonical(choice: dict) -> tuple[str, str]:
    if "message" in choice:
        m = choice["message"]
        return m.get("reasoning_content") or "", m.get("content") or ""
    if "delta" in choice:
        d = choice["delta"]
        return d.get("reasoning_content") or "", d.get("content") or ""
    return "", choice.get("text") or ""


def clear_http_error(status: int, body: Any) -> bool:
    """4xx or 503, with an OpenAI-shaped error that has a message."""
    message = body.get("error", {}).get("message") if isinstance(body, dict) else None
    return (400 <= status < 500 or status == 503) and isinstance(message, str) and bool(message)


async def http_request(session: aiohttp.ClientSession, url: str, job: Job, stream: bool,
                       leave_after: int | None = None) -> tuple[str, Any]:
    """("completed", Answer) | ("failed", (clear, what, detail)) | ("disconnected", None).
    ``leave_after``: close the connection after that many chunks (streaming) or that many
    tenths of a second (not streaming)."""
    path, body = http_body(job, stream)
    if not stream and leave_after is not None:
        task = asyncio.create_task(http_request(session, url, job, False))
        await asyncio.sleep(leave_after / 10)
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return "disconnected", None
        return task.result()
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    async with session.post(url + path, json=body, timeout=timeout) as r:
        if r.status != 200:
            try:
                data = await r.json(content_type=None)
            except (json.JSONDecodeError, aiohttp.ContentTypeError, UnicodeDecodeError):
                data = None
            return "failed", (clear_http_error(r.status, data), f"http {r.status}", data)
        if not stream:
            data = await r.json()
            return "completed", Answer(json.dumps(_canonical(data["choices"][0])),
                                       data["usage"]["completion_tokens"])
        reasoning, content, tokens, chunks = [], [], None, 0
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                clear = bool(data["error"].get("message"))
                return "failed", (clear, f"sse {data['error'].get('code')}", data)
            for choice in data.get("choices", []):
                rs, ct = _canonical(choice)
                reasoning.append(rs)
                content.append(ct)
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                r.close()
                return "disconnected", None
        if tokens is None:
            return "failed", (False, "sse without usage", None)
        return "completed", Answer(json.dumps(["".join(reasoning), "".join(content)]), tokens)


# ---- ZeroMQ -----------------------------------------------------------------------------------
def zmq_args(job: Job, stream: bool) -> dict:
    args: dict[str, Any] = {"max_tokens": job.max_tokens, "temperature": job.temperature,
                            "seed": job.seed, "stream": stream, "include_usage": True,
                            "speculation": job.speculation}
    if job.chat:
        return args | {"messages": [{"role": "user", "content": job.prompt}]}
    return args | {"prompt": job.prompt}


async def zmq_request(client: AsyncTandemClient, job: Job, stream: bool,
                      cancel_after: int | None = None) -> tuple[str, Any]:
    """Like http_request; ``cancel_after``: send a CancelRequest after that many events."""
    text, events, last = [], 0, None
    try:
        rid = await client.submit(**zmq_args(job, stream))
        async for event in client.stream(rid, timeout=TIMEOUT_S):
            text.append(event.text)
            events, last = events + 1, event
            if cancel_after is not None and events == cancel_after and not event.finish_reason:
                await client.cancel(rid)
    except TandemTimeoutError as exc:
        return "failed", (False, "zmq timeout", exc)
    except TandemError as exc:  # typed: clear when it says something
        return "failed", (bool(str(exc)), f"zmq {type(exc).__name__}", exc)
    if last is None:
        return "failed", (False, "zmq no event", None)
    if last.finish_reason == "cancelled":
        return "cancelled", None
    if last.finish_reason not in ("stop", "length") or last.usage is None:
        return "failed", (False, f"zmq finish {last.finish_reason}", last)
    return "completed", Answer("".join(text), last.usage.completion_tokens)


def record(tally: Tally, outcome: tuple[str, Any], ref: Answer | None, where: str) -> None:
    kind, value = outcome
    if kind == "completed":
        tally.completed += 1
        if ref is not None and (value.text != ref.text or value.tokens != ref.tokens):
            tally.mismatched.append({"where": where, "got": dataclasses.asdict(value),
                                     "want": dataclasses.asdict(ref)})
    elif kind == "failed":
        tally.failed(*value)
    elif kind == "cancelled":
        tally.cancelled += 1
    else:
        tally.disconnected += 1


async def references(url: str, address: str, jobs: list[Job],
                     plain: bool = False) -> dict[tuple[str, int], Answer]:
    """Each job alone, over HTTP and over ZeroMQ; ``plain``: each opted out of speculation
    (a speculating daemon's load must then give plain decoding's tokens)."""
    refs = {}
    async with aiohttp.ClientSession() as session, AsyncTandemClient(address) as client:
        for i, job in enumerate(jobs):
            job = dataclasses.replace(job, speculation=False) if plain else job
            for api, outcome in (("http", await http_request(session, url, job, False)),
                                 ("zmq", await zmq_request(client, job, False))):
                if outcome[0] != "completed":
                    raise RuntimeError(f"reference {api} {job} failed: {outcome}")
                refs[(api, i)] = outcome[1]
    return refs


async def client_loop(n: int, url: str, address: str, jobs: list[Job],
                      refs: dict[tuple[str, int], Answer], until: float, tally: Tally,
                      seed: int, p_cancel: float = 0.15, p_leave: float = 0.1) -> None:
    """One client until ``until`` (monotonic): even ``n`` HTTP, odd ZeroMQ; each request
    streams or not at random, and is cancelled or abandoned at random."""
    rng = random.Random(seed * 1000 + n)
    api = "http" if n % 2 == 0 else "zmq"
    session = aiohttp.ClientSession() if api == "http" else None
    zmq = AsyncTandemClient(address, timeout=TIMEOUT_S) if api == "zmq" else None
    try:
        while time.monotonic() < until:
            i = rng.randrange(len(jobs))
            stream, roll = rng.random() < 0.5, rng.random()
            early = rng.randint(1, 6) if roll < p_cancel + p_leave else None
            try:
                if api == "http":
                    outcome = await http_request(session, url, jobs[i], stream, early)
                elif roll < p_cancel:
                    outcome = await zmq_request(zmq, jobs[i], stream, cancel_after=early)
                elif roll < p_cancel + p_leave:  # walk away: close the connection mid-request
                    task = asyncio.create_task(zmq_request(zmq, jobs[i], stream))
                    await asyncio.sleep(early / 10)
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    await zmq.close()
                    zmq = AsyncTandemClient(address, timeout=TIMEOUT_S)
                    outcome = ("disconnected", None)
                else:
                    outcome = await zmq_request(zmq, jobs[i], stream)
            except Exception as exc:  # a connection error, or an answer that does not parse
                outcome = ("failed", (False, f"{api} {type(exc).__name__}", exc))
            record(tally, outcome, refs[(api, i)], f"{api} client {n} job {i} stream={stream}")
            if outcome[0] == "failed":  # as a client honouring Retry-After would
                await asyncio.sleep(0.5)
    finally:
        if session is not None:
            await session.close()
        if zmq is not None:
            await zmq.close()

"""Routing keys through the real daemon (docs/synthetic.md): a tiny synthetic model served by
``tandem serve``. READY tells the daemon that the model routes by key; a request with a
``user`` gives the same text whichever slot it lands in (HTTP and the ZeroMQ client alike),
one without is slot-keyed, and the prefix cache shares a prompt only within one user."""

from __future__ import annotations

import asyncio
import json

import pytest

aiohttp = pytest.importorskip("aiohttp")

from protocol.client import TandemClient  # noqa: E402
from scripts import make_synthetic_model  # noqa: E402
from scripts.bench_common import sse_chunks  # noqa: E402
from scripts.tiny_model import DEFAULT_SIZES, build_config  # noqa: E402
from tests.integration.server import Server  # noqa: E402

# over 32 tokens (the checkpoint interval): a repeat reuses its last checkpoint before the end
PROMPT = ("The river town kept its clocks by the sun, and every merchant on the quay argued "
          "about noon. One morning a stranger brought a pendulum.")
FILLERS = ["Once upon a time", "def main():"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("synthetic")
    raw = build_config("qwen3_next", {**DEFAULT_SIZES, "experts": 8, "topk": 2, "vocab": 1024},
                       "bfloat16", [1023])
    (tmp / "config.json").write_text(json.dumps(raw))
    assert make_synthetic_model.main([str(tmp / "config.json"), "--out", str(tmp / "model"),
                                      "--skew", "0.8", "--locality", "0.5"]) == 0
    srv = Server(tmp, tmp / "model", scheduler={"max_slots": 3}).start()
    yield srv
    assert srv.stop() == 0


async def complete(s, url: str, prompt: str, user: str | None = None, max_tokens: int = 12,
                   started: asyncio.Event | None = None) -> tuple[str, int]:
    """One streamed /v1/completions (temperature 0.9, seed 5): its text and cached tokens.
    ``started`` is set at its first token (it holds a slot then)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.9, "seed": 5,
            "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": started is not None}  # fillers run their whole length
    if user is not None:
        body["user"] = user
    text, cached = [], None
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for chunk in sse_chunks(r):
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
            text += [c.get("text") or "" for c in chunk["choices"]]
            if started is not None and chunk["choices"]:
                started.set()
    return "".join(text), cached


def test_a_user_keeps_its_tokens_in_any_slot_and_its_prefixes_to_itself(server):
    async def go():
        async with aiohttp.ClientSession() as s:
            alone = await complete(s, server.url, PROMPT, "agent-0")  # slot 0
            plain = await complete(s, server.url, PROMPT)  # slot 0, no user
            events = [asyncio.Event() for _ in FILLERS]
            fillers = [asyncio.create_task(complete(s, server.url, f, max_tokens=400,
                                                    started=e))
                       for f, e in zip(FILLERS, events, strict=True)]
            await asyncio.gather(*(e.wait() for e in events))  # slots 0 and 1 taken
            busy = await complete(s, server.url, PROMPT, "agent-0")  # slot 2
            moved = await complete(s, server.url, PROMPT)  # slot 2, no user
            other = await complete(s, server.url, PROMPT, "agent-1")
            assert not any(f.done() for f in fillers)  # they held slots 0 and 1 throughout
            await asyncio.gather(*fillers)
            return alone, plain, busy, moved, other

    alone, plain, busy, moved, other = asyncio.run(go())
    assert busy[0] == alone[0]  # the user's tokens, in slot 0 or slot 2
    assert moved[0] != plain[0]  # without a user: keyed by the slot, as before
    assert alone[0] != plain[0]
    # the prefix cache: agent-0's prompt again reuses its checkpoint; nobody else's does
    assert alone[1] == plain[1] == 0 and busy[1] >= 32
    assert moved[1] == other[1] == 0
    with TandemClient(server.zmq_address, timeout=30) as client:  # the ZeroMQ API's user
        out = client.generate(PROMPT, max_tokens=12, temperature=0.9, seed=5, user="agent-0")
    assert out.text == alone[0] and out.usage.cached_tokens == busy[1]

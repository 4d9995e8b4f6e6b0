"""The concurrency benchmark's workloads (scripts/bench_concurrency.py): four streams of
essays or of coding agents (their tools: scripts/bench_concurrency_tools.py), fixed prompts
and seeds, temperature 0.85, thinking disabled, each stream's requests streamed over the
OpenAI chat API and admitted in stream order. Every request names its stream as OpenAI's
``user`` (``essay-<i>``, ``agent-<i>``, ``warm-up-<i>``): a synthetic model routes by it
(docs/synthetic.md), so a stream's tokens do not depend on the slot its request takes."""

from __future__ import annotations

import argparse
import asyncio
import functools
import tempfile
import time
from pathlib import Path

import aiohttp

from scripts.bench_common import sse_chunks
from scripts.bench_concurrency_tools import (
    FILE_BYTES,
    SCRIPT,
    TOOLS,
    run_tool,
    scripted_call,
    setup_project,
)

TEMPERATURE = 0.85
STREAMS = 4
ESSAYS = [
    "Write a long essay on how the printing press changed the spread of ideas in Europe.",
    "Write a long essay about the history of timekeeping, from sundials to atomic clocks.",
    "Write a long essay on why cities grew up beside rivers, with examples from three "
    "continents.",
    "Write a long essay explaining how vaccines train the immune system, for a general reader.",
]
TASKS = [
    ("lru.py", "a class LRUCache(capacity) with get(key) and put(key, value), evicting the "
               "least recently used entry"),
    ("csvline.py", "a function parse_line(line) that splits one CSV line into fields, "
                   "honouring double quotes"),
    ("intervals.py", "a function merge(intervals) that merges overlapping (start, end) pairs"),
    ("roman.py", "functions to_roman(n) and from_roman(s) for 1 <= n <= 3999"),
]
WARM_UP = [f"Hello, this is stream {i}. Say something." for i in range(STREAMS)]
SYSTEM = ("You are a coding agent. Work through the tools: read the project files you need, "
          "write the module with write_file, check it with run_check, fix it if the check "
          "fails.")


async def chat(session: aiohttp.ClientSession, url: str, model: str, messages: list[dict],
               max_tokens: int, seed: int, tools: list | None = None,
               started: asyncio.Event | None = None, user: str | None = None) -> dict:
    """One streamed chat completion: its text, tool calls and completion tokens; ``started``
    is set at its first token (the request holds a slot then); ``user``: OpenAI's field (the
    stream's name: a synthetic model's routing key)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": TEMPERATURE, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True},
            "chat_template_kwargs": {"enable_thinking": False}}
    if tools:
        body["tools"] = tools
    if user is not None:
        body["user"] = user
    text, calls, tokens, prompt = [], [], 0, (None, None)
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for chunk in sse_chunks(r):
            if chunk.get("usage"):
                usage = chunk["usage"]
                tokens = usage["completion_tokens"]
                prompt = (usage.get("prompt_tokens"),
                          (usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
            for choice in chunk.get("choices", []):
                d = choice.get("delta", {})
                text.append(d.get("content") or "")
                calls += d.get("tool_calls") or []
                if started and (d.get("content") or d.get("tool_calls") or
                                choice.get("finish_reason")):
                    started.set()
    return {"text": "".join(text), "tool_calls": calls, "tokens": tokens, "prompt": prompt}


async def in_order(starts: list) -> list:
    """Await ``starts[i](started=...)`` concurrently, each begun once the one before it has its
    first token (``started`` set): admitted in index order, request i takes slot i in every
    run (a synthetic model routes by the requests' ``user``, not by slot; the order keeps the
    runs' schedules alike)."""
    events = [asyncio.Event() for _ in starts]

    async def one(i: int, start) -> dict:
        if i:
            await events[i - 1].wait()
        try:
            return await start(started=events[i])
        finally:
            events[i].set()

    return await asyncio.gather(*(one(i, f) for i, f in enumerate(starts)))


async def agent_loop(session: aiohttp.ClientSession, url: str, model: str, i: int,
                     max_tokens: int, started: asyncio.Event | None = None, chat_fn=None,
                     file_bytes: tuple[int, int] = FILE_BYTES, turns: int = len(SCRIPT)
                     ) -> dict:
    """One coding agent, ``turns`` (the first of ``SCRIPT``'s): the model writes, then the
    turn's scripted tool call (scripts/bench_concurrency_tools.py) runs and its result joins
    the context. ``started``: set at the first turn's first token; ``chat_fn``: ``chat``
    (tests pass a stand-in); ``file_bytes``: the read files' sizes. Returns tokens, turns,
    tool calls, the characters the tools sent back and each turn's [prompt tokens, of them
    cached]. Only the first turn's slot is fixed (``in_order``): later turns take the slot
    free then; every turn is sent as user ``agent-<i>``, so a synthetic model routes it
    alike in every slot, arm and run."""
    chat_fn = chat_fn or chat
    filename, what = TASKS[i]
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Write {filename}: {what}."}]
    tokens = calls = tool_chars = 0
    prompts = []
    with tempfile.TemporaryDirectory() as tmp:
        files = setup_project(Path(tmp), i, file_bytes)
        for turn in range(turns):
            res = await chat_fn(session, url, model, messages, max_tokens, 100 * i + turn,
                                TOOLS, user=f"agent-{i}",
                                **({"started": started} if started and not turn else {}))
            tokens += res["tokens"]
            prompts.append(list(res.get("prompt", (None, None))))
            call = scripted_call(turn, i, filename, files, res["text"])
            messages.append({"role": "assistant", "content": res["text"], "tool_calls": [call]})
            out = await asyncio.to_thread(run_tool, Path(tmp), call["function"]["name"],
                                          call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": out})
            calls += 1
            tool_chars += len(out)
    return {"tokens": tokens, "turns": turns, "tool_calls": calls,
            "tool_chars": tool_chars, "turn_prompts": prompts}


async def essay(session: aiohttp.ClientSession, url: str, model: str, i: int,
                max_tokens: int, started: asyncio.Event | None = None) -> dict:
    res = await chat(session, url, model, [{"role": "user", "content": ESSAYS[i]}],
                     max_tokens, 1000 + i, started=started, user=f"essay-{i}")
    return {"tokens": res["tokens"], "turns": 1, "tool_calls": 0}


async def workload(url: str, model: str, name: str, args: argparse.Namespace
                   ) -> tuple[list[dict], float]:
    fn, max_tokens = ((essay, args.essay_tokens) if name == "essay"
                      else (functools.partial(agent_loop, file_bytes=args.file_bytes,
                                              turns=args.coding_turns), args.coding_tokens))
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        t0 = time.monotonic()
        streams = await in_order([functools.partial(fn, s, url, model, i, max_tokens)
                                  for i in range(STREAMS)])
        return streams, time.monotonic() - t0

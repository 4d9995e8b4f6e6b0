"""The concurrency benchmark: four streams, two workloads, speculation arms.

    python -m scripts.bench_concurrency --out-dir docs/bench/concurrency_cpu

Workloads (fixed prompts and seeds, temperature 0.85, thinking disabled):

* ``essay``: four independent long-form prompts, ``--essay-tokens`` each;
* ``coding``: four independent agent loops of six turns, ``--coding-tokens`` per turn. The
  tool calls are scripted (a small model never makes them): after each turn the harness
  reads a project file of 2-8 kB, writes the module (the turn's text) or checks it
  (``run_check`` byte-compiles and imports it in a child Python), in a scratch directory per
  loop, and sends the result back, so contexts grow as an agent's do
  (scripts/bench_concurrency_tools.py).

Every run is a fresh ``tandem serve`` process; one short request warms it up and is excluded
(counters are read after it). Arms (``--arms``): the server's ``--speculation`` mode
(``narrow``: each drafted slot verified alone; ``wide``: 2-4 drafted slots in one pass;
``off``), or ``adaptive``: wide with ``draft_budget = "adaptive"`` (docs/speculation.md, the
draft budget); ``@N`` after an arm sets ``num_drafts`` (``wide@2``, ``adaptive@8``: the fixed
lengths beside the adaptive budget). ``--pairs`` paired runs per workload, the arms' order
alternating pair by pair.

Figures per run, from the server's own counters (``/metrics``):

* four-stream decode TPS: tokens emitted by steps in which four slots were active, all
  decoding (no prompt work: no admission underway), over those steps' wall time
  (``tandem_steady_decode_{tokens,seconds}_total{slots="4"}``);
* whole-run TPS: every completion token over the run's wall time (prompt reads, tool calls
  and fewer active streams included);
* accepted drafts per verification, per draft source.

Outputs differ between arms (sampling meets different batch timing, float32 rounding and
different drafts' acceptances), so whole-run time is not an equal-work comparison. The
summary (``summary.json`` in ``--out-dir``, one JSON per run beside it) gives medians per arm
and the per-pair ratios of each arm over the first (``narrow`` by default).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from scripts.bench_common import command_line, delta, machine, scrape, served, sse_chunks
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
SYSTEM = ("You are a coding agent. Work through the tools: read the project files you need, "
          "write the module with write_file, check it with run_check, fix it if the check "
          "fails.")
async def chat(session: aiohttp.ClientSession, url: str, model: str, messages: list[dict],
               max_tokens: int, seed: int, tools: list | None = None) -> dict:
    """One streamed chat completion: its text, tool calls and completion tokens."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": TEMPERATURE, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True},
            "chat_template_kwargs": {"enable_thinking": False}}
    if tools:
        body["tools"] = tools
    text, calls, tokens = [], [], 0
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for chunk in sse_chunks(r):
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                d = choice.get("delta", {})
                text.append(d.get("content") or "")
                calls += d.get("tool_calls") or []
    return {"text": "".join(text), "tool_calls": calls, "tokens": tokens}


async def agent_loop(session: aiohttp.ClientSession, url: str, model: str, i: int,
                     max_tokens: int, chat_fn=None,
                     file_bytes: tuple[int, int] = FILE_BYTES) -> dict:
    """One coding agent, ``len(SCRIPT)`` turns: the model writes, then the turn's scripted
    tool call (scripts/bench_concurrency_tools.py) runs and its result joins the context.
    ``chat_fn``: ``chat`` (tests pass a stand-in); ``file_bytes``: the read files' sizes.
    Returns tokens, turns, tool calls and the characters the tools sent back."""
    chat_fn = chat_fn or chat
    filename, what = TASKS[i]
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Write {filename}: {what}."}]
    tokens = calls = tool_chars = 0
    with tempfile.TemporaryDirectory() as tmp:
        files = setup_project(Path(tmp), i, file_bytes)
        for turn in range(len(SCRIPT)):
            res = await chat_fn(session, url, model, messages, max_tokens, 100 * i + turn,
                                TOOLS)
            tokens += res["tokens"]
            call = scripted_call(turn, i, filename, files, res["text"])
            messages.append({"role": "assistant", "content": res["text"], "tool_calls": [call]})
            out = await asyncio.to_thread(run_tool, Path(tmp), call["function"]["name"],
                                          call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": out})
            calls += 1
            tool_chars += len(out)
    return {"tokens": tokens, "turns": len(SCRIPT), "tool_calls": calls,
            "tool_chars": tool_chars}


async def essay(session: aiohttp.ClientSession, url: str, model: str, i: int,
                max_tokens: int) -> dict:
    res = await chat(session, url, model, [{"role": "user", "content": ESSAYS[i]}],
                     max_tokens, 1000 + i)
    return {"tokens": res["tokens"], "turns": 1, "tool_calls": 0}


async def workload(url: str, model: str, name: str, args: argparse.Namespace
                   ) -> tuple[list[dict], float]:
    fn, max_tokens = ((essay, args.essay_tokens) if name == "essay"
                      else (functools.partial(agent_loop, file_bytes=args.file_bytes),
                            args.coding_tokens))
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        t0 = time.monotonic()
        streams = await asyncio.gather(*(fn(s, url, model, i, max_tokens)
                                         for i in range(STREAMS)))
        return streams, time.monotonic() - t0


def arm_flags(arm: str) -> tuple[str, tuple[str, ...]]:
    """An arm's ``--speculation`` mode and further ``tandem serve`` flags: "adaptive@8" ->
    ("wide", ("--draft-budget", "adaptive", "--num-drafts", "8"))."""
    mode, _, drafts = arm.partition("@")
    extra: tuple[str, ...] = ()
    if mode == "adaptive":
        mode, extra = "wide", ("--draft-budget", "adaptive")
    if mode not in ("off", "narrow", "wide"):
        raise SystemExit(f"unknown arm {arm!r}: off, narrow, wide or adaptive, then @N")
    return mode, extra + (("--num-drafts", str(int(drafts))) if drafts else ())


def one_run(args: argparse.Namespace, name: str, arm: str, pair: int) -> dict:
    mode, extra = arm_flags(arm)
    with served(args.config, args.port, mode, args.proposer, extra) as (url, model):

        async def warm_up() -> None:
            async with aiohttp.ClientSession() as s:
                await chat(s, url, model, [{"role": "user", "content": "Hello"}], 8, 0)

        asyncio.run(warm_up())
        before = scrape(url)
        streams, wall = asyncio.run(workload(url, model, name, args))
        after = scrape(url)
    steady_s = delta(after, before, "tandem_steady_decode_seconds_total", slots=str(STREAMS))
    steady_t = delta(after, before, "tandem_steady_decode_tokens_total", slots=str(STREAMS))
    tokens = sum(s["tokens"] for s in streams)
    per_source = {}
    for source in ("mtp", "suffix"):
        verifies = delta(after, before, "tandem_spec_verifies_total", source=source)
        if verifies:
            per_source[source] = {
                "verifies": verifies,
                "accepted_per_verify": delta(after, before,
                                             "tandem_spec_accepted_by_source_tokens_total",
                                             source=source) / verifies}
    return {"workload": name, "arm": arm, "pair": pair, "proposer": args.proposer,
            "config": args.config, "machine": machine(),
            "four_stream_decode_tps": steady_t / steady_s if steady_s else None,
            "four_stream_seconds": steady_s, "four_stream_tokens": steady_t,
            "whole_run_tps": tokens / wall, "wall_s": wall, "completion_tokens": tokens,
            "prompt_tokens": delta(after, before, "tandem_prompt_tokens_total"),
            "prompt_cached_tokens": delta(after, before, "tandem_prompt_cached_tokens_total"),
            "tool_calls": sum(s["tool_calls"] for s in streams),
            "turns": sum(s["turns"] for s in streams),
            "tool_chars": sum(s.get("tool_chars", 0) for s in streams), "drafts": per_source}


def summarize(runs: list[dict], arms: list[str]) -> dict:
    out = {}
    for name in sorted({r["workload"] for r in runs}):
        mine = [r for r in runs if r["workload"] == name]
        entry = {}
        for key in ("four_stream_decode_tps", "whole_run_tps"):
            by_arm = {a: [r[key] for r in mine if r["arm"] == a and r[key] is not None]
                      for a in arms}
            entry[key] = {a: statistics.median(v) if v else None for a, v in by_arm.items()}
            base = arms[0]
            entry[key + "_pair_ratios"] = {
                a: [round(x[key] / y[key], 3) for x in mine for y in mine
                    if x["arm"] == a and y["arm"] == base and x["pair"] == y["pair"]
                    and x[key] and y[key]]
                for a in arms[1:]}
        out[name] = entry
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny.toml")
    p.add_argument("--port", type=int, default=8189)
    p.add_argument("--arms", default="narrow,wide",
                   help="comma-separated: off, narrow, wide, adaptive, each with an optional "
                        "@N (num_drafts), e.g. narrow,wide,wide@2,adaptive")
    p.add_argument("--proposer", choices=("suffix", "mtp"), default="mtp")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--workloads", default="essay,coding")
    p.add_argument("--essay-tokens", type=int, default=256)
    p.add_argument("--coding-tokens", type=int, default=192)
    p.add_argument("--file-bytes", type=lambda v: tuple(int(x) for x in v.split(",")),
                   default=FILE_BYTES, help="MIN,MAX bytes of the files the coding agents "
                   "read (default 2048,8192: needs max_context of ~8k tokens and more)")
    p.add_argument("--out-dir", type=Path, required=True)
    args = p.parse_args()
    arms = args.arms.split(",")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for name in args.workloads.split(","):
        for pair in range(1, args.pairs + 1):
            order = arms if pair % 2 else arms[::-1]  # alternate which arm goes first
            for arm in order:
                run = one_run(args, name, arm, pair)
                runs.append(run)
                (args.out_dir / f"{name}_{arm}_{pair}.json").write_text(
                    json.dumps(run, indent=1) + "\n")
                tps = run["four_stream_decode_tps"]
                print(f"{name:6s} {arm:6s} pair {pair}: four-stream "
                      f"{'-' if tps is None else f'{tps:.1f}'} tok/s, whole run "
                      f"{run['whole_run_tps']:.1f} tok/s, drafts {run['drafts']}", flush=True)
    summary = {"command": command_line(),
               "arms": arms, "runs": len(runs), "by_workload": summarize(runs, arms)}
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary["by_workload"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

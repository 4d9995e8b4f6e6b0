"""Serving throughput at 1..4 concurrent streams against a fresh `tandem serve` process.

    python -m scripts.bench_serving --config configs/tiny.toml --out docs/bench/serving_cpu.json

For each concurrency N it sends N streaming chat requests at once (fixed prompts, seeded
sampling, fixed max_tokens, EOS ignored so every stream does equal work) and reports the
aggregate decode tokens/s over the interval where all N streams were generating (first token
of the last stream to start -> first stream to finish), whole-run tokens/s, and mean TTFT.
Warm-up (one request) is excluded. ``--speculation off|narrow|wide`` picks the arm (the
server's ``--speculation``); each round also reports the drafts proposed and accepted
(from /metrics). Outputs differ between arms only through timing: the tokens are the same.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp

from scripts.bench_common import command_line, delta, machine, scrape, served, sse_chunks

PROMPTS = [
    "Write a Python function that parses a CSV line into fields.",
    "Explain what the os.path module is for.",
    "Write a class that implements a least-recently-used cache.",
    "Describe how to read a file line by line in Python.",
]


async def _stream(session: aiohttp.ClientSession, url: str, model: str, prompt: str,
                  max_tokens: int, seed: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0.85, "seed": seed, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    first = last = None
    tokens = 0
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for chunk in sse_chunks(r):
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and first is None:
                first = time.monotonic()
            last = time.monotonic()
    return {"start": t0, "first": first, "end": last, "tokens": tokens}


async def _round(url: str, model: str, n: int, max_tokens: int) -> dict:
    before = scrape(url)
    async with aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        res = await asyncio.gather(*(_stream(s, url, model, PROMPTS[i], max_tokens, i)
                                     for i in range(n)))
        t1 = time.monotonic()
    after = scrape(url)
    all_on = max(r["first"] for r in res)
    first_done = min(r["end"] for r in res)
    # tokens emitted while all n streams were active: assume a steady rate per stream
    rates = [r["tokens"] / (r["end"] - r["first"]) for r in res]
    window = max(first_done - all_on, 1e-9)
    return {"streams": n, "max_tokens": max_tokens,
            "total_tokens": sum(r["tokens"] for r in res),
            "whole_run_tps": sum(r["tokens"] for r in res) / (t1 - t0),
            "all_active_tps": sum(rates) if window > 0 else None,
            "all_active_window_s": window,
            "mean_ttft_s": sum(r["first"] - r["start"] for r in res) / n,
            "drafts_proposed": delta(after, before, "tandem_spec_draft_tokens_total"),
            "drafts_accepted": delta(after, before, "tandem_spec_accepted_tokens_total")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default="configs/tiny.toml")
    p.add_argument("--port", type=int, default=8188)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=Path("docs/bench/serving_cpu.json"))
    p.add_argument("--speculation", choices=("off", "narrow", "wide"), default="off")
    p.add_argument("--proposer", choices=("suffix", "mtp"), default="suffix")
    args = p.parse_args()
    with served(args.config, args.port, args.speculation, args.proposer) as (url, model):
        asyncio.run(_round(url, model, 1, 8))  # warm-up, excluded
        rounds = [asyncio.run(_round(url, model, n, args.max_tokens)) for n in (1, 2, 3, 4)]
    report = {"machine": machine(), "command": command_line(), "config": args.config,
              "speculation": args.speculation, "proposer": args.proposer, "rounds": rounds}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for r in rounds:
        print(f"{r['streams']} streams: {r['all_active_tps']:.1f} tok/s all-active, "
              f"{r['whole_run_tps']:.1f} tok/s whole run, TTFT {r['mean_ttft_s'] * 1e3:.0f} ms, "
              f"drafts {r['drafts_accepted']:.0f}/{r['drafts_proposed']:.0f} accepted")
    return 0


if __name__ == "__main__":
    sys.exit(main())

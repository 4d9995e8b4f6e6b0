"""The concurrency benchmark: four streams, two workloads, speculation arms.

    python -m scripts.bench_concurrency --out-dir docs/bench/concurrency_cpu

Workloads (fixed prompts and seeds, temperature 0.85, thinking disabled):

* ``essay``: four independent long-form prompts, ``--essay-tokens`` each;
* ``coding``: four independent agent loops of six turns (``--coding-turns``),
  ``--coding-tokens`` per turn. The
  tool calls are scripted (a small model never makes them): after each turn the harness
  reads a project file of 2-8 kB, writes the module (the turn's text) or checks it
  (``run_check`` byte-compiles and imports it in a child Python), in a scratch directory per
  loop, and sends the result back, so contexts grow as an agent's do
  (scripts/bench_concurrency_tools.py).

Every run is a fresh ``tandem serve`` process with its own config
(scripts/bench_concurrency_serve.py); four short concurrent requests (``--warm-up-tokens``)
warm it up and are excluded (counters are read after them; with the replay proposer they
are in the plain run's records too); the GPU worker has captured every decode and verify
layout of the arm before it is ready (``[model] cuda_graph_warm_up``). Arms (``--arms``):
the speculation mode (``narrow``: each drafted slot verified alone; ``wide``: 2-4 drafted
slots in one pass; ``off``), or ``adaptive``: wide with ``draft_budget = "adaptive"``
(docs/speculation.md, the draft budget); ``@N`` after an arm sets ``num_drafts``
(``wide@2``, ``adaptive@8``: the fixed lengths beside the adaptive budget), and ``+NAME``
other config keys (``wide@3+nopin``: scripts/bench_concurrency_arms.py). ``--pairs``
paired runs per workload, the arms' order alternating pair by pair; ``--time-budget``
starts no run that would end after it.

``--proposer replay`` (benchmarks of random synthetic models): pair 1's ``off`` run records
every request's token ids (``[speculation] record_file``), they become the workload's replay
file, and the other arms draft the plain run's continuation with the acceptance profile's
lengths (daemon/proposers/replay.py). Every run records its ids too, and ``exact`` says how
many of its requests gave the plain run's tokens. docs/benchmarks.md has the whole method.

Figures per run, from the server's own counters (``/metrics``):

* four-stream decode TPS: tokens emitted by steps in which four slots were active, all
  decoding (no prompt work: no admission underway), over those steps' wall time
  (``tandem_steady_decode_{tokens,seconds}_total{slots="4"}``);
* whole-run TPS: every completion token over the run's wall time (prompt reads, tool calls
  and fewer active streams included);
* accepted drafts per verification, per draft source;
* per step: wall time, distinct CPU experts and the CPU floor (scripts/bench_concurrency_serve).

Outputs are the same in every arm only where the backend's rows are batch-invariant (float64;
float32 BLAS may round a batch otherwise): ``exact`` says whether they were, and where not,
whole-run time is not an equal-work comparison. The summary (``summary.json`` in
``--out-dir``, one JSON per run beside it; scripts/bench_concurrency_report.py) gives medians
per arm and the per-pair ratios of each arm over ``--base`` (``narrow`` by default).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from daemon.proposers.replay import ReplayProposer, prompt_key, read_records, write_replay_file
from scripts.bench_common import REPO, command_line, delta, machine, scrape
from scripts.bench_concurrency_arms import (
    arm_overrides,
    arm_speculation,
    replay_split,
    run_config,
)
from scripts.bench_concurrency_report import table, write_summary
from scripts.bench_concurrency_serve import (
    acceptance_luck,
    base_config,
    budget_figures,
    cpu_bytes_per_expert,
    draft_figures,
    exactness,
    pin_placement,
    replay_reference,
    serving,
    start_facts,
    step_figures,
    write_toml,
)
from scripts.bench_concurrency_tools import FILE_BYTES, SCRIPT
from scripts.bench_concurrency_workloads import STREAMS, WARM_UP, chat, in_order, workload
from scripts.procs import free_port
from scripts.step_floor import dram_rate

# a server's start where it finds the CPU experts' shards kept, until a run measured one
# (H100 machines: 15-60 s; one that quantizes them takes 100-180 s)
CACHED_START_S = 60.0


def one_run(args: argparse.Namespace, ctx: dict, name: str, arm: str, pair: int,
            replay: Path | None) -> dict:
    """One fresh server, warm-up excluded, the workload, its figures; every request's
    token ids go to ``ctx["work"]/<run>.records.jsonl`` (docs/speculation.md, the replay
    proposer), a line per step to ``<run>.steps.jsonl`` (daemon/step_trace.py)."""
    begin = time.monotonic()
    records = ctx["work"] / f"{name}_{arm}_{pair}.records.jsonl"
    steps = ctx["work"] / f"{name}_{arm}_{pair}.steps.jsonl"
    records.unlink(missing_ok=True)
    steps.unlink(missing_ok=True)
    spec = arm_speculation(arm, args.proposer)
    spec["record_file"], spec["step_trace_file"] = str(records), str(steps)
    if args.proposer == "replay":
        if spec["mode"] == "off":
            spec["proposer"] = "suffix"  # (unused with mode off; replay needs a file)
        else:
            spec["replay_file"] = str(replay)
    port = free_port()
    run_dir = Path(tempfile.mkdtemp(prefix="tbc-"))  # short: ipc socket paths are <= 107 B
    config = write_toml(ctx["work"] / f"{name}_{arm}_{pair}.toml",
                        run_config(ctx["base"], port=port, run_dir=run_dir, speculation=spec,
                                   overrides=arm_overrides(arm)))
    if "per_expert" not in ctx:
        ctx["per_expert"] = cpu_bytes_per_expert(config)
    log = ctx["work"] / f"{name}_{arm}_{pair}.log"
    t0 = time.monotonic()
    with serving(config, port, log, args.ready_timeout, args.blas_threads) as (url, model):
        start_s = time.monotonic() - t0

        async def warm_up() -> None:
            async with aiohttp.ClientSession() as s:
                await in_order([functools.partial(chat, s, url, model,
                                                  [{"role": "user", "content": p}],
                                                  args.warm_up_tokens, i, user=f"warm-up-{i}")
                                for i, p in enumerate(WARM_UP)])

        asyncio.run(warm_up())
        # the warm-up's steps: written (and committed) before its answers came back
        warm_steps = len(steps.read_text().splitlines()) if steps.is_file() else 0
        before, load = scrape(url), os.getloadavg()[0]
        streams, wall = asyncio.run(workload(url, model, name, args))
        after, load = scrape(url), [load, os.getloadavg()[0]]
        t1 = time.monotonic()
    start = start_facts(log)
    ctx["durations"].append({"workload": name, "seconds": time.monotonic() - begin,
                             "cached": start.get("cpu_shards_cached", True),
                             "start_s": start_s})
    steady_s = delta(after, before, "tandem_steady_decode_seconds_total", slots=str(STREAMS))
    steady_t = delta(after, before, "tandem_steady_decode_tokens_total", slots=str(STREAMS))
    tokens = sum(s["tokens"] for s in streams)
    return {"workload": name, "arm": arm, "pair": pair, "proposer": args.proposer,
            "speculation": {k: v for k, v in spec.items() if not k.endswith("_file")},
            "replay_file": str(replay) if replay else None,
            "model": ctx["facts"]["model"], "gpu_budget_gb": ctx["facts"]["gpu_budget_gb"],
            "cpu_experts_per_layer": ctx["facts"]["cpu_experts_per_layer"],
            "machine": ctx["machine"], "blas_threads": args.blas_threads,
            "load_avg_1min": load,  # other work on the machine
            "four_stream_decode_tps": steady_t / steady_s if steady_s else None,
            "four_stream_seconds": steady_s, "four_stream_tokens": steady_t,
            "whole_run_tps": tokens / wall, "wall_s": wall, "completion_tokens": tokens,
            "prompt_tokens": delta(after, before, "tandem_prompt_tokens_total"),
            "prompt_cached_tokens": delta(after, before, "tandem_prompt_cached_tokens_total"),
            # prompts that started from a checkpoint, by its tier (gpu; host: the host tier)
            "prefix_cache_hits": {tier: delta(after, before, "tandem_prefix_cache_hits_total",
                                              tier=tier) for tier in ("gpu", "host")},
            "tool_calls": sum(s["tool_calls"] for s in streams),
            "turns": sum(s["turns"] for s in streams),
            "tool_chars": sum(s.get("tool_chars", 0) for s in streams),
            # coding: each agent's turns' [prompt tokens, of them from the prefix cache]
            "turn_prompts": [s["turn_prompts"] for s in streams if "turn_prompts" in s],
            "drafts": draft_figures(after, before),
            "budget": budget_figures(after, before),  # adaptive: its estimates and choices
            "steps": step_figures(after, before, ctx["per_expert"], args.dram_gbs),
            "records": str(records),
            "step_trace": {"file": str(steps), "warm_up_lines": warm_steps},
            # replay: how the draws the run met compare with the profile's rate
            "acceptance_luck": acceptance_luck(steps, warm_steps, ReplayProposer.load(replay).p)
            if replay is not None and spec["mode"] != "off" else None,
            # where the run's time went: the server's start (load), warm-up and workload,
            # its stop (every process ended)
            "server_start_s": round(start_s, 1), "run_s": round(t1 - t0 - start_s, 1),
            "server_stop_s": round(time.monotonic() - t1, 1), "start": start}


def record_replay(args: argparse.Namespace, run: dict, path: Path) -> None:
    """The replay file of a workload from its plain (``off``) run's records, with the split
    of experts they were recorded on (bench_concurrency_arms.replay_split)."""
    profile = json.loads(Path(args.profile).read_text())
    split = run["cpu_experts_per_layer"]
    stats = write_replay_file(path, read_records(Path(run["records"])),
                              workload=run["workload"], source=args.replay_source,
                              profile=profile, seed=args.replay_seed,
                              recorded_with=None if split is None else
                              {"cpu_experts_per_layer": split})
    print(f"{run['workload']}: replay file {path}: {stats}", flush=True)


def arm_order(args: argparse.Namespace) -> list[str]:
    """The arms in run order; with the replay proposer ``off`` goes first (pair 1's off run
    records the replay file the other arms read)."""
    arms = args.arms.split(",")
    if args.proposer == "replay" and "off" in arms:
        arms = ["off"] + [a for a in arms if a != "off"]
    return arms


def fits(args: argparse.Namespace, ctx: dict, run: str, workload: str | None = None) -> bool:
    """Whether ``run`` may start: nothing skipped yet and it fits ``--time-budget`` (seconds
    since the start; a run is taken to last as long as :func:`expected_seconds`). Else it
    joins ``ctx["skipped"]`` (the summary's), and so does every later run."""
    if not ctx["skipped"] and (args.time_budget is None or not ctx["durations"] or
                               time.monotonic() - ctx["t0"] + expected_seconds(ctx, workload)
                               <= args.time_budget):
        return True
    ctx["skipped"].append(run)
    return False


def expected_seconds(ctx: dict, workload: str | None) -> float:
    """How long the next run of ``workload`` is taken to last: the longest of its workload's
    runs whose server found the CPU experts' shards kept (a server that quantized them, the
    first of a machine, took a minute or more longer); with none of those, the longest run
    so far of any kind, a quantizing one with its server's start replaced by the longest
    start of a server that found them kept (``CACHED_START_S`` before there is one: the
    first call of a machine would else take its first run's 150 s as every next run's and
    skip them all)."""
    runs = ctx["durations"]
    alike = [d for d in runs if d["workload"] == workload and d["cached"]]
    if alike:
        return max(d["seconds"] for d in alike)
    start = max((d["start_s"] for d in runs if d["cached"] and "start_s" in d),
                default=CACHED_START_S)
    return max(d["seconds"] if d["cached"] or "start_s" not in d
               else d["seconds"] - d["start_s"] + start for d in runs)


def run_workload(args: argparse.Namespace, ctx: dict, name: str, arms: list[str]) -> None:
    """Every pair of one workload; each run's ``exact`` compares its requests' tokens with
    the plain run's (the replay file's records, else ``off`` pair 1's)."""
    replay = ctx["work"] / f"replay_{name}.json" if args.proposer == "replay" else None
    if replay is not None and not replay.is_file() and "off" not in arms:
        if not fits(args, ctx, f"{name}_off_0 (records the replay file)", name):
            return
        record_replay(args, one_run(args, ctx, name, "off", 0, None), replay)
    ref = replay_reference(replay) if replay is not None and replay.is_file() else None
    done: list[dict] = []
    for pair in range(1, args.pairs + 1):
        order = arms if pair % 2 else arms[::-1]  # alternate which arm goes first
        for arm in order:
            out = args.out_dir / f"{name}_{arm}_{pair}.json"
            if args.resume and out.is_file() and (replay is None or replay.is_file()):
                done.append(json.loads(out.read_text()))
                continue
            if not fits(args, ctx, out.stem, name):
                continue
            run = one_run(args, ctx, name, arm, pair, replay)
            if replay is not None and ref is None:  # pair 1's off run: the first of the pair
                record_replay(args, run, replay)
                ref = replay_reference(replay)
            if ref is not None:
                run["exact"] = exactness(read_records(Path(run["records"])), ref)
            done.append(run)
            out.write_text(json.dumps(run, indent=1) + "\n")
            ctx["summary"]()
            tps = run["four_stream_decode_tps"]
            print(f"{name:6s} {arm:10s} pair {pair}: four-stream "
                  f"{'-' if tps is None else f'{tps:.1f}'} tok/s, whole run "
                  f"{run['whole_run_tps']:.1f} tok/s, drafts {run['drafts']}, "
                  f"exact {run.get('exact')}", flush=True)
    plain = args.out_dir / f"{name}_off_1.json"
    if replay is not None or not plain.is_file():
        return
    ref = {prompt_key(r["prompt_ids"]): r["continuation"]
           for r in read_records(Path(json.loads(plain.read_text())["records"]))}
    for run in done:  # other proposers: against off pair 1, once it ran
        if "exact" not in run and Path(run["records"]).is_file():
            run["exact"] = exactness(read_records(Path(run["records"])), ref)
            (args.out_dir / f"{name}_{run['arm']}_{run['pair']}.json").write_text(
                json.dumps(run, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny.toml",
                   help="the base config (not with --model)")
    p.add_argument("--model", default=None, help="instead of --config: a configs/models "
                   "name or config.json, served as a synthetic model (scripts/bench_load.py)")
    p.add_argument("--gpu-budget", default=None, help="with --model: GiB or 'whole'")
    p.add_argument("--max-context", type=int, default=12288, help="with --model")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a config override (TOML value), e.g. experts.placement=\"split\"")
    p.add_argument("--arms", default="narrow,wide",
                   help="comma-separated: off, narrow, wide, adaptive, each with an optional "
                        "@N (num_drafts) and +VARIANT (ARM_VARIANTS: nopin), e.g. "
                        "off,narrow,wide,adaptive,wide@1,wide@2,adaptive+nopin")
    p.add_argument("--base", default=None, help="the arm ratios are over (default: narrow if "
                   "among the arms, else the first)")
    p.add_argument("--proposer", choices=("suffix", "mtp", "replay"), default="mtp")
    p.add_argument("--replay-source", choices=("mtp", "suffix"), default="mtp",
                   help="replay: the source whose acceptance profile the drafts follow")
    p.add_argument("--replay-seed", type=int, default=0)
    p.add_argument("--profile", default=str(REPO / "docs/bench/acceptance_profile.json"))
    p.add_argument("--pairs", type=int, default=3,
                   help="0 with --resume: only the summary of the runs already there")
    p.add_argument("--workloads", default="essay,coding")
    p.add_argument("--essay-tokens", type=int, default=256)
    p.add_argument("--coding-tokens", type=int, default=192)
    p.add_argument("--coding-turns", type=int, default=len(SCRIPT),
                   choices=range(1, len(SCRIPT) + 1), metavar=f"1..{len(SCRIPT)}",
                   help="turns of each coding agent, the first of its script (read, write, "
                   "check, read, write, check); fewer keep a run within one device command "
                   "where prompts are slow (docs/benchmarks.md)")
    p.add_argument("--file-bytes", type=lambda v: tuple(int(x) for x in v.split(",")),
                   default=FILE_BYTES, help="MIN,MAX bytes of the files the coding agents "
                   "read (default 2048,8192: needs max_context of ~8k tokens and more)")
    p.add_argument("--dram-gbs", default=None,
                   help="the CPU's expert read rate for the floor: GB/s, or this machine's "
                        "bench_cpu_experts JSON (default: the H200 machine's, 101.8)")
    p.add_argument("--ready-timeout", type=float, default=1200.0)
    p.add_argument("--blas-threads", type=int, default=None, help="OMP/OpenBLAS/MKL threads "
                   "of the server's processes (a shared small machine: 1)")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--work-dir", type=Path, default=None, help="configs, logs, records and "
                   "replay files (default: /tmp/tandem-bench-concurrency/<out-dir name>)")
    p.add_argument("--resume", action="store_true", help="keep runs already in --out-dir "
                   "(with their records in --work-dir): rerun the command after a time limit")
    p.add_argument("--time-budget", type=float, default=None, help="seconds: start no run "
                   "that would end later (a run is taken to last as long as the longest so "
                   "far); the ones left are the summary's 'skipped' (then --resume)")
    p.add_argument("--warm-up-tokens", type=int, default=32,
                   help="tokens of each of the four warm-up requests (each stream starts "
                   "at the first token of the one before: the first must still run then)")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    args.dram_gbs, dram_source = dram_rate(args.dram_gbs)
    arms = arm_order(args)
    for arm in arms:
        arm_speculation(arm, args.proposer)  # refuse an unknown arm before any server
    base = args.base or ("narrow" if "narrow" in arms else arms[0])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    work = args.work_dir or Path(tempfile.gettempdir()) / "tandem-bench-concurrency" / \
        args.out_dir.resolve().name
    work.mkdir(parents=True, exist_ok=True)
    cfg, facts = base_config(args, work)
    needed = pin_placement(cfg, [arm_speculation(a, args.proposer) for a in arms], work)
    workloads = args.workloads.split(",")
    facts["cpu_experts_per_layer"] = replay_split(
        cfg, [work / f"replay_{name}.json" for name in workloads
              if args.proposer == "replay"], needed)
    ctx = {"work": work, "base": cfg, "facts": facts, "machine": machine(), "t0": t0,
           "durations": [], "skipped": []}
    head = {"command": command_line(), "machine": ctx["machine"], **facts,
            "dram_gbs": args.dram_gbs, "dram_source": dram_source,
            "proposer": args.proposer,
            "replay_source": args.replay_source if args.proposer == "replay" else None,
            "skipped": ctx["skipped"]}
    ctx["summary"] = functools.partial(write_summary, args.out_dir, head, workloads, arms, base)
    for name in workloads:
        run_workload(args, ctx, name, arms)
    summary = ctx["summary"]()
    print(table(summary))
    if ctx["skipped"]:
        print(f"skipped (--time-budget {args.time_budget:g} s): {', '.join(ctx['skipped'])}")
    print(f"{time.monotonic() - t0:.0f} s, runs of "
          f"{[round(d['seconds']) for d in ctx['durations']]} s")
    inexact = [f"{name} {arm} pair {i + 1}" for name, e in summary["by_workload"].items()
               for arm, equal in e.get("tokens_equal_plain", {}).items()
               for i, ok in enumerate(equal) if ok is False]
    if inexact:  # every arm must give plain decoding's tokens (exit status 1)
        print(f"not plain decoding's tokens: {', '.join(inexact)}", flush=True)
    return 1 if inexact else 0


if __name__ == "__main__":
    # `timeout` sends SIGTERM: leave through the finally blocks, which stop the server
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())

"""Soak: load, kills and fuzz against one real daemon on 127.0.0.1; prints a table, writes JSON.

    python -m scripts.soak --clients 32 --duration 600 --gpu-kills 5 --cpu-kills 5 \\
        --fuzz-http 10000 --fuzz-zmq 10000 --json docs/bench/soak_cpu.json

Phases: start the daemon (a tiny random model, NumPy, CPU expert placement); each job's
answer alone (the references) and the seeded probe; a warm-up (load, then a little fuzz),
then the daemon's RSS; the load: N clients (half HTTP, half ZeroMQ; streaming or not; random
cancels and disconnects)
while CPU-worker and GPU-worker kills are spread over the time and the probe runs every few
seconds; drain; the fuzz (HTTP bodies and ZeroMQ frames) beside two quiet clients; the probe
again; the end state. Bounded: every phase has a count or a deadline. Exit status 1 when a
check fails. docs/observability.md describes the checks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

from scripts.soak_daemon import CPU_WORKER, GPU_WORKER, Daemon
from scripts.soak_fuzz import fuzz_http, fuzz_zmq, merge_rounds
from scripts.soak_load import Job, Tally, client_loop, http_request, make_jobs, record, references
from scripts.soak_watch import SlotWatch, wait_idle
from scripts.tiny_model import make_tiny_model

PROBE = Job(chat=True, prompt="Tell me about the orchard by the river", max_tokens=24,
            temperature=0.7, seed=1234)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--duration", type=float, default=600.0, help="load phase, seconds")
    p.add_argument("--gpu-kills", type=int, default=5)
    p.add_argument("--cpu-kills", type=int, default=5)
    p.add_argument("--fuzz-http", type=int, default=10000)
    p.add_argument("--fuzz-zmq", type=int, default=10000)
    p.add_argument("--jobs", type=int, default=10, help="distinct seeded requests")
    p.add_argument("--max-tokens", type=int, default=48, help="of each job")
    p.add_argument("--probe-every", type=float, default=10.0, help="seconds")
    p.add_argument("--warmup", type=float, default=30.0, help="seconds of load before RSS")
    p.add_argument("--warmup-fuzz", type=int, default=1000,
                   help="fuzzed HTTP requests and ZeroMQ frames, each, before the RSS baseline")
    p.add_argument("--fuzz-rounds", type=int, default=8,
                   help="the fuzz in this many equal rounds, the daemon's RSS after each")
    p.add_argument("--rss-tolerance", type=float, default=0.10,
                   help="RSS after the load against after the warm-up, and the fuzz rounds' "
                        "last half against their first half")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", type=Path, default=None,
                   help="default: a tiny random qwen3_moe checkpoint written to the workdir "
                        "(the embedded tandem-tiny's experts do not fit the CPU kernels)")
    p.add_argument("--speculation", choices=("off", "narrow", "wide"), default="off",
                   help="[speculation] mode of the daemon; with narrow or wide the references "
                        "opt out of it, so every answer under load must be plain decoding's")
    p.add_argument("--proposer", choices=("suffix", "mtp"), default="suffix",
                   help="draft source (mtp: the default model becomes a qwen3_next with an "
                        "MTP head)")
    p.add_argument("--draft-budget", choices=("fixed", "adaptive"), default="fixed",
                   help="[speculation] draft_budget: adaptive picks each slot's draft length "
                        "a step from its acceptance and the step's predicted cost")
    p.add_argument("--placement", choices=("cpu", "gpu"), default="cpu",
                   help="[experts] placement: cpu (one CPU expert worker, which --cpu-kills "
                        "kill) or gpu (the model worker's own; e.g. the embedded model, whose "
                        "trained MTP head has its drafts accepted)")
    p.add_argument("--prefix-host-mb", type=int, default=0,
                   help="the prefix cache's host tier (MB); with it the GPU tier gets 1 MB and "
                        "the default model GDN states of ~0.8 MB a checkpoint, so checkpoints "
                        "are copied out and back under the load and the kills")
    p.add_argument("--workdir", type=Path, default=None, help="logs and config (default: tmp)")
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    return p.parse_args(argv)


async def _probe(d: Daemon, want, tally: Tally, log: list, when: str) -> None:
    import aiohttp
    async with aiohttp.ClientSession() as session:
        try:
            outcome = await http_request(session, d.url, PROBE, False)
        except Exception as exc:  # any failure to get an answer is recorded
            outcome = ("failed", (False, f"probe {type(exc).__name__}", exc))
    record(tally, outcome, want, f"probe {when}")
    log.append({"when": when, "outcome": outcome[0],
                "identical": outcome[0] == "completed" and outcome[1] == want})


async def _kills(d: Daemon, plan: list[str], until: float, log: list, failed: list) -> None:
    """Spread the kills over the load phase; each waits for the tree to be ready first."""
    start = time.monotonic()
    gap = max(until - start, 1.0) / (len(plan) + 1)
    for k, module in enumerate(plan):
        await asyncio.sleep(max(start + (k + 1) * gap - time.monotonic(), 0.0))
        try:
            await asyncio.to_thread(d.wait_ready, 120)
            restarts, t0 = await asyncio.to_thread(d.restarts), time.monotonic()
            pid = d.kill(module)
            while await asyncio.to_thread(d.restarts) == restarts:  # the daemon noticed
                if time.monotonic() - t0 > 60:
                    raise TimeoutError(f"no restart within 60 s of killing {module}")
                await asyncio.sleep(0.05)
            await asyncio.to_thread(d.wait_ready, 120)
        except Exception as exc:  # recorded: the check counts recovered kills only
            failed.append({"module": module, "error": f"{type(exc).__name__}: {exc}"[:500]})
            continue
        log.append({"module": module, "pid": pid,
                    "seconds_to_ready": round(time.monotonic() - t0, 2),
                    "at_s": round(t0 - start, 1)})


async def _probes(d: Daemon, want, tally: Tally, log: list, until: float, every: float,
                  when: str) -> None:
    while time.monotonic() + every < until:
        await asyncio.sleep(every)
        await _probe(d, want, tally, log, when)


async def _sample_rss(d: Daemon, into: list, t0: float) -> None:
    while d.alive():
        into.append((round(time.monotonic() - t0), round(d.rss_mb(), 1)))
        await asyncio.sleep(5)


async def soak(args: argparse.Namespace, d: Daemon) -> dict:
    out: dict = {"config": {k: str(v) if isinstance(v, Path) else v
                            for k, v in vars(args).items()}}
    jobs = make_jobs(args.seed, args.jobs, args.max_tokens)
    t0 = time.monotonic()
    refs = await references(d.url, d.zmq_address, jobs + [PROBE],
                            plain=args.speculation != "off")
    # drafts proposed while the references ran: none (they opted out: plain decoding's tokens)
    out["reference_drafts"] = d.metric("tandem_spec_draft_tokens_total")
    probe_ref = refs[("http", len(jobs))]
    out["references_s"] = round(time.monotonic() - t0, 1)
    probe_tally, probe_log = Tally(), []
    await _probe(d, probe_ref, probe_tally, probe_log, "before")

    load, watch = Tally(), SlotWatch(d.url)
    watcher = asyncio.create_task(watch.run())
    rss: list = out.setdefault("rss_mb_timeline", [])  # (seconds, MB) every 5 s
    sampler = asyncio.create_task(_sample_rss(d, rss, time.monotonic()))
    clients = lambda until, n, tally, **kw: [  # noqa: E731
        client_loop(i, d.url, d.zmq_address, jobs, refs, until, tally, args.seed, **kw)
        for i in range(n)]
    await asyncio.gather(*clients(time.monotonic() + args.warmup, args.clients, load))
    # the warm-up fuzz: the allocator keeps the high-water mark of multi-MB bodies and frames,
    # so the RSS baseline is taken after some went through (docs/observability.md)
    await asyncio.gather(fuzz_http(d.url, args.warmup_fuzz, args.seed + 3),
                         asyncio.to_thread(fuzz_zmq, d.zmq_address, args.warmup_fuzz,
                                           args.seed + 4))
    out["idle_after_warmup"] = await wait_idle(d.url, 60)
    out["rss_mb_after_warmup"] = round(d.rss_mb(), 1)

    rng = random.Random(args.seed)
    plan = [GPU_WORKER] * args.gpu_kills + [CPU_WORKER] * args.cpu_kills
    rng.shuffle(plan)
    kills: list = []
    out["kills_failed"] = []
    until = time.monotonic() + args.duration
    t_load = time.monotonic()
    await asyncio.gather(*clients(until, args.clients, load),
                         _kills(d, plan, until, kills, out["kills_failed"]),
                         _probes(d, probe_ref, probe_tally, probe_log, until, args.probe_every,
                                 "during load"))
    out["load_s"] = round(time.monotonic() - t_load, 1)
    out["load"], out["kills"] = load.as_dict(), kills
    out["idle_after_load"] = await wait_idle(d.url, 60)
    out["rss_mb_after_load"] = round(d.rss_mb(), 1)

    await asyncio.to_thread(d.wait_ready, 120)
    before = (d.restarts(), d.children())
    bystanders = Tally()
    t_fuzz = time.monotonic()
    fuzz_until = t_fuzz + 3600

    rounds: list = out.setdefault("rss_mb_fuzz_rounds", [])

    async def fuzz() -> tuple[dict, dict]:  # equal rounds, the RSS after each
        nonlocal fuzz_until
        parts: list = []
        k = args.fuzz_rounds
        shares = [(args.fuzz_http // k + (i < args.fuzz_http % k),
                   args.fuzz_zmq // k + (i < args.fuzz_zmq % k)) for i in range(k)]
        try:
            for i, (n_http, n_zmq) in enumerate(shares):
                parts.append(await asyncio.gather(
                    fuzz_http(d.url, n_http, args.seed + 1 + 100 * i),
                    asyncio.to_thread(fuzz_zmq, d.zmq_address, n_zmq, args.seed + 2 + 100 * i)))
                rounds.append(round(d.rss_mb(), 1) if d.alive() else None)
            return merge_rounds([h for h, _ in parts]), merge_rounds([z for _, z in parts])
        finally:
            fuzz_until = 0.0

    async def quiet(i: int) -> None:  # one request at a time, no cancels, until the fuzz ends
        while time.monotonic() < fuzz_until:
            await client_loop(i, d.url, d.zmq_address, jobs, refs, time.monotonic() + 0.1,
                              bystanders, args.seed + 7, p_cancel=0.0, p_leave=0.0)

    async def fuzz_probes() -> None:
        while time.monotonic() < fuzz_until:
            await asyncio.sleep(min(args.probe_every, 2.0))
            if time.monotonic() < fuzz_until:
                await _probe(d, probe_ref, probe_tally, probe_log, "during fuzz")

    (out["fuzz_http"], out["fuzz_zmq"]), *_ = await asyncio.gather(
        fuzz(), quiet(0), quiet(1), fuzz_probes())
    out["fuzz_s"] = round(time.monotonic() - t_fuzz, 1)
    out["bystanders"] = bystanders.as_dict()
    after = (d.restarts(), d.children()) if d.alive() else (None, None)
    out["fuzz_restarts"] = {"before": before[0], "after": after[0],
                            "same_pids": before[1] == after[1]}

    await _probe(d, probe_ref, probe_tally, probe_log, "after")
    watcher.cancel()
    sampler.cancel()
    out["idle_at_end"] = await wait_idle(d.url, 60)
    out["slots_at_end"] = d.get("/v1/slots")[1]
    out["rss_mb_at_end"] = round(d.rss_mb(), 1)
    out["slot_watch"] = watch.as_dict()
    out["probe"] = probe_tally.as_dict() | {"runs": probe_log}
    out["restarts_total"] = d.restarts()
    # the prefix cache's and speculation's counters over the whole run (the daemon's: workers'
    # restarts keep them)
    out["prefix_cache"] = {tier: {"hits": d.metric("tandem_prefix_cache_hits_total", tier=tier),
                                  "entries": d.metric("tandem_prefix_cache_entries", tier=tier)}
                           for tier in ("gpu", "host")}
    out["speculation"] = {"verifies": {src: d.metric("tandem_spec_verifies_total", source=src)
                                       for src in ("suffix", "global_suffix", "mtp")},
                          "drafts": d.metric("tandem_spec_draft_tokens_total"),
                          "accepted": d.metric("tandem_spec_accepted_tokens_total"),
                          # the adaptive budget's choices: verifications by drafts chosen
                          "budget_choices": d.metric_by("tandem_draft_budget_choices_total",
                                                        "drafts")}
    return out


def levels_off(rss: list, tolerance: float) -> bool:
    """Whether RSS readings after equal rounds level off: the last half's highest within
    ``tolerance`` of the first half's. A leak keeps climbing; the allocator's high-water mark
    of the fuzz's multi-MB bodies does not (docs/observability.md). None (a daemon gone):
    no."""
    half = len(rss) // 2
    return half > 0 and None not in rss and max(rss[half:]) <= max(rss[:half]) * (1 + tolerance)


def checks(r: dict, args: argparse.Namespace) -> dict[str, bool]:
    load, by, probe = r["load"], r["bystanders"], r["probe"]
    runs = r["probe"]["runs"]
    rss0, rss1 = r["rss_mb_after_warmup"], r["rss_mb_after_load"]
    tol, rounds = args.rss_tolerance, r["rss_mb_fuzz_rounds"]
    ok = {
        "no lost or duplicated tokens (completed = reference)": load["mismatched"] == 0
        and by["mismatched"] == 0 and probe["mismatched"] == 0 and load["completed"] > 0,
        "probe identical every time it completed": all(
            x["identical"] for x in runs if x["outcome"] == "completed")
        and {"before", "after"} <= {x["when"] for x in runs if x["identical"]},
        "every failed request failed clearly": load["failed_unclear"] == 0
        and by["failed_unclear"] == 0 and probe["failed_unclear"] == 0,
        "kills done and recovered": len(r["kills"]) == args.gpu_kills + args.cpu_kills,
        "no leaked slot": r["idle_after_load"] and r["idle_at_end"],
        "queued never shown as prefilling": r["slot_watch"]["violations"] == 0,
        f"RSS after the load within {tol:.0%} of warm-up": rss1 <= rss0 * (1 + tol),
        f"RSS levels off over the fuzz rounds (last half within {tol:.0%} of first)":
            levels_off(rounds, tol),
        "fuzz: no 5xx but 503": r["fuzz_http"]["server_errors"] == 0,
        "fuzz: every ZeroMQ answer typed": r["fuzz_zmq"]["undecodable_replies"] == 0,
        "fuzz: no daemon or worker restart": r["fuzz_restarts"]["same_pids"]
        and r["fuzz_restarts"]["before"] == r["fuzz_restarts"]["after"],
        "fuzz: other clients unaffected": by["failed_clear"] == {}
        and by["failed_unclear"] == 0 and by["mismatched"] == 0 and by["completed"] > 0,
        "daemon exited cleanly": r.get("exit_code") == 0,
    }
    if args.speculation != "off":  # the answers above are plain decoding's, drafts accepted
        spec = r["speculation"]
        ok[f"{args.speculation} speculation ran ({args.proposer} drafts accepted), "
           "references without drafts"] = (spec["verifies"][args.proposer] > 0
                                            and spec["accepted"] > 0
                                            and r["reference_drafts"] == 0)
    if args.draft_budget == "adaptive":  # main refuses it without speculation
        ok["adaptive budget chose drafts"] = sum(r["speculation"]["budget_choices"].values()) > 0
    if args.prefix_host_mb:  # some of them started from checkpoints copied back from host
        ok["prefix cache host tier served hits"] = r["prefix_cache"]["host"]["hits"] > 0
    return ok


def table(r: dict, ok: dict[str, bool]) -> str:
    load, fh, fz = r["load"], r["fuzz_http"], r["fuzz_zmq"]
    rows = [("load", f"{load['completed']} completed, {load['cancelled']} cancelled, "
                     f"{load['disconnected']} disconnected, failed clearly "
                     f"{sum(load['failed_clear'].values())}, unclearly {load['failed_unclear']}"),
            ("kills", ", ".join(f"{k['module'].split('.')[0]} {k['seconds_to_ready']}s"
                                for k in r["kills"]) or "none"),
            ("probe", f"{sum(x['identical'] for x in r['probe']['runs'])} identical of "
                      f"{len(r['probe']['runs'])} runs"),
            ("fuzz http", f"{fh['sent']} sent: {fh['statuses']}"),
            ("fuzz zmq", f"{fz['sent']} sent: {fz['replies']}"),
            ("bystanders", f"{r['bystanders']['completed']} completed during the fuzz"),
            ("rss MB", f"{r['rss_mb_after_warmup']} after warm-up, {r['rss_mb_after_load']} after "
                       f"the load, {r['rss_mb_fuzz_rounds']} after each fuzz round, "
                       f"{r['rss_mb_at_end']} at end"),
            ("slot watch", str(r["slot_watch"])),
            ("speculation", str(r.get("speculation"))),
            ("prefix cache", str(r.get("prefix_cache")))]
    width = max(len(k) for k in ok)
    lines = [f"{k:<12} {v}" for k, v in rows] + [""]
    lines += [f"{k:<{width}}  {'PASS' if v else 'FAIL'}" for k, v in ok.items()]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tandem-soak-"))
    # a tiny random model by default; qwen3_next with an MTP head for MTP drafts, and with
    # large GDN states for the host tier (a 1 MB GPU tier then keeps about one checkpoint)
    host = args.prefix_host_mb > 0
    arch = "qwen3_next" if args.proposer == "mtp" or host else "qwen3_moe"
    big = {"linear_value_heads": 8, "linear_key_dim": 64, "linear_value_dim": 64} if host else {}
    model = (args.model.resolve() if args.model else
             make_tiny_model(workdir / "model", arch, seed=5, **big))
    scheduler = ({"prefix_cache_max_mb": 1, "prefix_cache_host_mb": args.prefix_host_mb}
                 if host else {})
    # a small global suffix index: full within the warm-up (its ~0.8 kB a token would
    # otherwise grow the RSS past the check's tolerance, bounded but after the baseline), and
    # evicting all through the load
    speculation = (None if args.speculation == "off" else
                   {"mode": args.speculation, "proposer": args.proposer,
                    "global_index_tokens": 2048, "draft_budget": args.draft_budget})
    d = Daemon(workdir, model, max_slots=4, max_queue=max(64, 2 * args.clients),
               speculation=speculation, placement=args.placement, scheduler=scheduler)
    t0 = time.monotonic()
    d.start()
    result: dict = {"startup_s": round(time.monotonic() - t0, 1), "workdir": str(workdir)}
    try:
        result |= asyncio.run(soak(args, d))
    finally:
        result["exit_code"] = d.stop()
    result["checks"] = checks(result, args) if "load" in result else {}
    result["passed"] = bool(result["checks"]) and all(result["checks"].values())
    result["wall_s"] = round(time.monotonic() - t0, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.placement == "gpu" and args.cpu_kills:
        raise SystemExit("--cpu-kills needs --placement cpu (no CPU expert worker otherwise)")
    if args.fuzz_rounds < 2:
        raise SystemExit("--fuzz-rounds needs 2 or more (the RSS check compares their halves)")
    if args.draft_budget == "adaptive" and args.speculation == "off":
        raise SystemExit("--draft-budget adaptive needs --speculation narrow or wide")
    result = run(args)
    print(table(result, result["checks"]))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    # a SIGTERM unwinds like an error: the daemon is stopped, not left behind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())

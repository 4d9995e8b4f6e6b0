"""The draft budget's policies on the synthetic 80B's routing, simulated on the host.

A device run of the concurrency benchmark costs minutes of a lent GPU and its figures carry
the machine's noise (docs/benchmarks.md); this replays the decisions alone. Four streams
decode; each step every slot verifies ``k`` drafts (a fixed policy) or what the adaptive
budget (daemon/draft_stats.DraftBudget, the daemon's own code) chooses. A step's rows route
by the synthetic model's routing (gpu_worker/weights/routing.py: the stream's key and
position, ``--skew``, ``--locality``), the first ``--gpu-experts`` ids of each layer on the
GPU (the bench's split, no hot-expert file), the rest on the CPU. Its time is the cost model

    ms = fixed + row * rows + expert * distinct CPU experts

with constants fitted to the H100 machine's four-stream steps (session 24:
``docs/bench/concurrency_h100/32_essays_fixed_fb60779/``, 1,527-4,562 CPU experts a step),
and each draft is accepted, given the ones before it were, with its position's probability
(``--accept``: that run's replay profile: 0.853 of verifies accepted a first draft, 0.853
a second, 0.608 a third, so 0.853, 1.0 and 0.713 given the drafts before). The budget
learns acceptance, routing and step cost from the simulated steps as it would from the
worker's. Reports tokens per ms per policy and seed, the draft counts chosen, the CPU
experts per token, and (adaptive) how far the budget's predicted union of each step's rows
was from the routed one (``union_error``: mean and spread of predicted / routed - 1)::

    python -m scripts.sim_draft_budget --out docs/bench/draft_budget_sim.json

``--turnover N``: every N steps each slot's request ends and a new one takes the slot (the
slots staggered), as the benchmark's 8 requests pass through its 4 slots: the budget then
chooses for slots it has no routing history of.

``--ramp N``: the streams start one after another (slot s at step s * N), as a benchmark's
do, and the figures count the four-slot steps only; ``--slot-cost`` makes a CPU expert of a
step of fewer slots dearer (a machine's few experts a layer spread worse over its CPU
workers), so the budget's first four-slot choices meet a step cost learned on others.

``--capacity``: a step's rows fit the wide pass's largest capacity (16; the daemon trims
the offered drafts fairly), so four slots verify at most 3 drafts each; ``--capacity 0``
(no limit) is how the rows committed before session 31 ran.

``--paired``: each verify's acceptance drawn from (seed, request, position), as the replay
proposer draws it, so policies that draft alike meet the same luck; every run also reports
``expected_tokens_per_ms``, the chosen drafts' expected tokens (from the rates, not the
draws) per ms: the policies compared without the draws' luck. ``--optimism Z``: the
budget's (daemon/draft_accept.OPTIMISM; 0 chooses on the acceptance means).

What it cannot say: the host time a policy adds (``scripts/bench_draft_budget.py`` times it),
and how a real router's routing differs from the synthetic one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from daemon.config import load_config
from daemon.draft_adaptive import DraftBudget
from daemon.draft_plan import trim_fair
from gpu_worker.weights.routing import RoutingModel, RoutingParams
from protocol.messages import (
    DraftSource,
    Phase,
    PromptPhase,
    SamplingParams,
    SlotResult,
    SlotWork,
    StepPlan,
    StepResult,
    WorkKind,
)
from protocol.worker_config import GRAPH_BUCKETS, WIDE_CAPACITIES, padded_rows
from scripts.bench_common import command_line, machine

SLOTS = 4
WARM_UP = 20  # steps before the figures count (the budget's estimates start from priors)


class Routing:
    """CPU experts of a step's rows (global ids: layer * experts + expert)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.model = RoutingModel(args.experts, args.topk,
                                  RoutingParams(args.skew, args.locality), seed=args.seed)
        self.layers, self.experts = args.layers, args.experts
        self.on_cpu = np.ones((args.layers, args.experts), bool)
        self.on_cpu[:, :args.gpu_experts] = False
        self.universe = int(self.on_cpu.sum())

    def cpu_ids(self, keys: np.ndarray, positions: np.ndarray) -> list[np.ndarray]:
        """Per row: its CPU experts' global ids over every layer."""
        ids = self.model.choose_layers(np.arange(self.layers), keys, positions)  # [L, R, k]
        glob = np.arange(self.layers)[:, None, None] * self.experts + ids
        cpu = np.take_along_axis(self.on_cpu[:, None, :], ids, axis=2)
        return [glob[:, r][cpu[:, r]] for r in range(len(keys))]


def simulate(policy: str, args: argparse.Namespace, seed: int) -> dict:
    """``steps`` steps of four streams under ``policy`` ("0".."N": fixed drafts a slot, or
    "adaptive"), the first ``WARM_UP`` left out of the figures."""
    rng = np.random.default_rng(seed)  # acceptance
    jitter = np.random.default_rng([seed, 1])  # step times (apart: the same drafts accepted)
    routing = Routing(args)
    accept = np.array(args.accept)
    spread = np.random.default_rng([seed, 2])  # each request's own acceptance
    shift = np.zeros(SLOTS)  # a slot's request: its acceptance's shift (--request-spread)
    if args.request_spread:
        shift = spread.normal(0.0, args.request_spread, SLOTS)
    spec = load_config(None, {"speculation.mode": "wide",
                              "speculation.draft_budget": "adaptive"}).speculation
    budget = DraftBudget(spec)
    if args.padded and not args.pad_unaware:  # as READY's ModelInfo.padded_passes tells it
        budget.pad_to = GRAPH_BUCKETS
    budget.accept.fixed_weight = args.request_weight
    if args.optimism is not None:
        budget.optimism = args.optimism
    keys = (np.arange(SLOTS) + 1) * 7919 + seed * 104729
    pos = 40 + 5 * np.arange(SLOTS)
    most = len(accept)
    time_ms = tokens = experts = mean_tokens = 0.0
    chosen = np.zeros(most + 1, np.int64)
    union_error: list[float] = []  # adaptive: the budget's predicted union / the routed one
    mixed = 0  # steps whose slots verified different draft counts
    gen = np.zeros(SLOTS, np.int64)
    # --ramp: slot s joins at step s * ramp; the figures count the four-slot steps only
    first = max(WARM_UP, (SLOTS - 1) * args.ramp)
    for step in range(args.steps):
        live = min(SLOTS, step // args.ramp + 1) if args.ramp else SLOTS
        for s in range(SLOTS):  # --turnover: a slot's request ends, a new one takes it
            if args.turnover and step and (step + s * args.turnover // SLOTS) % args.turnover == 0:
                gen[s] += 1
                keys[s] = (keys[s] * 31 + 7 + seed) % (2**31 - 1)
                if args.request_spread:
                    shift[s] = spread.normal(0.0, args.request_spread)
                pos[s] = 40 + 5 * s
        predicted, routes = None, True
        # the drafts a step can verify: the wide pass's rows fit its largest capacity
        # (daemon/draft_plan.DraftPlanner.fit; four slots of 4 drafts are cut to 3 each)
        offer = (trim_fair([most] * live, args.capacity - live) if args.capacity
                 else [most] * live)
        if policy == "adaptive":
            work = slot_work(pos, most, gen)[:live]
            drafts = budget.choose(work, offer, True)
            # the chosen pass's expected CPU experts (None: a kept choice, no forecast)
            predicted = budget.forecast[0] if budget.forecast is not None else None
            routes = budget.wants_routes()  # the slots' CPU experts, as the worker sends
            if not args.no_between:  # while the step runs, as the daemon calls it
                budget.between_steps()
        else:
            drafts = [min(int(policy), n) for n in offer]
        rows = [1 + k for k in drafts]
        per_row = routing.cpu_ids(np.repeat(keys[:live], rows),
                                  np.concatenate([pos[s] + np.arange(n)
                                                  for s, n in enumerate(rows)]))
        union = len(np.unique(np.concatenate(per_row)))
        # the worker's CPU expert time (a step of fewer slots: dearer experts, --slot-cost)
        cpu_ms = args.expert_ms * args.slot_cost[live - 1] * union
        run = padded_rows(sum(rows)) if args.padded else sum(rows)  # the rows the pass runs
        ms = args.fixed_ms + args.row_ms * run + cpu_ms
        if args.noise:  # the machine's jitter: the budget fits noisy times, figures count them
            factor = max(1.0 + args.noise * jitter.standard_normal(), 0.5)
            ms, cpu_ms = ms * factor, cpu_ms * factor
        accepted, expected = [], np.zeros(live)
        for s, k in enumerate(drafts):  # each slot's request at its own rates
            own = np.clip(accept + shift[s], 0.02, 0.99) if args.request_spread else accept
            # --paired: the draws of (seed, slot's request, position), as the replay
            # proposer's, so every policy meets the same luck where it drafts alike
            draws = (np.random.default_rng([seed, 3, s, int(gen[s]), int(pos[s])]).random(k)
                     if args.paired else None)
            a = 0
            while a < k and (draws[a] if args.paired else rng.random()) < own[a]:
                a += 1
            accepted.append(a)
            expected[s] = 1.0 + float(np.cumprod(own[:k]).sum())  # the tokens' mean
        if step >= first:
            if predicted is not None:
                union_error.append(predicted / union - 1.0)
            time_ms += ms
            tokens += live + sum(accepted)
            mean_tokens += expected.sum()
            experts += union
            np.add.at(chosen, drafts, 1)
            mixed += len(set(drafts)) > 1
        if policy == "adaptive":  # the budget learns from the step as from the worker's
            budget.observe(*step_record(step, work, drafts, accepted, per_row, union,
                                        routing.universe, 0.0 if args.no_cpu_time else cpu_ms,
                                        routes, run - sum(rows)), ms / 1e3)
        pos[:live] += 1 + np.array(accepted)
    counted = args.steps - first
    return {"policy": policy, "seed": seed, "tokens_per_ms": tokens / time_ms,
            # the drafts' expected tokens (the acceptance rates, not the draws) per ms: the
            # policies compared without the draws' luck
            "expected_tokens_per_ms": mean_tokens / time_ms,
            "tokens_per_step": tokens / counted,
            "cpu_experts_per_step": experts / counted,
            "cpu_experts_per_token": experts / tokens, "drafts_chosen": chosen.tolist(),
            "mixed_steps": mixed / counted,
            "union_error": ({"mean": float(np.mean(union_error)),
                             "std": float(np.std(union_error))} if union_error else None)}


def slot_work(pos: np.ndarray, most: int, gen: np.ndarray | None = None) -> list[SlotWork]:
    """The four decode slots at positions ``pos``, each offering ``most`` MTP drafts
    (``gen``: each slot's request, by how many ended there before it)."""
    gen = np.zeros(SLOTS, np.int64) if gen is None else gen
    return [SlotWork(slot=s, request_id=f"r{s}" + (f".{gen[s]}" if gen[s] else ""),
                     kind=WorkKind.DECODE,
                     input_ids=np.array([5]), start_pos=int(pos[s]), num_tokens=1,
                     needs_logits=True, sampling=SamplingParams(temperature=0.0, seed=1),
                     draft_ids=np.arange(1, most + 1),
                     draft_sources=np.full(most, int(DraftSource.MTP)), prompt_len=30)
            for s in range(SLOTS)]


def step_record(step: int, work: list[SlotWork], drafts: list[int], accepted: list[int],
                per_row: list[np.ndarray], union: int, universe: int, cpu_ms: float = 0.0,
                routes: bool = True, padding: int = 0) -> tuple[StepPlan, StepResult]:
    """The simulated step as the daemon sees a real one: its plan (the chosen drafts) and
    the worker's result (accepted drafts, each slot's CPU experts where ``routes``: the
    plan asked for them, and the step's counters: ``padding`` rows the pass ran past its
    own)."""
    first = np.cumsum([0] + [1 + k for k in drafts])
    results = []
    for s, a in enumerate(accepted):
        ids, counts = np.unique(np.concatenate(per_row[first[s]:first[s + 1]]),
                                return_counts=True)
        if not routes:
            ids, counts = ids[:0], counts[:0]
        results.append(SlotResult(
            slot=s, request_id=work[s].request_id, token_ids=[5] * (1 + a), num_accepted=a,
            prompt=PromptPhase(phase=Phase.DECODE, prompt_tokens_this_step=0, prompt_len=30,
                               cached_len=0),
            cpu_experts=ids.astype(np.int32), cpu_expert_rows=counts.astype(np.uint16)))
    plan = StepPlan(step_id=step + 1, slot_routing=routes, slots=[
        dataclasses.replace(w, draft_ids=w.draft_ids[:k], draft_sources=w.draft_sources[:k])
        for w, k in zip(work, drafts, strict=True)])
    counters = {"passes": 1, "cpu_experts": union, "cpu_experts_held": universe,
                "padding_rows": padding}
    return plan, StepResult(step_id=step + 1, slots=results, counters=counters,
                            timings_ms={"cpu_experts": cpu_ms} if cpu_ms else {})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default="1,2,3,adaptive")
    p.add_argument("--seeds", default="0,1,2,3")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--turnover", type=int, default=0,
                   help="a slot's request ends every this many steps (staggered over the "
                   "slots) and a new one (another routing key, no history) takes the slot; "
                   "0: the same four requests throughout")
    p.add_argument("--ramp", type=int, default=0,
                   help="slot s joins at step s * RAMP, as a benchmark's streams start one after "
                   "another; the figures count the four-slot steps (0: four from the start)")
    p.add_argument("--slot-cost", type=lambda s: [float(x) for x in s.split(",")],
                   default=[1.0] * SLOTS,
                   help="a CPU expert's cost in steps of 1..4 slots, times --expert-ms (an H100 "
                   "machine's first runs in session 30: about 1.4,1.35,1.15,1)")
    p.add_argument("--accept", type=lambda s: [float(x) for x in s.split(",")],
                   default=[0.853, 1.0, 0.713],
                   help="acceptance per draft position, given the drafts before it were")
    p.add_argument("--request-spread", type=float, default=0.0,
                   help="each request's acceptance shifted by a normal draw of this standard "
                   "deviation at every position (0: every request accepts alike)")
    p.add_argument("--request-weight", type=float, default=None,
                   help="trials a request's acceptance leans on its source's, fixed (default: "
                   "by the requests' spread, daemon/draft_accept.request_weight)")
    p.add_argument("--paired", action="store_true",
                   help="acceptance drawn per (seed, request, position), as the replay proposer "
                   "draws it, so the policies meet the same luck (default: one stream of draws "
                   "per run, as the rows committed before session 31)")
    p.add_argument("--capacity", type=int, default=WIDE_CAPACITIES[-1],
                   help="rows a step verifies at most, the drafts trimmed fairly to fit, as the "
                   "daemon does (0: no limit, as the rows committed before session 31)")
    p.add_argument("--optimism", type=float, default=None,
                   help="standard deviations the budget raises its sources' acceptance by "
                   "(default: the daemon's, daemon/draft_accept.OPTIMISM; 0: the means)")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=512)
    p.add_argument("--topk", type=int, default=10)
    p.add_argument("--gpu-experts", type=int, default=45)
    p.add_argument("--skew", type=float, default=0.66)
    p.add_argument("--locality", type=float, default=0.12)
    p.add_argument("--seed", type=int, default=0, help="the routing model's")
    p.add_argument("--fixed-ms", type=float, default=3.0)
    p.add_argument("--row-ms", type=float, default=0.25)
    p.add_argument("--expert-ms", type=float, default=0.034)
    p.add_argument("--noise", type=float, default=0.0,
                   help="relative standard deviation of a step's time (0: none)")
    p.add_argument("--no-cpu-time", action="store_true",
                   help="the worker reports no CPU expert time: the budget fits an expert's "
                   "cost from the step times alone")
    p.add_argument("--padded", action="store_true",
                   help="a step's pass runs padded up to its graph bucket (the worker's CUDA "
                   "graphs in capacity buckets): 13-16 rows cost what 16 do, and the budget "
                   "is told so (READY's ModelInfo.padded_passes)")
    p.add_argument("--pad-unaware", action="store_true",
                   help="with --padded: the budget is not told (its cost counts a pass's own "
                   "rows, as before session 33)")
    p.add_argument("--no-between", action="store_true",
                   help="no DraftBudget.between_steps while a step runs (the daemon calls "
                   "it): every choice made in choose itself")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.steps <= max(WARM_UP, (SLOTS - 1) * args.ramp):
        p.error(f"--steps must be > {WARM_UP} and > {SLOTS - 1} x --ramp")
    if args.capacity < 0 or 0 < args.capacity < SLOTS:
        p.error(f"--capacity must be 0 (no limit) or at least {SLOTS} rows")
    if args.ramp < 0 or len(args.slot_cost) != SLOTS or min(args.slot_cost) <= 0:
        p.error(f"--ramp must be >= 0 and --slot-cost {SLOTS} numbers > 0")
    for policy in args.policies.split(","):
        if policy != "adaptive" and not (policy.isdigit() and int(policy) <= len(args.accept)):
            p.error(f"policy {policy!r}: 'adaptive' or a draft count 0..{len(args.accept)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = [simulate(policy, args, int(seed)) for policy in args.policies.split(",")
            for seed in args.seeds.split(",")]
    for r in runs:
        print(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in r.items()}))
    means, expected = (_by_policy(runs, "tokens_per_ms"),
                       _by_policy(runs, "expected_tokens_per_ms"))
    print(json.dumps({"mean_tokens_per_ms": {k: round(v, 5) for k, v in means.items()},
                      "mean_expected_tokens_per_ms": {k: round(v, 5)
                                                      for k, v in expected.items()}}))
    if args.out:
        args.out.write_text(json.dumps({"machine": machine(), "command": command_line(),
                                        "args": vars(args) | {"out": None},
                                        "mean_tokens_per_ms": means,
                                        "mean_expected_tokens_per_ms": expected,
                                        "runs": runs}, indent=1) + "\n")
    return 0


def _by_policy(runs: list[dict], field: str) -> dict[str, float]:
    """Each policy's mean of ``field`` over its runs (seeds)."""
    values: dict[str, list[float]] = {}
    for r in runs:
        values.setdefault(r["policy"], []).append(r[field])
    return {k: float(np.mean(v)) for k, v in values.items()}


if __name__ == "__main__":
    raise SystemExit(main())

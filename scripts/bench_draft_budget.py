"""Host time of the adaptive draft budget's bookkeeping per step, at a real model's shape.

Between one step's result and the next step's plan, the adaptive budget (``draft_budget =
"adaptive"``) runs on the critical path: the worker's ``ExpertCounters.take_slot_experts``
(each decode slot's distinct CPU experts; NumPy part, or with ``--device`` the route
buffers on the GPU, packed and copied as on the launched path), then the daemon's
``RoutingStats.observe`` of each slot's experts (``observe_ms``, all slots) and
``DraftBudget.choose`` (routing patterns and the choice of lengths). This times them for
``--slots`` slots of ``--rows`` rows each on the synthetic 80B's routed layers (random
routing of top-k over E experts, ``--cpu`` of them per layer on the CPU), medians of
``--reps`` steps, and apart (``between_steps_ms``, a mean) what ``DraftBudget.between_steps``
does while a step runs (the next fresh choice: off the critical path). The steps that read
routes are timed apart (``take_read_ms``; with the choice kept most steps read none), with
the part of it that packs the layers' route buffers and copies them to the host
(``take_copy_ms``, gpu_worker/kernels/route_pack.py; the rest is the NumPy sort into
per-slot experts)::

    python -m scripts.bench_draft_budget --out docs/bench/draft_budget_host_devvm.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from unittest import mock

import numpy as np

from daemon.config import load_config
from daemon.draft_adaptive import DraftBudget
from gpu_worker.experts import counters as counters_module
from gpu_worker.experts.counters import ExpertCounters
from protocol.messages import DraftSource, SamplingParams, SlotWork, WorkKind
from scripts.bench_common import command_line, machine


def _route(counters: ExpertCounters, rng: np.random.Generator, args: argparse.Namespace,
           xp=np) -> None:
    """One pass's routing, as the forward records it layer by layer (``xp``: where the
    route buffers live: NumPy, or CuPy as on the launched path)."""
    rows = args.slots * args.rows
    counters.track_rows(np.repeat(np.arange(args.slots), args.rows))
    for layer in range(args.layers):
        ids = np.argsort(rng.random((rows, args.experts)), axis=1)[:, :args.topk]
        counters.add_routes(layer, args.experts, xp.asarray(ids.astype(np.int32)),
                            xp.asarray(ids >= args.experts - args.cpu))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--rows", type=int, default=4, help="rows a slot ran last step")
    p.add_argument("--drafts", type=int, default=3, help="fitted drafts a slot offers")
    p.add_argument("--layers", type=int, default=49, help="routed layers (80B: 48 + MTP)")
    p.add_argument("--experts", type=int, default=512)
    p.add_argument("--topk", type=int, default=10)
    p.add_argument("--cpu", type=int, default=467, help="CPU experts per layer")
    p.add_argument("--reps", type=int, default=32)
    p.add_argument("--no-reuse", action="store_true",
                   help="choose afresh every step, from every step's routes (DraftBudget.reuse)")
    p.add_argument("--device", action="store_true",
                   help="route buffers on the GPU (CuPy), as the launched path keeps them: "
                   "take_slot_experts then includes their packing and copy to the host")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    xp = np
    if args.device:
        import cupy as xp  # noqa: PLC0415 (a GPU machine's)

    rng = np.random.default_rng(0)
    counters = ExpertCounters(1.0)
    budget = DraftBudget(load_config(None, {"speculation.mode": "wide",
                                            "speculation.draft_budget": "adaptive"}).speculation)
    universe = args.layers * args.cpu
    work = [SlotWork(slot=s, request_id=f"r{s}", kind=WorkKind.DECODE, input_ids=np.array([5]),
                     start_pos=100, num_tokens=1, needs_logits=True,
                     sampling=SamplingParams(temperature=0.0, seed=1),
                     draft_ids=np.arange(1, args.drafts + 1),
                     draft_sources=np.full(args.drafts, int(DraftSource.MTP)), prompt_len=50)
            for s in range(args.slots)]
    budget.reuse = not args.no_reuse
    take, observe, choose, read, between = [], [], [], [], []
    copies: list[float] = []  # per step: the packing and host copies of take_slot_experts
    packed_runs = counters_module._packed_runs

    def timed_pack(routes: list) -> list:
        t = time.perf_counter()
        out = packed_runs(routes)
        copies[-1] += time.perf_counter() - t
        return out

    asked = True  # the plan's StepPlan.slot_routing (the budget's wants_routes)
    seen: dict = {}
    with mock.patch.object(counters_module, "_packed_runs", timed_pack):
        for step in range(args.reps + 2):  # two steps of history first
            _route(counters, rng, args, xp)
            if args.device:  # the forward's work done, as when the worker takes them
                xp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            copies.append(0.0)
            routes = counters.take_slot_experts(asked)
            read.append(asked)
            seen = routes or seen  # the last routes read
            t1 = time.perf_counter()
            for s, (ids, rows) in routes.items():
                budget.routing.observe(f"r{s}", args.rows, ids.astype(np.int64), rows, universe,
                                       step - 1 if budget.reuse else None)
            budget._steps = step  # the steps observed (DraftBudget.observe counts them)
            t2 = time.perf_counter()
            counts = budget.choose(work, [args.drafts] * args.slots, True)
            asked = budget.wants_routes()
            t3 = time.perf_counter()
            budget.between_steps()  # while the step runs: off its critical path
            between.append(time.perf_counter() - t3)
            take.append(t1 - t0)
            observe.append(t2 - t1)
            choose.append(t3 - t2)
    record = {
        "machine": machine(), "command": command_line(), "args": vars(args) | {"out": None},
        "take_slot_experts_ms": round(float(np.median(take[2:])) * 1e3, 3),
        "observe_ms": round(float(np.median(observe[2:])) * 1e3, 3),
        "choose_ms": round(float(np.median(choose[2:])) * 1e3, 3),
        # the mean over steps: with the choice kept (not --no-reuse), most steps read no
        # routes and choose nothing new, so the medians above are those steps'
        "per_step_ms": round(float(np.mean(np.add(np.add(take, observe), choose)[2:])) * 1e3,
                             3),
        # DraftBudget.between_steps, the mean over steps: run while a step runs (the next
        # fresh choice made there), not part of per_step_ms
        "between_steps_ms": round(float(np.mean(between[2:])) * 1e3, 3),
        "routes_read": f"{sum(read[2:])} of {len(read) - 2} steps",
        # the steps that read routes (the medians above are mostly the others'): the whole
        # take_slot_experts, and its part packing the layers and copying them to the host
        "take_read_ms": _median_ms(take, read),
        "take_copy_ms": _median_ms(copies, read),
        "experts_per_slot": {int(s): len(v[0]) for s, v in seen.items()},
        "chosen": counts,
    }
    print(json.dumps({k: record[k] for k in ("take_slot_experts_ms", "observe_ms", "choose_ms",
                                              "per_step_ms", "between_steps_ms",
                                              "take_read_ms", "take_copy_ms", "chosen")}))
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


def _median_ms(seconds: list[float], read: list[bool]) -> float | None:
    """The median in ms of ``seconds`` over the steps (past the first two) that read routes."""
    picked = [t for t, r in zip(seconds[2:], read[2:], strict=True) if r]
    return round(float(np.median(picked)) * 1e3, 3) if picked else None


if __name__ == "__main__":
    raise SystemExit(main())

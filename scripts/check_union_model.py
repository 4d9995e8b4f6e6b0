"""How well the adaptive budget predicts the distinct CPU experts of a step's rows.

The draft budget (daemon/draft_stats.py, docs/speculation.md) chooses draft lengths by the
union of CPU experts a step's rows will touch, predicted from each slot's last routing. This
checks the prediction on the synthetic 80B's routing (the routing of
``scripts/sim_draft_budget.py``): four decode streams verify ``--drafts`` drafts a slot every
step, the budget learns from each step as from the worker's, and at each step after the
warm-up both the predicted union and the routed one (the routing model is a pure function of
stream and position, so the same step's rows can be routed for any draft count) are taken for
0..3 drafts a slot. Reported: their means per draft count and the growth from one draft count
to the next, what a draft row costs and where the choice is made::

    python -m scripts.check_union_model --out docs/bench/draft_budget_union.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from daemon import draft_budget
from daemon.config import load_config
from daemon.draft_adaptive import DraftBudget
from daemon.draft_stats import RoutingStats
from scripts.bench_common import command_line, machine
from scripts.sim_draft_budget import SLOTS, WARM_UP, Routing, slot_work, step_record
from scripts.sim_draft_budget import parse_args as sim_args

MOST = 3  # draft counts 0..MOST a slot


def check(args: argparse.Namespace) -> dict:
    routing = Routing(args)
    spec = load_config(None, {"speculation.mode": "wide",
                              "speculation.draft_budget": "adaptive"}).speculation
    budget = DraftBudget(spec)
    # each step predicted from the step before it: the persistence of routes one step apart
    # (the budget's own choices start from routes two steps old: daemon/draft_adaptive.py)
    budget.routing = RoutingStats(gap=1)
    rng = np.random.default_rng(args.seed)
    keys = (np.arange(SLOTS) + 1) * 7919
    pos = 40 + 5 * np.arange(SLOTS)
    predicted = np.zeros((args.steps - WARM_UP, MOST + 1))
    routed = np.zeros_like(predicted)
    for step in range(args.steps):
        work = slot_work(pos, MOST)
        log_miss, weight = budget.routing.patterns([w.request_id for w in work])
        for k in range(MOST + 1):
            rows = np.full((1, SLOTS), 1 + k)
            if step >= WARM_UP:
                fresh = draft_budget.fresh_rows(rows, budget.routing.locality)
                predicted[step - WARM_UP, k] = draft_budget.expected_union(fresh, log_miss,
                                                                           weight)[0]
                routed[step - WARM_UP, k] = len(np.unique(np.concatenate(
                    routing.cpu_ids(np.repeat(keys, 1 + k), _positions(pos, 1 + k)))))
        drafts = [args.drafts] * SLOTS
        per_row = routing.cpu_ids(np.repeat(keys, 1 + args.drafts),
                                  _positions(pos, 1 + args.drafts))
        union = len(np.unique(np.concatenate(per_row)))
        accepted = []
        for _ in range(SLOTS):
            a = 0
            while a < args.drafts and rng.random() < args.accept[a]:
                a += 1
            accepted.append(a)
        budget.observe(*step_record(step, work, drafts, accepted, per_row, union,
                                    routing.universe), 0.1)
        budget.settle()  # its routes into the estimates (choose would, first)
        pos = pos + 1 + np.array(accepted)
    p, r = predicted.mean(axis=0), routed.mean(axis=0)
    return {"drafts_per_slot": list(range(MOST + 1)), "predicted": p.tolist(),
            "routed": r.tolist(), "predicted_growth": np.diff(p).tolist(),
            "routed_growth": np.diff(r).tolist(),
            "growth_error": (np.diff(p) / np.diff(r) - 1.0).tolist(),
            "learned": {"persistence": budget.routing.persistence,
                        "locality": budget.routing.locality,
                        "effective_experts": budget.routing.effective}}


def _positions(pos: np.ndarray, rows: int) -> np.ndarray:
    return np.concatenate([p + np.arange(rows) for p in pos])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafts", type=int, default=2, help="drafts a slot verifies each step")
    p.add_argument("--out", type=Path, default=None)
    own, rest = p.parse_known_args(argv)
    args = sim_args(rest + ["--steps", "300"] if "--steps" not in rest else rest)
    args.drafts = own.drafts
    if not 0 <= own.drafts <= min(MOST, len(args.accept)):
        p.error(f"--drafts must be in 0..{min(MOST, len(args.accept))}")
    result = check(args)
    print(json.dumps(result))
    if own.out:
        own.out.write_text(json.dumps({"machine": machine(), "command": command_line(),
                                       "args": vars(args) | {"out": None}, **result},
                                      indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``DraftBudget``: the adaptive draft budget (``draft_budget = "adaptive"``), which
daemon/draft_plan.py asks after trimming and tells every step's result; its estimates live
in daemon/draft_stats.py (routing), draft_accept.py (acceptance) and draft_cost.py (step
cost), the choice in daemon/draft_budget.py.

A choice serves a few steps. While a step's slots, their kinds and their offered drafts stay
those of the last choice and no slot's acceptance estimate moved by more than
``ACCEPT_TOLERANCE`` (a request's first verifies move it most), the budget keeps that choice
for up to ``REUSE_STEPS`` steps, then chooses again. Reading a step's routes costs the
worker a copy and a sort, and the choice its routing patterns: a few ms of a four-stream
step in all, while the choice moves slowly (acceptance and routing are averages over many
steps). So the worker reports the slots' CPU experts (``StepPlan.slot_routing``) only on a
step whose slots changed and on the second and fourth step before the next choice: a choice
starts from the slots' routes of the step ``ROUTES_AHEAD`` (2) before the step it is for,
and the persistence (how far a slot's experts recur) is learned from routes as far apart. A
choice whose slots have no such routes (the slots changed) is made again two steps later,
from the changed step's routes. The experts' shares fade per step, not per step read
(RoutingStats.observe's ``step``).

Off the step's critical path. The daemon waits for each step's result while the GPU and the
CPU experts work, and calls :meth:`DraftBudget.between_steps` in that wait
(daemon/draft_plan.overlapped): there the last step's routes and time are taken into the
estimates (:meth:`DraftBudget.observe` keeps them for it and takes in only the acceptance,
which the next choice reads), and where the next step would choose afresh, its choice is
made there, for the slots and offers of the step running: the next :meth:`choose` takes it
when its slots and offers are those and no acceptance moved by more than the tolerance,
else chooses on the spot. That is why a choice starts from routes two steps old, and why
:meth:`choose` takes in only the steps before the last one (the last one's routes and time
are taken in while the next step runs). On an H100 machine the fresh choices and the route
reading took 1-2 ms of every four-stream step, about 1 % of it (session 28's step traces).
Without the calls (tests, the simulation with ``--no-between``), :meth:`choose` takes the
same steps in and chooses from the same routes, on the spot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from daemon.draft_accept import MAX_POSITIONS, OPTIMISM, REQUEST_PRIOR_TRIALS, AcceptanceStats
from daemon.draft_budget import (
    BudgetProblem,
    StepCost,
    choose,
    expected_union,
    fresh_rows,
    ratio,
)
from daemon.draft_cost import CostFit
from daemon.draft_stats import EMA, RoutingStats
from protocol.messages import SlotWork, StepPlan, StepResult, WorkKind
from protocol.worker_config import padded_rows

if TYPE_CHECKING:
    from daemon.config import SpeculationSection

# a step's counters (gpu_worker/step_graph.py) that mark its time as not its layout's cost
ONE_OFF_COUNTERS = ("graph_captures", "graph_first_runs", "graph_refused")
# a slot whose drafts the budget cut short of its offer this many steps running verifies one
# more (a probe): one without drafts always (its text may have turned predictable), one with
# drafts while its source has fewer than PROBE_TRIALS verifies that reached the position
# after them (an estimate the choice stopped measuring would otherwise stay where a few
# early misses left it; once measured, the source's estimate there stands)
PROBE_STEPS = 8
PROBE_TRIALS = 32
UNIFORM = 4  # the alternatives of ``DraftBudget.uniform``
# a choice starts from the routes of this many steps before the step it is for (the module
# doc), and the persistence is learned from routes as far apart
ROUTES_AHEAD = 2
REUSE_STEPS = 8  # steps one choice serves while the step's slots and offers stay the same
ACCEPT_TOLERANCE = 0.1  # ... and no slot's acceptance at any position moved more than this


class DraftBudget:
    """The adaptive budget of daemon/draft_plan.DraftPlanner (``draft_budget = "adaptive"``)."""

    def __init__(self, spec: SpeculationSection) -> None:
        self.accept = AcceptanceStats()
        self.routing = RoutingStats(gap=ROUTES_AHEAD)
        self.costs = CostFit(StepCost(spec.cost_fixed_ms, spec.cost_row_ms,
                                      spec.cost_expert_ms))
        self.fit_costs = True  # False: the config's constants only (tests)
        self.reuse = True  # False: choose afresh every step, from every step's routes
        self.optimism = OPTIMISM  # the choice's (daemon/draft_accept.py); 0: the means (tests)
        # rows the worker pads a decode-only pass up to (READY's ModelInfo.padded_passes:
        # protocol.worker_config.GRAPH_BUCKETS; () unpadded): the step cost's rows
        self.pad_to: tuple[int, ...] = ()
        self._short: dict[str, int] = {}  # request -> steps running its drafts were cut
        self.chosen = np.zeros(MAX_POSITIONS + 1, np.int64)  # drafted slots by drafts chosen
        self._slots: int | None = None  # the last step's, chosen for
        self._steps = 0  # steps observed
        # the choice kept (module doc): what it was made for, its lengths, the steps it served
        # (including the one it was made for), whether the slots had changed
        self._key: tuple | None = None
        self._kept: list[int] = []
        self._rates = np.zeros((0, MAX_POSITIONS))  # the slots' acceptance it was made with
        self._age = 0
        self._changed = True
        # the last choice's expected CPU experts and ms (a wide pass; None once observed or
        # without one), and the average
        # relative error of such forecasts against the steps' own (union, step time)
        self.forecast: tuple[float, float] | None = None
        self.errors = np.zeros(2)
        # what the choices thought of the plain alternatives: every drafted slot at k drafts
        # (at most its offer), k = 1..UNIFORM, predicted tokens per ms over the chosen
        # lengths', averaged over the wide choices (a figure: how near the choice was)
        self.uniform: np.ndarray | None = None
        # the last choose(): fresh or kept, the counts offered and chosen, a fresh wide
        # choice's forecast and uniform ratios (daemon/step_trace.py; benchmarks)
        self.last: dict | None = None
        # steps observed but not yet taken into the routing and cost estimates (settle)
        self._pending: list[tuple] = []
        self._asked: tuple | None = None  # the last choose()'s (work, counts, wide)
        self._ready: dict | None = None  # a choice made between steps (between_steps)

    def choose(self, work: list[SlotWork], counts: list[int], wide: bool) -> list[int]:
        """Draft counts (each <= ``counts``, the trimmed ones) for ``work``'s slots."""
        # the steps before the last: the last step's routes and time are not the choice's
        # (its routes are two steps old), and taking them in is between_steps' work
        self.settle(but_last=True)
        live = {w.request_id for w in work}
        self.accept.keep(live)
        self.routing.keep(live)
        self._short = {r: n for r, n in self._short.items() if r in live}
        self.last = None
        if not any(counts):  # nothing to choose; the next choice is made afresh
            self._key, self._changed = None, True
            return list(counts)
        key = (wide, *((w.request_id, int(w.kind), n) for w, n in zip(work, counts,
                                                                       strict=True)))
        self.forecast = None
        rate = self._rates_of(work, counts)
        ready, self._ready = self._ready, None
        self._asked = (work, list(counts), wide)
        if (self.reuse and key == self._key and self._age < REUSE_STEPS
                and _near(rate, self._rates, counts)):
            out = list(self._kept)
            self._age += 1
            self._changed = False
            self.last = {"fresh": False}
        else:
            if ready is None or ready["key"] != key or not _near(rate, ready["rates"], counts):
                # (the step chosen for is self._steps)
                ready = self._solve(work, counts, rate, wide, self._steps - ROUTES_AHEAD)
                ready["key"] = key
            out = ready["out"]
            self.forecast, self.last = ready["forecast"], {"fresh": True, **ready["last"]}
            self._changed = key != self._key
            self._key, self._kept, self._rates = key, list(out), rate
            # no history: again two steps later, from this step's routes (wants_routes)
            self._age = 1 if ready["history"] else REUSE_STEPS - 1
        for i, (w, n) in enumerate(zip(work, counts, strict=True)):
            if out[i] < n:
                short = self._short.get(w.request_id, 0) + 1
                if short >= PROBE_STEPS and (not out[i] or self.accept.trials(
                        int(w.draft_sources[0]), out[i]) < PROBE_TRIALS):
                    out[i], short = out[i] + 1, 0  # a probe of the position after them
                self._short[w.request_id] = short
            else:
                self._short.pop(w.request_id, None)
            if n:
                self.chosen[min(out[i], MAX_POSITIONS)] += 1
        self.last.update(offered=list(counts), chosen=list(out))
        return out

    def wants_routes(self) -> bool:
        """Whether the step just chosen for should report its slots' CPU experts (the
        module doc): the second and fourth step before the next choice, or where the slots
        changed."""
        return not self.reuse or self._changed or self._age in (
            REUSE_STEPS - ROUTES_AHEAD - 1, REUSE_STEPS - 1)

    def between_steps(self) -> None:
        """While a step runs (the module doc): the kept steps into the estimates, and the
        next step's choice where it would be made afresh."""
        self.settle()
        if not (self.reuse and self._key is not None and self._age >= REUSE_STEPS
                and self._asked is not None and self._ready is None):
            return
        work, counts, wide = self._asked
        rate = self._rates_of(work, counts)
        # (for the step after the one running, self._steps)
        self._ready = self._solve(work, counts, rate, wide, self._steps + 1 - ROUTES_AHEAD) | {
            "key": self._key}

    def _rates_of(self, work: list[SlotWork], counts: list[int]) -> np.ndarray:
        """[S, MAX_POSITIONS]: each slot's acceptance now (0 where it has no drafts)."""
        return np.array([self.accept.rate(w.request_id, int(w.draft_sources[0]),
                                          self.optimism) if n
                         else np.zeros(MAX_POSITIONS) for w, n in zip(work, counts,
                                                                      strict=True)])

    def _solve(self, work: list[SlotWork], counts: list[int], rate: np.ndarray,
               wide: bool, routed: int) -> dict:
        """A new choice (daemon/draft_budget.choose) from the estimates now (``rate``: the
        slots' acceptance, [S, MAX_POSITIONS]) and the slots' routes of step ``routed``:
        ``out`` the counts, ``rates`` the rate, ``history`` whether every drafted decode
        slot had those routes, ``forecast`` and ``last`` what it expects (a wide choice)."""
        decode = [w.kind == WorkKind.DECODE for w in work]
        step = routed if self.reuse else None
        log_miss, weight = self.routing.patterns(
            [w.request_id if d else None for w, d in zip(work, decode, strict=True)], step)
        problem = BudgetProblem(
            base_rows=np.array([w.num_tokens for w in work]), max_drafts=np.array(counts),
            accept=rate, base_value=np.array(decode, dtype=np.float64),
            log_miss=log_miss, weight=weight, wide=wide, locality=self.routing.locality,
            pad_to=self.pad_to if all(decode) else ())  # a prompt chunk's pass: unpadded
        self._slots = len(work)
        cost = self.cost
        out = choose(problem, cost)
        ready = {"out": out, "rates": rate, "forecast": None, "last": {},
                 "history": all(self.routing.has_history(w.request_id, step)
                                for w, n, d in zip(work, counts, decode, strict=True)
                                if n and d)}
        if wide:  # what it expects of the chosen pass, against the worker's (observe)
            rows = problem.base_rows + np.array(out)
            union = float(expected_union(fresh_rows(rows[None, :], problem.locality),
                                         log_miss, weight)[0])
            run = float(padded_rows(rows.sum(), problem.pad_to))
            forecast = ready["forecast"] = (union, cost.pass_ms(run, union))
            offer = np.array(counts)
            alt = np.minimum(np.arange(1, UNIFORM + 1)[:, None], offer[None, :])  # [k, S]
            r = ratio(problem, cost, np.vstack([alt, np.array(out)[None, :]]))
            now = r[:-1] / max(r[-1], 1e-12)
            # ... and what it ran on: each slot's acceptance at its offered positions, the
            # request weight of each source drafted, the step cost
            sources = {int(w.draft_sources[0]) for w, n in zip(work, counts, strict=True) if n}
            ready["last"] = {"forecast": [round(v, 3) for v in forecast],
                             "uniform": [round(float(v), 5) for v in now],
                             "accept": [[round(float(a), 3) for a in rate[i, :n]]
                                        for i, n in enumerate(counts)],
                             "weights": {str(src): round(self.accept.request_weight(src), 1)
                                         for src in sorted(sources)},
                             "cost": [round(cost.fixed_ms, 3), round(cost.row_ms, 4),
                                      round(cost.expert_ms, 5)]}
            self.uniform = now if self.uniform is None else self.uniform + EMA * (
                now - self.uniform)
        return ready

    def figures(self) -> dict[str, float]:
        """The estimates the choice runs on (daemon/metrics_budget.py): the step cost for the
        number of slots most of the fitted steps had (``cost_slots``; a run's steady state,
        not its last few steps as streams end), the routing model now."""
        self.settle()
        slots = self.costs.usual_slots()
        cost, r = (self.costs.cost(slots) if self.fit_costs else self.cost), self.routing
        return {"fixed_ms": cost.fixed_ms, "row_ms": cost.row_ms, "expert_ms": cost.expert_ms,
                "cost_slots": float(slots or 0), "fitted_steps": self.costs.n,
                "persistence": r.persistence, "locality": r.locality,
                "effective_experts": float(r.effective), "picks_per_row": r.picks_per_row,
                "union_error": float(self.errors[0]), "step_error": float(self.errors[1]),
                "request_weight": self._request_weight(),
                **{f"uniform_{k + 1}": float(v) for k, v in enumerate(
                    np.zeros(UNIFORM) if self.uniform is None else self.uniform)}}

    def _request_weight(self) -> float:
        """The trials a request leans on its source by, for the source with the most
        verifies (daemon/draft_accept.py; the fixed weight before any)."""
        src = self.accept.sources
        if not src:
            return REQUEST_PRIOR_TRIALS
        return self.accept.request_weight(max(src, key=lambda k: src[k][1, 0]))

    @property
    def cost(self) -> StepCost:
        """The step cost for as many slots as the last step chosen for had."""
        if not self.fit_costs:
            return StepCost(*self.costs.prior)
        return self.costs.cost(self._slots)

    def observe(self, plan: StepPlan, result: StepResult, seconds: float) -> None:
        """A step's outcome: its acceptance per verify now; its routing per decode slot and
        the time of a decode-only step kept for :meth:`settle` (the module doc)."""
        step, self._steps = self._steps, self._steps + 1
        for w, res in zip(plan.slots, result.slots, strict=True):
            if w.kind == WorkKind.DECODE and len(w.draft_ids):
                self.accept.observe(w.request_id, int(w.draft_sources[0]), len(w.draft_ids),
                                    res.num_accepted)
        self._pending.append((step, plan, result, seconds, self.forecast))
        self.forecast = None

    def settle(self, but_last: bool = False) -> None:
        """The kept steps' routing and times into the estimates (``but_last``: all but the
        last step observed)."""
        keep = self._pending[-1:] if but_last else []
        pending, self._pending = self._pending[:len(self._pending) - len(keep)], keep
        for step, plan, result, seconds, forecast in pending:
            self._settle(step, plan, result, seconds, forecast)

    def _settle(self, step: int, plan: StepPlan, result: StepResult, seconds: float,
                forecast: tuple[float, float] | None) -> None:
        universe = int(result.counters.get("cpu_experts_held", 0))
        for w, res in zip(plan.slots, result.slots, strict=True):
            if w.kind != WorkKind.DECODE:
                continue
            self.routing.observe(w.request_id, w.num_rows, res.cpu_experts,
                                 res.cpu_expert_rows, universe, step if self.reuse else None)
        c = result.counters
        # the step's passes: its time less its cache commands' (a finished request's
        # checkpoint took up to 50 ms of an H100 machine's four-stream steps, whatever
        # their layout: session 28's step traces)
        ms = seconds * 1e3 - float(result.timings_ms.get("cache_ops", 0.0))
        if (plan.slots and all(w.kind == WorkKind.DECODE for w in plan.slots)
                and not any(c.get(k, 0) for k in ONE_OFF_COUNTERS)):
            if forecast is not None and c.get("cpu_experts", 0) > 0 and ms > 0:
                self.errors += EMA * (np.array([forecast[0] / c["cpu_experts"],
                                                forecast[1] / ms]) - 1.0 - self.errors)
            self.costs.observe(int(c.get("passes", 1)),  # the rows run, padding too
                               plan.num_rows + int(c.get("padding_rows", 0)),
                               int(c.get("cpu_experts", 0)), ms,
                               float(result.timings_ms.get("cpu_experts", 0.0)),
                               len(plan.slots))


def _near(rate: np.ndarray, before: np.ndarray, counts: list[int]) -> bool:
    """Whether no slot's acceptance at a position its offer reaches moved by more than
    ``ACCEPT_TOLERANCE`` from ``before`` (the same slots)."""
    return bool(np.abs(rate - before)[:, :max(counts)].max() <= ACCEPT_TOLERANCE)

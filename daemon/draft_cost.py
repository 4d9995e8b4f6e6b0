"""The adaptive draft budget's step cost (daemon/draft_stats.py's module doc, "Step cost"):
what a forward pass, a row and a distinct CPU expert cost, from the decode-only steps.

A step's cost is not one line over every layout: a pass of one slot spreads its few experts
per layer over the CPU workers worse than four slots' many, so an expert costs more there,
and what the CPU experts leave of the step (the GPU's work, the layers' hand-offs) is a
larger share. The choice is made among the layouts of the step at hand (its slots), so the
cost is kept per number of slots, from the steps of that many slots once there are
``MIN_LOCAL_STEPS`` of them, else from all."""

from __future__ import annotations

import dataclasses

import numpy as np

from daemon.draft_budget import StepCost

MIN_STEPS = 16  # decode-only steps before the fitted step cost replaces the config's
# a row's cost is fitted with the config's (``cost_row_ms``) as a prior of this spread (ms): the
# steps' own scatter around the fit decides how far they move it, so noisy steps keep the
# config's and quiet ones measure it. (An H100 machine's four-stream steps, their cache
# commands taken out (daemon/draft_adaptive.py), scatter by 0.4-0.9 ms and say 0: the rows of
# one pass run its capacity bucket's graph whatever their number; session 28's step traces)
ROW_PRIOR_SD_MS = 0.25
MIN_LOCAL_STEPS = 4  # steps of one slot count before their own fit is used for it


class StepSums:
    """Decode-only steps' sums for a least-squares fit, old steps fading by ``forget``."""

    def __init__(self, forget: float) -> None:
        self.forget = forget
        self.A = np.zeros((3, 3))  # over (passes, rows, CPU experts)
        self.b = np.zeros(3)
        self.n = 0.0
        self.cpu = np.zeros(2)  # CPU expert ms and CPU experts of the steps
        # the steps whose CPU expert time was reported, over (passes, rows): what each step's
        # own CPU time left of it (a step's CPU time strays from the average expert's cost by
        # far more than its rows cost: the rest of the average would hide the rows)
        self.A_rest = np.zeros((2, 2))
        self.b_rest = np.zeros(2)
        self.yy_rest = 0.0  # and the sum of the squares of what was left
        self.n_rest = 0.0

    def add(self, x: np.ndarray, ms: float, cpu_ms: float) -> None:
        self.A = self.forget * self.A + np.outer(x, x)
        self.b = self.forget * self.b + x * ms
        self.n = self.forget * self.n + 1.0
        if cpu_ms > 0 and x[2] > 0:
            self.cpu = self.forget * self.cpu + np.array([cpu_ms, x[2]])
            self.A_rest = self.forget * self.A_rest + np.outer(x[:2], x[:2])
            self.b_rest = self.forget * self.b_rest + x[:2] * (ms - cpu_ms)
            self.yy_rest = self.forget * self.yy_rest + (ms - cpu_ms) ** 2
            self.n_rest = self.forget * self.n_rest + 1.0


class CostFit:
    """``StepCost`` of decode-only steps: ms ~ fixed * passes + row * rows + expert *
    cpu_experts, ``expert`` measured (the worker's CPU expert time over the experts) where
    the worker reports that time, else fitted with the rest; per number of slots (the module
    doc). A ridge of ``strength`` steps' weight (scaled per feature) pulls what the steps
    leave undetermined (no CPU experts: their cost) to the config's constants; old steps fade
    by ``forget`` per step."""

    def __init__(self, prior: StepCost, strength: float = 0.01, forget: float = 0.99) -> None:
        self.prior = np.array([prior.fixed_ms, prior.row_ms, prior.expert_ms])
        self.strength, self.forget = strength, forget
        self.pooled = StepSums(forget)  # every decode-only step
        self.by_slots: dict[int, StepSums] = {}

    @property
    def n(self) -> float:
        """The steps the pooled fit weighs (old ones counted by what is left of them)."""
        return self.pooled.n

    def usual_slots(self) -> int | None:
        """The number of slots the most (faded) steps had (None: no step yet)."""
        return max(self.by_slots, key=lambda k: self.by_slots[k].n, default=None)

    def observe(self, passes: int, rows: int, experts: int, ms: float,
                cpu_ms: float = 0.0, slots: int = 0) -> None:
        """A decode-only step of ``slots`` slots: its passes, rows, distinct CPU experts, wall
        time and the worker's CPU expert time (0: not reported)."""
        x = np.array([passes, rows, experts], dtype=np.float64)
        self.pooled.add(x, ms, cpu_ms)
        self.by_slots.setdefault(slots, StepSums(self.forget)).add(x, ms, cpu_ms)

    def cost(self, slots: int | None = None) -> StepCost:
        """The cost for a step of ``slots`` slots (None: over all steps). Before that many
        slots have ``MIN_LOCAL_STEPS`` steps, the pass's and a row's cost come from every
        step, and a CPU expert's from their own steps once there is one: the first choices
        of a run's four-slot steps were made with the experts' cost of its one- to
        three-slot steps, 34-42 us an expert against 30 (an H100 machine, session 30)."""
        local = self.by_slots.get(slots) if slots is not None else None
        if local is not None and local.n >= MIN_LOCAL_STEPS:
            return self._fit(local)
        expert = _measured(local)
        if self.pooled.n < MIN_STEPS:
            expert = expert or _measured(self.pooled)
            fixed, row, prior_expert = self.prior
            return StepCost(fixed, row, prior_expert if expert is None else expert)
        pooled = self._fit(self.pooled)
        return pooled if expert is None else dataclasses.replace(pooled, expert_ms=expert)

    def _fit(self, s: StepSums) -> StepCost:
        expert = _measured(s)
        if expert is None:
            R = np.diag(self.strength * np.diag(s.A) / s.n + 1e-9)
            theta = np.linalg.solve(s.A + R, s.b + R @ self.prior)
            fixed, row, expert = np.maximum(theta, 0.0)
            return StepCost(max(float(fixed), 1e-3), float(row), float(expert))
        # fixed and row on what each step's own CPU expert time left of it, the row's cost
        # leaning on the config's by the steps' scatter (ROW_PRIOR_SD_MS); where the steps'
        # rows hardly vary, what they leave is the pass's (the ridge holds the row's)
        plain = np.linalg.solve(s.A_rest + np.diag([1e-9, 1e-9]), s.b_rest)
        scatter = max(s.yy_rest - 2.0 * plain @ s.b_rest + plain @ s.A_rest @ plain, 0.0) / max(
            s.n_rest - 2.0, 1.0)
        R = np.diag([1e-9, max(scatter / ROW_PRIOR_SD_MS ** 2,
                               self.strength * s.A_rest[1, 1] / s.n_rest) + 1e-9])
        A, b = s.A_rest + R, s.b_rest + R @ self.prior[:2]
        fixed, row = np.linalg.solve(A, b)
        if row < 0:  # rows never make a step cheaper: the best fit with row = 0
            fixed, row = b[0] / A[0, 0], 0.0
        return StepCost(max(float(fixed), 1e-3), float(row), float(expert))


def _measured(s: StepSums | None) -> float | None:
    """A CPU expert's measured cost over ``s``'s steps (None: no CPU time reported)."""
    return float(s.cpu[0] / s.cpu[1]) if s is not None and s.cpu[1] > 0 else None

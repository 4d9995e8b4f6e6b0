"""The adaptive draft budget's step cost (daemon/draft_stats.py's module doc, "Step cost"):
what a forward pass, a row and a distinct CPU expert cost, from the decode-only steps."""

from __future__ import annotations

import numpy as np

from daemon.draft_budget import StepCost

MIN_STEPS = 16  # decode-only steps before the fitted step cost replaces the config's


class CostFit:
    """``StepCost`` of decode-only steps: ms ~ fixed * passes + row * rows + expert *
    cpu_experts, ``expert`` measured (the worker's CPU expert time over the experts) where
    the worker reports that time, else fitted with the rest. A ridge of ``strength`` steps'
    weight (scaled per feature) pulls what the steps leave undetermined (no CPU experts:
    their cost) to the config's constants; old steps fade by ``forget`` per step."""

    def __init__(self, prior: StepCost, strength: float = 0.01, forget: float = 0.99) -> None:
        self.prior = np.array([prior.fixed_ms, prior.row_ms, prior.expert_ms])
        self.strength, self.forget = strength, forget
        self.A = np.zeros((3, 3))
        self.b = np.zeros(3)
        self.n = 0.0
        self.cpu = np.zeros(2)  # CPU expert ms and CPU experts of the steps, with forgetting

    def observe(self, passes: int, rows: int, experts: int, ms: float,
                cpu_ms: float = 0.0) -> None:
        """A decode-only step: its passes, rows, distinct CPU experts, wall time and the
        worker's CPU expert time (0: not reported)."""
        x = np.array([passes, rows, experts], dtype=np.float64)
        self.A = self.forget * self.A + np.outer(x, x)
        self.b = self.forget * self.b + x * ms
        self.n = self.forget * self.n + 1.0
        if cpu_ms > 0 and experts > 0:
            self.cpu = self.forget * self.cpu + np.array([cpu_ms, experts], dtype=np.float64)

    def cost(self) -> StepCost:
        expert = self.cpu[0] / self.cpu[1] if self.cpu[1] > 0 else None
        if self.n < MIN_STEPS:
            fixed, row, prior_expert = self.prior
            return StepCost(fixed, row, prior_expert if expert is None else expert)
        R = np.diag(self.strength * np.diag(self.A) / self.n + 1e-9)
        if expert is None:
            theta = np.linalg.solve(self.A + R, self.b + R @ self.prior)
            fixed, row, expert = np.maximum(theta, 0.0)
        else:  # fixed and row on what the measured CPU experts leave of each step
            A, b = self.A[:2, :2], self.b[:2] - expert * self.A[:2, 2]
            fixed, row = np.maximum(np.linalg.solve(A + R[:2, :2], b + R[:2, :2]
                                                    @ self.prior[:2]), 0.0)
        return StepCost(max(float(fixed), 1e-3), float(row), float(expert))

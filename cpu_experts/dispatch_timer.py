"""Where a host dispatch's time goes (for scripts/bench_cpu_experts.py), off by default.

Set ``pool.timer = DispatchTimer()``; after each ring load of ``CpuExpertPool.dispatch`` /
``dispatch_quantized`` it holds, in ns: ``wake_ns`` (the client rang -> the first worker
started), ``notice_ns`` (the last worker ended -> the client saw it), ``client_ns`` (the
client's own work around the load: header, ringing, summing the partials) and ``pre_ns``
(checks and input copies before the load). Worker times are CLOCK_MONOTONIC, as
``time.perf_counter_ns`` on Linux, so they compare across processes.
"""

from __future__ import annotations

import time

import numpy as np

from cpu_experts import rings


class DispatchTimer:
    def __init__(self) -> None:
        self.wake_ns = self.notice_ns = self.client_ns = self.pre_ns = 0
        self.seen_ns = 0  # when the client saw the last load finished
        self._call = self._enter = self._ring = 0

    def called(self) -> None:
        """A dispatch call began (or the previous load's bookkeeping ended)."""
        self._call = time.perf_counter_ns()

    def entered(self) -> None:
        """A load's header is about to be written."""
        self._enter = time.perf_counter_ns()

    def rang(self) -> None:
        """The header is written; the workers are being rung."""
        self._ring = time.perf_counter_ns()

    def seen(self, ctrl: np.ndarray) -> None:
        """Every worker is done (``ctrl``: the ring's ``[W, 16]`` rows)."""
        self.seen_ns = time.perf_counter_ns()
        self.wake_ns = int(ctrl[:, rings.T_START].min()) - self._ring
        self.notice_ns = self.seen_ns - int(ctrl[:, rings.T_END].max())

    def summed(self) -> None:
        """The load's partials are summed into the output."""
        t_out = time.perf_counter_ns()
        self.client_ns = (self._ring - self._enter) + (t_out - self.seen_ns)
        self.pre_ns = self._enter - self._call
        self._call = time.perf_counter_ns()

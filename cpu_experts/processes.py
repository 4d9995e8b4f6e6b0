"""The worker processes of one CpuExpertPool and everything else it must release.

Held apart from the pool (no reference back to it) so that the pool's finalizer and its
watchdog thread can run while an unclosed pool is being collected.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading

import numpy as np

from cpu_experts import rings
from cpu_experts.errors import CpuWorkerDied

WATCH_EVERY_S = 0.005  # how often a device session's watchdog looks at the workers


class WorkerProcesses:
    """``python -m cpu_experts.worker`` processes, their shared files and doorbells."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.files: list[rings.SharedFile] = []
        self.doorbells: list[rings.Doorbell] = []
        self.stop = threading.Event()  # ends the watchdog thread
        self.ready_info: list[dict] = []  # each worker's READY line

    def spawn(self, spec: dict) -> None:
        """Start one worker on ``spec`` (sent as one JSON line on its stdin)."""
        # NOTE: OpenMP threads spin ~ms between the kernel's parallel loops (as the worker's
        # own doorbell spin does) instead of sleeping; an explicit GOMP_SPINCOUNT wins.
        env = {"GOMP_SPINCOUNT": "3000000", **os.environ}
        env["NUMBA_NUM_THREADS"] = str(max(1, len(spec["cores"])))
        # NOTE: cpu_experts is an installed package (pip install -e .): the child finds it
        # from any working directory, no PYTHONPATH needed
        proc = subprocess.Popen([sys.executable, "-m", "cpu_experts.worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, pass_fds=(spec["doorbell_fd"],), env=env)
        self.procs.append(proc)
        proc.stdin.write((json.dumps(spec) + "\n").encode())
        proc.stdin.close()

    def await_ready(self, w: int, timeout: float) -> None:
        """Wait for worker ``w``'s READY line (kept in :attr:`ready_info`)."""
        proc = self.procs[w]
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else b""
        if not line:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                raise CpuWorkerDied(w, proc.pid, None, f"no READY within {timeout:.0f} s")
            raise CpuWorkerDied(w, proc.pid, proc.returncode, "exited before READY")
        info = json.loads(line)
        if info.get("kind") != "ready":
            raise CpuWorkerDied(w, proc.pid, proc.poll(), f"unexpected first message {info}")
        self.ready_info.append(info)

    def check_alive(self) -> None:
        """Raise :class:`CpuWorkerDied` naming the first worker that has exited."""
        for w, proc in enumerate(self.procs):
            if proc.poll() is not None:
                raise CpuWorkerDied(w, proc.pid, proc.returncode)

    def all_alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def start_watchdog(self, session: threading.Event, header: np.ndarray) -> threading.Thread:
        """A daemon thread that sets ``header[ABORT]`` when a worker dies while ``session``
        is set (a GPU kernel waiting on ``SEQ_OUT`` then gives up); it ends on :attr:`stop`."""
        thread = threading.Thread(target=_watch, args=(self, session, header), daemon=True,
                                  name="cpu-experts-watchdog")
        thread.start()
        return thread

    def release(self) -> None:
        self.stop.set()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            if p.stdout:
                p.stdout.close()
        for f in self.files:
            f.unlink()
            f.close()
        for d in self.doorbells:
            d.close()
        self.procs, self.files, self.doorbells = [], [], []


def _watch(procs: WorkerProcesses, session: threading.Event, header: np.ndarray) -> None:
    while not procs.stop.wait(WATCH_EVERY_S):
        if session.is_set() and any(p.poll() is not None for p in procs.procs):
            header[rings.ABORT] = 1

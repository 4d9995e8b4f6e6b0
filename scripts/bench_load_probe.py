"""What `scripts/bench_load.py` watches while a server loads and serves: the host memory of
the server's whole process tree, the GPU's memory, and the worker's load log lines.

* :class:`TreeMemory`: every ``every`` seconds, the descendants of one process (daemon, GPU
  worker, CPU expert workers) and their memory from /proc: VmRSS and VmHWM of
  /proc/PID/status, Pss of /proc/PID/smaps_rollup. Pss splits each shared page among the
  processes mapping it, so the sum over the tree counts the CPU experts' shared memory once
  (VmRSS sums count it once per process that maps it). Also MemTotal - MemAvailable of the
  machine, which counts shared-memory files even while no process maps them.
* :class:`GpuMemory`: ``nvidia-smi --query-gpu=memory.used`` every ``every`` seconds; None
  throughout on a machine without nvidia-smi.
* :func:`load_facts`: the worker's JSON log lines ("load plan", "load <phase>", "model
  loaded", "kv cache", "memory plan") read back from the server's stderr.
"""

from __future__ import annotations

import abc
import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from scripts.procs import process_tree

KIB = 1024
MIB = 2**20


def _status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM, RssShmem of /proc/PID/status in bytes (empty once the process is gone)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssShmem"):
                    out[key] = int(rest.split()[0]) * KIB
    except (OSError, ValueError, IndexError):
        return {}
    return out


def _pss(pid: int) -> int | None:
    """Pss of /proc/PID/smaps_rollup in bytes; None where the kernel lacks it."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * KIB
    except (OSError, ValueError, IndexError):
        return None
    return None


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (MemTotal, MemAvailable, Shmem, ...); empty where unreadable."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    out[key] = int(parts[0]) * (KIB if len(parts) > 1 else 1)
    except (OSError, ValueError):
        return {}
    return out




def _name(pid: int) -> str:
    """A short label of a process: its module (``-m NAME``) or its executable's name."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    args = [a.decode(errors="replace") for a in argv if a]
    if "-m" in args[:-1]:
        return args[args.index("-m") + 1]
    return os.path.basename(args[0]) if args else "?"


BACKOFF = 20  # a reading that took t seconds waits at least BACKOFF * t for the next


class _Poller(abc.ABC):
    """A daemon thread calling ``self.sample()`` every ``every`` seconds until ``stop()``."""

    def __init__(self, every: float) -> None:
        self.every = every
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> _Poller:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            self.sample()
            self.samples += 1
            took = time.monotonic() - t0
            # NOTE: reading smaps_rollup walks the page tables under the process's mmap
            # lock, and every mmap/munmap of the process waits for it (docs/loading.md):
            # a slow read backs off so the probe holds the lock at most 1/BACKOFF of the time
            self._stop.wait(max(self.every - took, BACKOFF * took))

    @abc.abstractmethod
    def sample(self) -> None:
        """Take one reading."""

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


class TreeMemory(_Poller):
    """Peak host memory of the process tree under ``root`` (see the module doc)."""

    def __init__(self, root: int, every: float = 0.2) -> None:
        super().__init__(every)
        self.root = root
        self.peak_pss: int | None = None  # None until smaps_rollup was read for every process
        self.peak_rss = 0
        self.pss_ok = True
        self.procs: dict[int, dict[str, Any]] = {}  # pid -> name, peaks
        base = meminfo()
        self.base_used = base.get("MemTotal", 0) - base.get("MemAvailable", 0)
        self.peak_used = self.base_used
        self.peak_shmem = base.get("Shmem", 0)

    def sample(self) -> None:
        rss = pss = 0
        for pid in process_tree(self.root):
            st = _status(pid)
            if not st:
                continue
            p = _pss(pid)
            self.pss_ok &= p is not None
            rss += st.get("VmRSS", 0)
            pss += p or 0
            rec = self.procs.setdefault(pid, {"pid": pid, "name": _name(pid), "vm_hwm_bytes": 0,
                                              "peak_rss_bytes": 0, "peak_pss_bytes": 0})
            rec["vm_hwm_bytes"] = max(rec["vm_hwm_bytes"], st.get("VmHWM", 0))
            rec["peak_rss_bytes"] = max(rec["peak_rss_bytes"], st.get("VmRSS", 0))
            rec["peak_pss_bytes"] = max(rec["peak_pss_bytes"], p or 0)
            rec["rss_shmem_bytes"] = st.get("RssShmem", 0)
        self.peak_rss = max(self.peak_rss, rss)
        if self.pss_ok:
            self.peak_pss = max(self.peak_pss or 0, pss)
        mi = meminfo()
        self.peak_used = max(self.peak_used, mi.get("MemTotal", 0) - mi.get("MemAvailable", 0))
        self.peak_shmem = max(self.peak_shmem, mi.get("Shmem", 0))

    def report(self) -> dict[str, Any]:
        """The peaks: ``peak_host_rss_bytes`` is the Pss sum where every process had
        smaps_rollup (``rss_method`` says which), else the VmRSS sum."""
        method = "sum of Pss (smaps_rollup)" if self.peak_pss is not None else "sum of VmRSS"
        return {"peak_host_rss_bytes": self.peak_pss if self.peak_pss is not None
                else self.peak_rss,
                "rss_method": method, "peak_host_vmrss_sum_bytes": self.peak_rss,
                "peak_host_pss_sum_bytes": self.peak_pss,
                "peak_machine_used_delta_bytes": self.peak_used - self.base_used,
                "peak_machine_shmem_bytes": self.peak_shmem,
                "processes": sorted(self.procs.values(), key=lambda r: r["pid"]),
                "samples": self.samples}


def nvidia_smi(field: str) -> int | None:
    """``memory.used`` or ``memory.total`` of the first GPU in bytes, as nvidia-smi reports
    it (MiB); None without nvidia-smi."""
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={field}",
                               "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10)
        return int(done.stdout.split()[0]) * MIB if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


class GpuMemory(_Poller):
    """Peak of ``nvidia-smi`` memory.used (None without nvidia-smi), and the value before."""

    def __init__(self, every: float = 0.2) -> None:
        super().__init__(every)
        self.before = nvidia_smi("memory.used")
        self.available = self.before is not None
        self.peak: int | None = self.before

    def sample(self) -> None:
        if not self.available:
            return
        used = nvidia_smi("memory.used")
        if used is not None:
            self.peak = max(self.peak or 0, used)


LOAD_EVENTS = ("load plan", "load dense", "load experts GPU", "load experts CPU",
               "load workers ready", "model loaded", "kv cache")


def load_facts(log_file: Path) -> dict[str, Any]:
    """The worker's load log lines from the server's stderr: ``events`` (event -> its
    fields, the last of each kind) and ``memory_plan`` (the plan's lines, in order)."""
    events: dict[str, dict] = {}
    plan: list[str] = []
    for raw in log_file.read_text(errors="replace").replace("\r", "\n").splitlines():
        start = raw.find('{"')  # tqdm's bar may precede a JSON line on the same line
        if start < 0:
            continue
        try:
            rec = json.loads(raw[start:])
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        event = rec.get("event")
        if event == "memory plan":
            plan.append(str(rec.get("line", "")))
        elif event in LOAD_EVENTS:
            events[event] = {k: v for k, v in rec.items()
                             if k not in ("event", "logger", "level", "timestamp")}
    return {"events": events, "memory_plan": plan}

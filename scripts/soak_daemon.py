"""The daemon under soak: one ``tandem serve`` process on 127.0.0.1 (a tiny model, NumPy
backend, CPU expert placement so that CPU expert workers exist), and what the soak reads
of it from outside: /ready, /v1/slots, /metrics, its process tree and its RSS."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from protocol.sockets import client_address
from scripts.bench_common import Samples, parse_samples
from scripts.procs import cmdline, descendants, free_port, stop_server

ROOT = Path(__file__).resolve().parents[1]
GPU_WORKER, CPU_WORKER = "gpu_worker.server", "cpu_experts.worker"




def config(model: Path, port: int, run_dir: Path, max_slots: int, max_queue: int,
           speculation: dict | None = None, placement: str = "cpu",
           scheduler: dict | None = None) -> dict:
    """The soak's configuration: float64 (so a request's text does not depend on what it was
    batched with), small prefill chunks and checkpoints (prefill spans several steps, the
    prefix cache is exercised), one CPU expert worker (``placement`` "cpu"; "gpu": the model
    worker's own experts); ``speculation``: the [speculation] section (none: plain
    decoding); ``scheduler``: keys over the [scheduler] section's."""
    cfg = {"model": {"path": str(model), "dtype": "float64", "backend": "numpy",
                     "name": "tandem-soak"},
           "server": {"host": "127.0.0.1", "port": port, "run_dir": str(run_dir)},
           "limits": {"max_queue": max_queue, "request_timeout_s": 300},
           "scheduler": {"max_slots": max_slots, "max_context": 1024, "kv_block_size": 16,
                         "prefill_chunk": 32, "checkpoint_interval": 32, **(scheduler or {})},
           "experts": ({"placement": "cpu", "cpu_workers": 1} if placement == "cpu" else
                       {"placement": placement}),
           "logging": {"json": True, "level": "info"}}
    if speculation:
        cfg["speculation"] = speculation
    return cfg


def _toml(cfg: dict) -> str:
    lines = []
    for section, values in cfg.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


class Daemon:
    def __init__(self, workdir: Path, model: Path, *, max_slots: int = 4,
                 max_queue: int = 64, speculation: dict | None = None,
                 placement: str = "cpu", scheduler: dict | None = None) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.run_dir = workdir / "run"
        self.config_path = workdir / "tandem.toml"
        self.config_path.write_text(_toml(config(model, self.port, self.run_dir, max_slots,
                                                 max_queue, speculation, placement,
                                                 scheduler)))
        self.log_path = workdir / "serve.log"
        self.url = f"http://127.0.0.1:{self.port}"
        self.zmq_address = client_address(self.run_dir)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120) -> Daemon:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "daemon.cli", "serve", "--config", str(self.config_path)],
            stdout=self.log_path.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)
        self.wait_ready(timeout)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float = 120) -> float:
        """Seconds until /ready answered 200; raises when the daemon exited or timed out."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if not self.alive():
                raise RuntimeError(f"the daemon exited:\n{self.log_tail()}")
            try:
                if self.get("/ready")[0] == 200:
                    return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"the daemon is not ready after {timeout} s:\n{self.log_tail()}")

    def get(self, path: str, timeout: float = 10) -> tuple[int, dict | str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                status, body = r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            status, body = e.code, e.read().decode()
        try:
            return status, json.loads(body)
        except json.JSONDecodeError:
            return status, body

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics (0 when absent)."""
        return self._samples().get((name, tuple(sorted(labels.items()))), 0.0)

    def metric_by(self, name: str, label: str) -> dict[str, float]:
        """Every sample of a one-label metric of /metrics, by the label's value (one read)."""
        return {labels[0][1]: value for (n, labels), value in self._samples().items()
                if n == name and len(labels) == 1 and labels[0][0] == label}

    def _samples(self) -> Samples:
        return parse_samples(str(self.get("/metrics")[1]))

    def restarts(self) -> int:
        return int(self.metric("tandem_worker_restarts_total", component="gpu_worker"))

    def children(self) -> dict[str, list[int]]:
        """Live descendants running ``python -m MODULE``, by module."""
        out: dict[str, list[int]] = {}
        for pid in descendants(self.proc.pid):
            cmd = cmdline(pid)
            for module in (GPU_WORKER, CPU_WORKER):
                if f"-m {module}" in cmd:
                    out.setdefault(module, []).append(pid)
        return out

    def kill(self, module: str) -> int:
        """SIGKILL one process running ``module``; its pid."""
        pid = self.children()[module][0]
        os.kill(pid, signal.SIGKILL)
        return pid

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> int | None:
        if not self.alive():
            return self.proc.returncode if self.proc else None
        stop_server(self.proc)
        return self.proc.returncode





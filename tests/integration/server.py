"""A real ``tandem serve`` process for integration tests: start, wait for /ready, stop."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from scripts.procs import cmdline, descendants, free_port


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Server:
    def __init__(self, tmp: Path, model: Path, **sections: dict) -> None:
        self.port = free_port()
        self.run_dir = tmp / "run"
        cfg = {"model": {"path": str(model), "dtype": "float64", "name": "tandem-test"},
               "server": {"port": self.port, "run_dir": str(self.run_dir)},
               "scheduler": {"max_context": 512, "kv_block_size": 16, "prefill_chunk": 64,
                             "checkpoint_interval": 32},
               "logging": {"json": True}}
        for name, values in sections.items():
            cfg.setdefault(name, {}).update(values)
        keys = cfg["server"].get("api_keys") or [None]
        self.api_key = keys[0]
        self.config = tmp / "tandem.toml"
        self.config.write_text(_toml(cfg))
        self.log = tmp / "serve.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def zmq_address(self) -> str:
        return f"ipc://{self.run_dir}/client.sock"

    def start(self, timeout: float = 60) -> Server:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "daemon.cli", "serve", "--config", str(self.config)],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited:\n{self.log.read_text()[-3000:]}"
            try:
                if self.get("/ready")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready:\n{self.log.read_text()[-3000:]}")

    def get(self, path: str) -> tuple[int, dict | str]:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            req = urllib.request.Request(self.url + path, headers=headers)
            with urllib.request.urlopen(req, timeout=10) as r:
                body = r.read().decode()
                status = r.status
        except urllib.error.HTTPError as e:
            body, status = e.read().decode(), e.code
        try:
            return status, json.loads(body)
        except json.JSONDecodeError:
            return status, body

    def child_pid(self, module: str) -> int:
        """The pid of the descendant process running ``python -m module``."""
        return next(p for p in descendants(self.proc.pid) if f"-m {module}" in cmdline(p))

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        tree = descendants(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [p for p in tree if alive(p)]
        assert not left, f"processes left behind after SIGTERM: {left}"
        return code




def _toml(cfg: dict) -> str:
    lines = []
    for section, values in cfg.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"


def generate_alone(model: Path, prompt: str, max_tokens: int, *, chat: bool = True,
                   temperature: float = 0.0, seed: int = 0, experts: dict | None = None) -> dict:
    """What ``tandem generate`` prints for one request (float64, the reference path)."""
    args = [sys.executable, "-m", "daemon.cli", "generate", "--model", str(model),
            "--dtype", "float64", "--prompt", prompt, "--max-tokens", str(max_tokens),
            "--temperature", str(temperature), "--seed", str(seed), "--json"]
    if chat:
        args.append("--chat")
    for key, value in (experts or {}).items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)

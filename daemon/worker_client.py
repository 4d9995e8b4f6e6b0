"""The daemon's handle on the GPU worker process: spawn, READY handshake, steps, death."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sys
from pathlib import Path

from protocol.messages import (
    PROTOCOL_VERSION,
    ReadyMsg,
    Shutdown,
    StepPlan,
    StepResult,
    WorkerError,
)
from protocol.sockets import AsyncDaemonToWorker

READY_TIMEOUT_S = 300.0


class WorkerDied(RuntimeError):
    """The GPU worker exited or reported a fatal error; in-flight requests fail."""


class WorkerStepError(RuntimeError):
    """A non-fatal WorkerError for one step (e.g. a plan the worker refused)."""

    def __init__(self, error: WorkerError) -> None:
        super().__init__(f"{error.code.name}: {error.message}")
        self.error = error


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """Everything the worker's command line carries."""

    run_dir: Path
    model: Path
    name: str = ""
    dtype: str = "float32"
    backend: str = "numpy"
    max_slots: int = 4
    max_context: int = 4096
    block_size: int = 64
    extra_blocks: int = 0
    kv_cache_dtype: str = "model"  # or "int8": int8 KV with an fp16 scale per 32 values
    placement: str = "gpu"
    cpu_experts_per_layer: int = 0
    cpu_workers: int = 0  # 0: one per NUMA node
    cpu_cores: str = ""  # "0,1,2;3,4,5": one core list per CPU expert worker
    cpu_isa: str = "auto"  # CPU expert kernels (cpu_experts/isa.py), auto: the best available
    cpu_dispatch: str = "launched"  # cupy: GPU kernels drive the CPU workers, or "sync"
    hot_experts: str = ""  # split: router counts file; the GPU keeps the hottest experts

    def argv(self) -> list[str]:
        args = [sys.executable, "-m", "gpu_worker.server"]
        for f in dataclasses.fields(self):
            args += [f"--{f.name.replace('_', '-')}", str(getattr(self, f.name))]
        return args


class WorkerProcess:
    """One incarnation of the GPU worker. ``start()`` returns once READY arrived."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.proc: asyncio.subprocess.Process | None = None
        self.sock: AsyncDaemonToWorker | None = None
        self.ready: ReadyMsg | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    async def start(self, timeout: float = READY_TIMEOUT_S) -> ReadyMsg:
        self.spec.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.sock = AsyncDaemonToWorker.in_run_dir(self.spec.run_dir)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = await asyncio.create_subprocess_exec(*self.spec.argv(), env=env,
                                                         stdin=asyncio.subprocess.DEVNULL)
        try:
            msg = await self._recv_or_death(timeout)
        except TimeoutError:
            await self.kill()
            raise WorkerDied(f"the GPU worker sent no READY within {timeout:.0f} s "
                             f"(model {self.spec.model})") from None
        if isinstance(msg, WorkerError):
            await self.kill()
            raise WorkerDied(f"the GPU worker failed to start: {msg.message}")
        if not isinstance(msg, ReadyMsg):
            await self.kill()
            raise WorkerDied(f"the GPU worker sent {type(msg).__name__} before READY")
        if msg.protocol_version != PROTOCOL_VERSION:
            await self.kill()
            raise WorkerDied(f"GPU worker speaks protocol {msg.protocol_version}, the daemon "
                             f"{PROTOCOL_VERSION}")
        self.ready = msg
        return msg

    async def step(self, plan: StepPlan) -> StepResult:
        """Send one plan and await its result; WorkerDied if the process goes away."""
        if self.proc is None or self.proc.returncode is not None:
            raise WorkerDied("the GPU worker is not running")
        try:
            await self.sock.send(plan, timeout=10)
        except TimeoutError:
            raise WorkerDied("the GPU worker does not take plans") from None
        msg = await self._recv_or_death(None)
        if isinstance(msg, WorkerError):
            if msg.fatal:
                await self.kill()
                raise WorkerDied(f"GPU worker: {msg.code.name}: {msg.message}")
            raise WorkerStepError(msg)
        if not isinstance(msg, StepResult) or msg.step_id != plan.step_id:
            await self.kill()
            raise WorkerDied(f"GPU worker answered step {plan.step_id} with {msg!r:.80}")
        return msg

    async def _recv_or_death(self, timeout: float | None):
        recv = asyncio.ensure_future(self.sock.recv())
        died = asyncio.ensure_future(self.proc.wait())
        done, _ = await asyncio.wait({recv, died}, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        if recv in done:
            died.cancel()
            return recv.result()
        recv.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await recv
        if died in done:
            raise WorkerDied(f"the GPU worker exited with status {self.proc.returncode}")
        died.cancel()
        raise TimeoutError

    async def stop(self, timeout: float = 10.0) -> None:
        """Ordered shutdown: Shutdown message, wait, then SIGKILL."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(TimeoutError, Exception):
                await self.sock.send(Shutdown(reason="daemon stopping"), timeout=1)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except TimeoutError:
                await self.kill()
        self._close_socket()

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
        self._close_socket()

    def _close_socket(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

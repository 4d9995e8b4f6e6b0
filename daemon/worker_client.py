"""The daemon's handle on the GPU worker process: spawn, READY handshake, steps, heartbeats,
death."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from protocol.errors import ProtocolError
from protocol.messages import (
    PROTOCOL_VERSION,
    Heartbeat,
    ReadyMsg,
    Shutdown,
    StepPlan,
    StepResult,
    WorkerError,
    WorkKind,
)
from protocol.sockets import AsyncDaemonToWorker
from protocol.worker_config import WorkerConfig

READY_TIMEOUT_S = 900.0  # default of limits.worker_ready_timeout_s (an 80B load)
STEP_FLOOR_S = 120.0  # a step's deadline is never shorter (limits.step_timeout_s)
PER_PROMPT_TOKEN_S = 0.02  # plus this per prefill token (a 50 tokens/s worst case)
PER_ROW_S = 0.5  # plus this per decode row (input token or draft)
WATCH_POLL_S = 0.5


def step_deadline(plan: StepPlan, floor_s: float = STEP_FLOOR_S) -> float:
    """Seconds the worker may take to answer `plan` (measured from the plan or the last
    message heard, whichever is later): a generous floor (first-step compilation, swaps)
    plus a share per prefill token and per decode row."""
    prompt = sum(w.num_tokens for w in plan.slots if w.kind == WorkKind.PREFILL)
    return floor_s + PER_PROMPT_TOKEN_S * prompt + PER_ROW_S * (plan.num_rows - prompt)


class WorkerDied(RuntimeError):
    """The GPU worker exited or reported a fatal error; in-flight requests fail."""


class WorkerStepError(RuntimeError):
    """A non-fatal WorkerError for one step (e.g. a plan the worker refused)."""

    def __init__(self, error: WorkerError) -> None:
        super().__init__(f"{error.code.name}: {error.message}")
        self.error = error


def worker_argv(config: WorkerConfig) -> list[str]:
    return [sys.executable, "-m", "gpu_worker.server", "--config", config.to_json()]


class WorkerProcess:
    """One incarnation of the GPU worker. ``start()`` returns once READY arrived.

    A reader task takes every message off the socket: heartbeats (and any message) mark
    when the daemon last heard from the worker (`health()`), the rest wait for `step()`.
    """

    def __init__(self, config: WorkerConfig, step_floor_s: float = STEP_FLOOR_S,
                 ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        self.config = config
        self.ready_timeout_s = ready_timeout_s  # start()'s default wait for READY
        self.step_floor_s = step_floor_s  # also the longest idle silence (no heartbeat)
        self._busy = False  # a step is in flight
        self._idle_since = time.monotonic()
        self._exit: asyncio.Future | None = None  # proc.wait()
        self.proc: asyncio.subprocess.Process | None = None
        self.sock: AsyncDaemonToWorker | None = None
        self.ready: ReadyMsg | None = None
        self.heartbeats = 0
        self.last_heard: float | None = None  # time.monotonic() of the last message
        self._inbox: asyncio.Queue[Any] = asyncio.Queue()
        self._reader: asyncio.Task | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def health(self) -> dict[str, Any]:
        """What /health says of the worker: pid, heartbeats so far, seconds since the daemon
        last heard from it (None: not yet)."""
        ago = None if self.last_heard is None else round(time.monotonic() - self.last_heard, 3)
        return {"pid": self.pid, "ready": self.ready is not None, "heartbeats": self.heartbeats,
                "last_heard_s": ago}

    async def start(self, timeout: float | None = None) -> ReadyMsg:
        timeout = self.ready_timeout_s if timeout is None else timeout
        run_dir = Path(self.config.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.sock = AsyncDaemonToWorker.in_run_dir(run_dir)
        self._reader = asyncio.create_task(self._read(self.sock))
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        try:
            self.proc = await asyncio.create_subprocess_exec(*worker_argv(self.config), env=env,
                                                             stdin=asyncio.subprocess.DEVNULL)
        except OSError as exc:
            await self._close_socket()
            raise WorkerDied(f"cannot start the GPU worker: {exc}") from None
        try:
            msg = await self._next(timeout)
        except TimeoutError:
            await self.kill()
            raise WorkerDied(f"the GPU worker sent no READY within {timeout:.0f} s "
                             f"(model {self.config.model})") from None
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
        self._idle_since = time.monotonic()
        return msg

    async def step(self, plan: StepPlan) -> StepResult:
        """Send one plan and await its result; WorkerDied if the process goes away."""
        if self.proc is None or self.proc.returncode is not None:
            raise WorkerDied("the GPU worker is not running")
        try:
            await self.sock.send(plan, timeout=10)
        except TimeoutError:
            raise WorkerDied("the GPU worker does not take plans") from None
        self._busy = True
        try:
            msg = await self._reply(plan)
        finally:
            self._busy, self._idle_since = False, time.monotonic()
        if isinstance(msg, WorkerError):
            if msg.fatal:
                await self.kill()
                raise WorkerDied(f"GPU worker: {msg.code.name}: {msg.message}")
            raise WorkerStepError(msg)
        if not isinstance(msg, StepResult) or msg.step_id != plan.step_id:
            await self.kill()
            raise WorkerDied(f"GPU worker answered step {plan.step_id} with {msg!r:.80}")
        return msg

    async def _reply(self, plan: StepPlan) -> Any:
        """The answer to `plan`; a worker silent past the step's deadline is hung: killed,
        WorkerDied."""
        budget = step_deadline(plan, self.step_floor_s)
        start = time.monotonic()
        while True:
            left = max(start, self.last_heard or start) + budget - time.monotonic()
            if left <= 0:
                await self.kill()
                raise WorkerDied(f"the GPU worker hung: no answer to step {plan.step_id} "
                                 f"({plan.num_rows} rows) within {budget:.0f} s; restarting it")
            with contextlib.suppress(TimeoutError):
                return await self._next(left)

    async def watch(self) -> None:
        """Raises WorkerDied when the process exits, or when it is idle and silent (no
        heartbeat) for longer than step_floor_s (it is killed then); a step's own deadline
        is step()'s. Runs beside the scheduler's loop."""
        while True:
            if self._exit is None:
                self._exit = asyncio.ensure_future(self.proc.wait())
            done, _ = await asyncio.wait({self._exit}, timeout=WATCH_POLL_S)
            if done:
                raise WorkerDied(f"the GPU worker exited with status {self.proc.returncode}")
            silent = time.monotonic() - max(self.last_heard or 0.0, self._idle_since)
            if not self._busy and silent > self.step_floor_s:
                await self.kill()
                raise WorkerDied(f"the GPU worker hung: no heartbeat for {silent:.0f} s; "
                                 f"restarting it")

    async def _read(self, sock: AsyncDaemonToWorker) -> None:
        while True:
            try:
                msg = await sock.recv()
            except ProtocolError as exc:  # step() turns it into WorkerDied
                self._inbox.put_nowait(exc)
                continue
            self.last_heard = time.monotonic()
            if isinstance(msg, Heartbeat):
                self.heartbeats += 1
            else:
                self._inbox.put_nowait(msg)

    async def _next(self, timeout: float | None) -> Any:
        """The next message that is not a heartbeat; WorkerDied if the process exits first."""
        get = asyncio.ensure_future(self._inbox.get())
        died = asyncio.ensure_future(self.proc.wait())
        done, _ = await asyncio.wait({get, died}, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            died.cancel()
            msg = get.result()
            if isinstance(msg, ProtocolError):
                await self.kill()
                raise WorkerDied(f"the GPU worker sent a malformed message: {msg}")
            return msg
        get.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await get
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
        await self._close_socket()

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
        await self._close_socket()

    async def _close_socket(self) -> None:
        if self._exit is not None and not self._exit.done():
            self._exit.cancel()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
            self._reader = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None

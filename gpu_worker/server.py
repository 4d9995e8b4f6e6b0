"""The GPU worker process: READY handshake, then one StepPlan at a time.

    python -m gpu_worker.server --run-dir DIR --model PATH [--dtype float32] ...

It connects to the daemon's worker socket in DIR, loads the model, starts the CPU expert
workers where the placement asks for them, sends ReadyMsg, and answers every StepPlan with
a StepResult (or a typed WorkerError). It dies with its parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
import traceback

from gpu_worker.engine import DTYPES, load_model
from gpu_worker.loader import CheckpointError, load_generation_config
from gpu_worker.runner import PlanError, Runner
from protocol.errors import ProtocolError
from protocol.messages import (
    CAPABILITIES,
    PROTOCOL_VERSION,
    ModelInfo,
    Ping,
    Pong,
    ReadyMsg,
    Shutdown,
    StepPlan,
    WorkerError,
    WorkerErrorCode,
)
from protocol.sockets import WorkerToDaemon


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM us when the daemon dies, so no worker outlives it."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() == 1:  # the parent already died before prctl
        sys.exit(1)


def _log(event: str, **fields) -> None:
    """A JSON log line on stderr, shaped like the daemon's structlog lines."""
    print(json.dumps({"event": event, "logger": "tandem.gpu_worker", "level": "info",
                      **fields}), file=sys.stderr, flush=True)


def build_runner(args: argparse.Namespace):
    model, pool = load_model(args.model, dtype=args.dtype, backend=args.backend,
                             placement=args.placement,
                             cpu_experts_per_layer=args.cpu_experts_per_layer,
                             cpu_workers=args.cpu_workers,
                             cpu_cores=parse_core_groups(args.cpu_cores),
                             cpu_isa=args.cpu_isa, cpu_dispatch=args.cpu_dispatch,
                             hot_experts=args.hot_experts or None)
    if pool is not None:
        for info in pool.pool.ready_info:  # one line per CPU expert worker, what it holds
            _log("cpu expert worker ready", placement=args.placement, **info,
                 cpu_experts_per_layer=int(next(iter(pool.on_cpu.values())).sum()))
        if pool.hot_share:  # what the calibration says the GPU's experts will serve
            shares = list(pool.hot_share.values())
            _log("hot experts on the gpu", file=args.hot_experts,
                 router_picks_on_gpu_mean=round(sum(shares) / len(shares), 4),
                 router_picks_on_gpu_min=round(min(shares), 4))
    blocks_per_slot = -(-args.max_context // args.block_size)
    runner = Runner(model, max_slots=args.max_slots, max_context=args.max_context,
                    block_size=args.block_size, extra_blocks=args.extra_blocks,
                    kv_int8=args.kv_cache_dtype == "int8",
                    experts=pool.experts if pool else None,
                    expert_stats=pool.take_stats if pool else None,
                    expert_step=pool.step if pool else None)
    capacity = (args.max_slots * blocks_per_slot + args.extra_blocks) * args.block_size
    kv = runner.caches.kv
    _log("kv cache", dtype="int8" if kv.quant else str(kv.k.dtype), blocks=kv.num_blocks,
         block_size=kv.block_size, layers=kv.num_layers,
         mib=round(kv.nbytes / 2**20, 1))
    eos = load_generation_config(args.model).get("eos_token_ids", [])
    info = ModelInfo(name=args.name or os.path.basename(os.path.normpath(args.model)),
                     vocab_size=model.cfg.vocab_size, max_slots=args.max_slots,
                     kv_capacity_tokens=capacity, max_seq_len=args.max_context,
                     eos_token_ids=list(eos))
    return runner, pool, info


def serve(args: argparse.Namespace) -> int:
    _die_with_parent()
    sock = WorkerToDaemon.in_run_dir(args.run_dir)
    try:
        runner, pool, info = build_runner(args)
    except (CheckpointError, ValueError, OSError, RuntimeError) as exc:
        sock.send(WorkerError(code=WorkerErrorCode.MODEL_LOAD, message=str(exc), fatal=True),
                  timeout=5)
        sock.close()
        return 1
    sock.send(ReadyMsg(protocol_version=PROTOCOL_VERSION, capabilities=list(CAPABILITIES),
                       model=info, pid=os.getpid()), timeout=30)
    try:
        while True:
            try:
                msg = sock.recv()
            except ProtocolError as exc:
                sock.send(WorkerError(code=WorkerErrorCode.PROTOCOL, message=str(exc)))
                continue
            if isinstance(msg, Shutdown):
                return 0
            if isinstance(msg, Ping):
                sock.send(Pong(nonce=msg.nonce, time_ns=msg.time_ns))
                continue
            if not isinstance(msg, StepPlan):
                sock.send(WorkerError(code=WorkerErrorCode.PROTOCOL,
                                      message=f"unexpected {type(msg).__name__}"))
                continue
            try:
                sock.send(_execute(runner, pool, msg))
            except _Fatal as fatal:
                sock.send(fatal.error, timeout=2)
                return 1
    finally:
        if pool is not None:
            pool.close()
        sock.close()


def _execute(runner: Runner, pool, plan: StepPlan):
    try:
        if pool is not None:
            pool.check_alive()
        return runner.execute(plan)
    except PlanError as exc:
        return WorkerError(code=WorkerErrorCode.BAD_PLAN, message=str(exc), step_id=plan.step_id)
    except Exception as exc:  # a bug or a dead CPU worker: report it, then exit for a restart
        died = type(exc).__name__ == "CpuWorkerDied"
        code = WorkerErrorCode.CPU_WORKER_DIED if died else WorkerErrorCode.INTERNAL
        traceback.print_exc(file=sys.stderr)
        err = WorkerError(code=code, message=f"{type(exc).__name__}: {exc}", fatal=True,
                          step_id=plan.step_id)
        raise _Fatal(err) from exc


class _Fatal(Exception):
    def __init__(self, error: WorkerError) -> None:
        super().__init__(error.message)
        self.error = error


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_worker.server")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--name", default="")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--backend", default="numpy")
    p.add_argument("--max-slots", type=int, default=4)
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--extra-blocks", type=int, default=0)
    p.add_argument("--kv-cache-dtype", choices=("model", "int8"), default="model")
    p.add_argument("--placement", choices=("gpu", "cpu", "split"), default="gpu")
    p.add_argument("--cpu-experts-per-layer", type=int, default=0)
    p.add_argument("--cpu-workers", type=int, default=0, help="0: one per NUMA node")
    p.add_argument("--cpu-cores", default="", help='per worker core lists: "0,1,2;3,4,5"')
    p.add_argument("--cpu-isa", choices=("auto", "portable", "avx2", "avx512vnni"),
                   default="auto", help="CPU expert kernels (auto: the best this CPU has)")
    p.add_argument("--hot-experts", default="",
                   help="split: router counts (tandem expert-stats); the GPU keeps the hottest")
    p.add_argument("--cpu-dispatch", choices=("launched", "sync"), default="launched",
                   help="cupy: GPU kernels ring the CPU workers (launched) or the host does")
    return p.parse_args(argv)


def parse_core_groups(text: str) -> list[list[int]] | None:
    """"0,1;2,3" -> [[0, 1], [2, 3]]; "" -> None (derive from NUMA nodes)."""
    if not text:
        return None
    return [[int(c) for c in group.split(",") if c] for group in text.split(";")]


def main(argv: list[str] | None = None) -> int:
    return serve(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

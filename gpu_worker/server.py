"""The GPU worker process: READY handshake, then one StepPlan at a time, heartbeats between.

    python -m gpu_worker.server --config '{"run_dir": ..., "model": ..., ...}'

The one argument is a `protocol.worker_config.WorkerConfig` as JSON (the daemon builds it).
The worker connects to the daemon's worker socket in its run_dir, loads the model, starts the
CPU expert workers where the placement asks for them, sends ReadyMsg (with what the daemon
needs to know of the model and the KV pool), and answers every StepPlan with a StepResult (or
a typed WorkerError). It dies with its parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
import time
import traceback

from cpu_experts.cores import host_cores
from cpu_experts.errors import CpuWorkerDied
from gpu_worker.backend import get_xp
from gpu_worker.engine import load_model
from gpu_worker.expert_stats import load_counts
from gpu_worker.experts.split import ExpertSplit, split_from_orders
from gpu_worker.kv_cache import block_bytes
from gpu_worker.loader import CheckpointError
from gpu_worker.memory_plan import MemoryPlan, describe, plan_for_worker
from gpu_worker.model.attention import compile_long_launches
from gpu_worker.runner import PlanError, Runner
from gpu_worker.weights.resolve import generation_config, open_source
from protocol.errors import ProtocolError
from protocol.host_cores import pin_host_process
from protocol.messages import (
    PROTOCOL_VERSION,
    Heartbeat,
    KvLayout,
    ModelInfo,
    Ping,
    Pong,
    ReadyMsg,
    SamplingDefaults,
    Shutdown,
    StepPlan,
    WorkerError,
    WorkerErrorCode,
)
from protocol.sockets import WorkerToDaemon
from protocol.worker_config import WorkerConfig


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
    """A JSON log line on stderr, shaped like the daemon's structlog lines: one write, line
    and newline together (print writes them apart, and the daemon's lines in the same file
    could land between them)."""
    sys.stderr.write(json.dumps({"event": event, "logger": "tandem.gpu_worker",
                                 "level": "info", **fields}) + "\n")
    sys.stderr.flush()


def _device_free(xp) -> dict[str, float]:
    """The device's free memory in GiB after start-up's captures (CUDA graphs' own memory is
    outside CuPy's pools); nothing on NumPy."""
    if xp.__name__ != "cupy":
        return {}
    return {"device_free_gib": round(xp.cuda.runtime.memGetInfo()[0] / 2**30, 2)}


def build_runner(cfg: WorkerConfig) -> tuple[Runner, object, ModelInfo]:
    """The model, its CPU expert workers (or None) and the Runner, plus what READY reports."""
    source = open_source(cfg.model)  # validated here, before any data is read
    plan, split = _memory_plan(cfg, source)
    model, pool = load_model(source, dtype=cfg.dtype, backend=cfg.backend,
                             placement=plan.placement, expert_split=split,
                             cpu_workers=cfg.cpu_workers,
                             cpu_cores=[list(g) for g in cfg.cpu_cores] or None,
                             cpu_isa=cfg.cpu_isa, cpu_format=cfg.cpu_format,
                             gpu_format=cfg.gpu_format,
                             cpu_shard_cache=cfg.cpu_shard_cache or None,
                             log=_log)  # one line per load phase: bytes and seconds
    if pool is not None:
        for info in pool.pool.ready_info:  # one line per CPU expert worker, what it holds
            _log("cpu expert worker ready", placement=cfg.placement, **info,
                 cpu_experts_per_layer=int(next(iter(pool.on_cpu.values())).sum()))
        if pool.hot_share:  # what the calibration says the GPU's experts will serve
            shares = list(pool.hot_share.values())
            _log("hot experts on the gpu", file=cfg.hot_experts,
                 router_picks_on_gpu_mean=round(sum(shares) / len(shares), 4),
                 router_picks_on_gpu_min=round(min(shares), 4))
    mc = model.cfg
    layers = len(mc.full_attention_layers) + min(mc.num_mtp_layers, 1)  # MTP's KV: one more
    size = block_bytes(layers, cfg.block_size, mc.num_key_value_heads, mc.head_dim,
                       8 if cfg.dtype == "float64" else 4, quant=cfg.kv_cache_dtype == "int8")
    extra_blocks = cfg.prefix_blocks(size)
    runner = Runner(model, max_slots=cfg.max_slots, max_context=cfg.max_context,
                    block_size=cfg.block_size, extra_blocks=extra_blocks,
                    kv_int8=cfg.kv_cache_dtype == "int8",
                    experts=pool if pool else None, slot_routing=cfg.slot_routing,
                    draft_overlap=cfg.draft_overlap, cuda_graphs=cfg.cuda_graphs,
                    max_drafts=cfg.max_drafts, speculation_mode=cfg.speculation_mode,
                    graph_warm_up=cfg.graph_warm_up, graph_buckets=cfg.graph_buckets,
                    mtp_drafts=cfg.mtp_drafts, graph_mtp=cfg.graph_mtp)
    _log("draft overlap", enabled=cfg.draft_overlap, active=runner.overlap is not None,
         reason=runner.overlap_reason)
    _log("cuda graphs", enabled=cfg.cuda_graphs, active=runner.graphs is not None,
         reason=runner.graphs_reason, warm_up=cfg.graph_warm_up,
         buckets=runner.graphs is not None and runner.graphs.scratch is not None,
         **runner.warm_graphs(),
         **_device_free(model.xp))
    kv, states = runner.caches.kv, runner.caches.states
    t0 = time.perf_counter()
    compile_long_launches(kv, model.ops.dtype)  # else the first long prompt waits for it
    _log("attention kernels", seconds=round(time.perf_counter() - t0, 2))
    layout = KvLayout(block_size=kv.block_size, block_bytes=kv.nbytes // max(kv.num_blocks, 1),
                      num_blocks=kv.num_blocks, prefix_blocks=extra_blocks,
                      dtype="int8" if kv.quant else str(kv.k.dtype),
                      state_bytes=states.bytes_per_slot if states is not None else 0)
    _log("kv cache", dtype=layout.dtype, blocks=kv.num_blocks, block_size=kv.block_size,
         layers=kv.num_layers, mib=round(kv.nbytes / 2**20, 1), prefix_blocks=extra_blocks)
    if model.xp.__name__ == "cupy":  # what CuPy's allocator holds after weights and KV
        mempool = model.xp.get_default_memory_pool()
        _log("cupy memory pool", total_bytes=mempool.total_bytes(), used_bytes=mempool.used_bytes())
    gen = generation_config(source, cfg.model)  # a GGUF's from its metadata
    try:
        defaults = SamplingDefaults(**{k: gen[k] for k in ("temperature", "top_p", "top_k",
                                                           "min_p") if k in gen})
    except ValueError as exc:
        raise CheckpointError(f"{cfg.model}/generation_config.json: {exc}") from None
    info = ModelInfo(name=cfg.name or os.path.basename(os.path.normpath(cfg.model)),
                     vocab_size=mc.vocab_size, max_slots=cfg.max_slots,
                     max_context=cfg.max_context, eos_token_ids=list(gen["eos_token_ids"]),
                     generation_defaults=defaults, kv=layout,
                     synthetic_routing=model.routing is not None,
                     padded_passes=runner.graphs is not None and runner.graphs.scratch is not None)
    return runner, pool, info


def _memory_plan(cfg: WorkerConfig, source) -> tuple[MemoryPlan, ExpertSplit | None]:
    """The memory plan (gpu_worker/memory_plan.py), made before any weight is read and logged
    line by line, and the expert split it decides (None: every expert on the backend)."""
    backend = "cupy" if get_xp(cfg.backend).__name__ == "cupy" else "numpy"
    hot = load_counts(cfg.hot_experts, source.config) if cfg.hot_experts else None
    plan = plan_for_worker(cfg, source.config, backend=backend, hot_counts=hot)
    for line in describe(plan):
        _log("memory plan", line=line)
    if plan.placement == "gpu":
        return plan, None
    return plan, split_from_orders(dict(plan.expert_order), plan.experts_cpu_per_layer, hot)


def _host_cores(cfg: WorkerConfig, pool) -> list[int]:
    """The cores the GPU worker and the daemon keep to, off the CPU expert workers' (the
    GPU backend with CPU experts only: the NumPy backend computes on the host itself; none
    with ``[experts] pin_host = false``)."""
    if pool is None or cfg.backend == "numpy" or not cfg.pin_host:
        return []
    return host_cores(os.sched_getaffinity(0), pool.pool.cores)


class _Beat:
    """The worker's heartbeat: one Heartbeat per `interval` seconds while idle, and one
    after a step when it is due."""

    def __init__(self, sock: WorkerToDaemon, interval: float) -> None:
        self.sock, self.interval = sock, interval
        self.seq = 0
        self.due = time.monotonic() + interval

    def wait(self) -> float:
        """Seconds until the next heartbeat is due (what recv may wait)."""
        return max(self.due - time.monotonic(), 0.0)

    def send_if_due(self) -> None:
        if time.monotonic() < self.due:
            return
        try:  # NOTE: a daemon too busy to read may miss one; it never blocks the worker long
            self.sock.send(Heartbeat(seq=self.seq, time_ns=time.monotonic_ns()), timeout=1)
        except TimeoutError:
            pass
        self.seq += 1
        self.due = time.monotonic() + self.interval


def serve(cfg: WorkerConfig) -> int:
    _die_with_parent()
    if cfg.affinity:  # the daemon's start-up cores, not the host cores it keeps to now
        try:
            os.sched_setaffinity(0, cfg.affinity)
        except OSError as exc:  # (a core taken away since: the worker starts where it is)
            _log("affinity refused", cores=list(cfg.affinity), reason=str(exc))
    sock = WorkerToDaemon.in_run_dir(cfg.run_dir)
    try:
        runner, pool, info = build_runner(cfg)
    except (CheckpointError, ValueError, OSError, RuntimeError) as exc:
        sock.send(WorkerError(code=WorkerErrorCode.MODEL_LOAD, message=str(exc), fatal=True),
                  timeout=5)
        sock.close()
        return 1
    host = _host_cores(cfg, pool)
    if host:
        try:
            _log("host cores", process="gpu worker", **pin_host_process(host))
        except OSError as exc:  # the worker and the daemon run anywhere, as without
            _log("host cores refused", cores=host, reason=str(exc))
            host = []
    sock.send(ReadyMsg(protocol_version=PROTOCOL_VERSION, model=info, pid=os.getpid(),
                       host_cores=host), timeout=30)
    beat = _Beat(sock, cfg.heartbeat_s)
    try:
        while True:
            try:
                msg = sock.recv(timeout=beat.wait())
            except TimeoutError:
                beat.send_if_due()
                continue
            except ProtocolError as exc:
                sock.send(WorkerError(code=WorkerErrorCode.PROTOCOL, message=str(exc)))
                continue
            if isinstance(msg, Shutdown):
                _log("shutting down", reason=msg.reason)
                return 0
            if isinstance(msg, Ping):
                sock.send(Pong(nonce=msg.nonce, time_ns=msg.time_ns))
            elif not isinstance(msg, StepPlan):
                sock.send(WorkerError(code=WorkerErrorCode.PROTOCOL,
                                      message=f"unexpected {type(msg).__name__}"))
            else:
                try:
                    sock.send(_execute(runner, pool, msg))
                except _Fatal as fatal:
                    sock.send(fatal.error, timeout=2)
                    return 1
            beat.send_if_due()
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
        died = isinstance(exc, CpuWorkerDied)
        code = WorkerErrorCode.CPU_WORKER_DIED if died else WorkerErrorCode.INTERNAL
        traceback.print_exc(file=sys.stderr)
        err = WorkerError(code=code, message=f"{type(exc).__name__}: {exc}", fatal=True,
                          step_id=plan.step_id)
        raise _Fatal(err) from exc


class _Fatal(Exception):
    def __init__(self, error: WorkerError) -> None:
        super().__init__(error.message)
        self.error = error


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_worker.server")
    p.add_argument("--config", required=True,
                   help="a WorkerConfig as JSON (protocol/worker_config.py)")
    args = p.parse_args(argv)
    try:
        cfg = WorkerConfig.from_json(args.config)
    except ValueError as exc:
        p.error(f"--config: {exc}")
    return serve(cfg)


if __name__ == "__main__":
    sys.exit(main())

"""``tandem serve``: start the process tree, serve, restart a dead worker, shut down in order."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import sys

import zmq

from daemon import systemd
from daemon.api_http import API, make_app, start_site
from daemon.api_zmq import ZmqApi
from daemon.config import Config
from daemon.logs import configure_logging, get_logger
from daemon.metrics import Metrics
from daemon.metrics_budget import BudgetFigures
from daemon.prefix_cache import PrefixCache
from daemon.scheduler import Scheduler
from daemon.tokenizer import Tokenizer, TokenizerError
from daemon.worker_client import WorkerDied, WorkerProcess
from protocol.host_cores import pin_host_process
from protocol.messages import ModelInfo
from protocol.run_dir import RunDirError, open_lock, secure_run_dir
from protocol.worker_config import WorkerConfig

log = get_logger("tandem.lifecycle")
RESTART_BACKOFF_S = (0.5, 1, 2, 5, 10)
# the cores this process may run on at start: each GPU worker starts on them (the daemon
# keeps to the host cores once a worker reported them: keep_to_host_cores)
START_CORES = tuple(sorted(os.sched_getaffinity(0)))


def worker_config(config: Config) -> WorkerConfig:
    """What the GPU worker is started with, from the daemon's Config."""
    e, sched = config.experts, config.scheduler
    return WorkerConfig(run_dir=str(config.server.run_dir), model=str(config.model.path),
                        name=config.model.served_name, dtype=config.model.dtype,
                        backend=config.model.backend, max_slots=sched.max_slots,
                        max_context=sched.max_context, block_size=sched.kv_block_size,
                        kv_cache_dtype=sched.kv_cache_dtype, prefix_cache=sched.prefix_cache,
                        prefix_cache_max_mb=sched.prefix_cache_max_mb,
                        prefix_cache_host_mb=sched.prefix_cache_host_mb,
                        placement=e.placement, cpu_experts_per_layer=e.cpu_experts_per_layer,
                        cpu_workers=e.num_cpu_workers,
                        cpu_cores=tuple(tuple(g) for g in e.cpu_cores),
                        affinity=START_CORES, pin_host=e.pin_host,
                        cpu_isa=e.cpu_isa, cpu_format=e.cpu_format, gpu_format=e.gpu_format,
                        hot_experts=str(e.hot_experts or ""),
                        cpu_shard_cache=str(e.shard_cache or ""),
                        gpu_memory_gb=e.gpu_memory_gb, prefill_chunk=sched.prefill_chunk,
                        max_drafts=0 if config.speculation.mode == "off"
                        else config.speculation.num_drafts,
                        slot_routing=config.speculation.mode != "off"
                        and config.speculation.draft_budget == "adaptive",
                        draft_overlap=config.speculation.mode != "off"
                        and config.speculation.draft_overlap,
                        speculation_mode=config.speculation.mode,
                        cuda_graphs=config.model.cuda_graphs,
                        graph_warm_up=config.model.cuda_graph_warm_up,
                        graph_buckets=config.model.cuda_graph_buckets,
                        graph_mtp=config.model.cuda_graph_mtp,
                        mtp_drafts=config.speculation.num_drafts
                        if config.speculation.mode != "off"
                        and config.speculation.proposer == "mtp" else 0)


def keep_to_host_cores(cores: list[int]) -> None:
    """The daemon's threads onto the cores the GPU worker keeps to, off the CPU expert
    workers' (protocol/host_cores.pin_host_process; [] where it keeps to none). Cores outside
    the daemon's own (a worker that does not match it) are refused with a warning."""
    if not cores:
        return
    if not set(cores) <= set(START_CORES):
        log.warning("host cores refused", cores=cores, reason="not among the daemon's cores",
                    daemon_cores=list(START_CORES))
        return
    try:
        log.info("host cores", process="daemon", **pin_host_process(list(cores)))
    except OSError as exc:  # (a core taken away since: the daemon runs where it ran)
        log.warning("host cores refused", cores=cores, reason=str(exc))


def serve(config: Config) -> int:
    configure_logging(config.logging.level, config.logging.json,
                      log_prompts=config.logging.log_prompts)
    run_dir = config.server.run_dir
    try:
        secure_run_dir(run_dir)
        lock = open_lock(run_dir / "daemon.lock")
    except RunDirError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"tandem: error: another tandem daemon uses run_dir {run_dir} "
                  f"(set [server] run_dir to serve a second one)", file=sys.stderr)
            return 2
        try:
            return asyncio.run(Daemon(config).main())
        except ListenError as exc:
            print(f"tandem: error: {exc}", file=sys.stderr)
            return 2
    finally:
        os.close(lock)


class ListenError(RuntimeError):
    """An API cannot listen where the configuration says (e.g. the port is in use)."""


class Daemon:
    """The daemon process: HTTP + ZeroMQ front ends, the scheduler, the worker's supervisor."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.metrics = Metrics()
        self.metrics.watch_prefix_cache(lambda: self.scheduler.prefix)
        try:
            self.tokenizer = Tokenizer.from_dir(config.model.path)
        except TokenizerError as exc:
            log.warning("no tokenizer: text prompts are refused", error=str(exc))
            self.tokenizer = None
        # EOS ids and the prefix cache's size come with the worker's READY (adopt())
        eos = self.tokenizer.eos_token_ids if self.tokenizer else []
        sched = config.scheduler
        self.scheduler = Scheduler(
            max_slots=sched.max_slots, max_context=sched.max_context,
            max_queue=config.limits.max_queue, prefill_chunk=sched.prefill_chunk,
            block_size=sched.kv_block_size, checkpoint_interval=sched.checkpoint_interval,
            prefix_blocks=0, tokenizer=self.tokenizer, eos_ids=eos,
            metrics=self.metrics, model_name=config.model.served_name,
            preemption=sched.preemption, speculation=config.speculation,
            backend=config.model.backend, placement=config.experts.placement)
        self.metrics.registry.register(BudgetFigures(lambda: self.scheduler.draft_plan.budget))
        self.stopping = asyncio.Event()
        self.worker: WorkerProcess | None = None
        self.apis: list = []  # the front ends, told of each READY's ModelInfo

    def adopt(self, info: ModelInfo) -> None:
        """What the worker reported at READY: EOS ids (unless the tokenizer has its own),
        the prefix cache's share of the KV pool, vocabulary and sampling defaults, whether
        the model routes by SlotWork.route_key (a synthetic model: prefixes shared per key)
        and whether the worker pads its passes (the adaptive draft budget's step cost)."""
        if self.tokenizer is None:
            self.scheduler.eos_ids = frozenset(info.eos_token_ids)
        self.scheduler.vocab_size = info.vocab_size
        self.scheduler.route_keyed = info.synthetic_routing
        self.scheduler.draft_plan.worker_pads(info.padded_passes)
        kv = info.kv
        sched, old = self.config.scheduler, self.scheduler.prefix
        self.scheduler.prefix = (PrefixCache(kv.prefix_blocks, kv.block_size,
                                             block_bytes=kv.block_bytes,
                                             state_bytes=kv.state_bytes,
                                             max_bytes=sched.prefix_cache_max_mb * 2**20,
                                             host_max_bytes=sched.prefix_cache_host_mb * 2**20,
                                             hits=old.hits if old is not None else None)
                                 if kv.prefix_blocks else None)
        for api in self.apis:
            api.worker_ready(info)

    def worker_health(self) -> dict | None:
        return self.worker.health() if self.worker is not None else None

    async def main(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        app = make_app(self.scheduler, self.tokenizer, self.config, self.metrics,
                       worker_health=self.worker_health)
        server = self.config.server
        try:
            http = await start_site(app, self.config)
        except OSError as exc:
            raise ListenError(f"cannot listen on {server.host}:{server.port}: "
                              f"{exc.strerror or exc} (set [server] port, or stop what uses "
                              f"it)") from None
        try:
            zmq_api = ZmqApi(self.config, self.scheduler, self.tokenizer)
        except zmq.ZMQError as exc:
            await http.cleanup()
            raise ListenError(f"cannot listen on {server.zmq_endpoint or 'the client socket'}"
                              f": {exc}") from None
        self.apis = [app[API], zmq_api]
        zmq_task = asyncio.create_task(zmq_api.serve())
        log.info("http api listening", host=self.config.server.host,
                 port=self.config.server.port)
        log.info("zmq api listening", endpoint=zmq_api.address)
        supervisor = asyncio.create_task(self.supervise())
        healthy = (lambda: not supervisor.done()) if self.config.systemd.watchdog else None
        watchdog = asyncio.create_task(systemd.watchdog_loop(healthy) if healthy
                                       else asyncio.sleep(0))
        stop = asyncio.create_task(self.stopping.wait())
        await asyncio.wait({supervisor, stop}, return_when=asyncio.FIRST_COMPLETED)
        status = 0 if self.stopping.is_set() else 1
        if supervisor.done() and not supervisor.cancelled() and supervisor.exception():
            exc = supervisor.exception()
            log.error("the gpu worker cannot be served", error=str(exc),
                      exc_info=None if isinstance(exc, WorkerDied) else exc)
        # ordered shutdown: tell systemd, stop taking requests, stop the worker, close sockets
        systemd.notify(stopping=True, status="stopping")
        log.info("shutting down")
        await http.cleanup()
        for task in (supervisor, watchdog, zmq_task, stop):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.scheduler.detach("the server is shutting down")
        if self.worker is not None:
            await self.worker.stop()
        zmq_api.close()
        log.info("stopped")
        return status

    async def supervise(self) -> None:
        """Start the worker, serve until it dies, restart it; fail only if it never starts."""
        failures, announced = 0, False
        while not self.stopping.is_set():
            self.worker = WorkerProcess(worker_config(self.config),
                                        step_floor_s=self.config.limits.step_timeout_s,
                                        ready_timeout_s=self.config.limits.worker_ready_timeout_s)
            try:
                ready = await self.worker.start()
            except WorkerDied as exc:
                failures += 1
                log.error("gpu worker failed to start", error=str(exc), attempt=failures)
                if not announced or failures >= len(RESTART_BACKOFF_S):
                    raise
                await asyncio.sleep(RESTART_BACKOFF_S[failures - 1])
                continue
            failures = 0
            info = ready.model
            log.info("gpu worker ready", pid=ready.pid, model=info.name,
                     vocab=info.vocab_size, slots=info.max_slots,
                     kv_tokens=info.kv.capacity_tokens, prefix_blocks=info.kv.prefix_blocks,
                     placement=self.config.experts.placement, dtype=self.config.model.dtype,
                     backend=self.config.model.backend, padded_passes=info.padded_passes)
            keep_to_host_cores(ready.host_cores)
            self.adopt(info)
            self.scheduler.attach(self.worker)
            if not announced:
                systemd.notify(ready=True, status="serving")
                announced = True
            await self.serve_worker(self.worker)  # returns when the worker died or hung
            await self.worker.kill()
            if self.stopping.is_set():
                return
            self.metrics.worker_restarted("gpu_worker")
            log.warning("restarting the gpu worker")

    async def serve_worker(self, worker: WorkerProcess) -> None:
        """The scheduler's loop beside the worker's watch; returns when the worker died,
        hung or broke (in-flight requests have been failed with the reason)."""
        run = asyncio.create_task(self.scheduler.run())
        watch = asyncio.create_task(worker.watch())
        try:
            await asyncio.wait({run, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when shutdown cancels us: the watch must not outlive its worker
            for task in (run, watch):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        error = None if watch.cancelled() else watch.exception()
        if run.done() and not run.cancelled() and run.exception() is not None:
            error = run.exception()  # a fault of the loop itself: log it, restart
            log.error("scheduler loop failed", error=repr(error), exc_info=error)
        elif error is not None:
            log.error("gpu worker died", error=str(error))
        if self.scheduler.worker is not None:  # the loop did not detach: fail in-flight work
            self.scheduler.detach(f"the model worker died: {error}")

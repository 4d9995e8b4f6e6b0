"""``tandem serve``: start the process tree, serve, restart a dead worker, shut down in order."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import signal
import sys

from daemon import systemd
from daemon.api_http import make_app, start_site
from daemon.api_zmq import ZmqApi
from daemon.config import Config
from daemon.logs import configure_logging, get_logger
from daemon.metrics import Metrics
from daemon.scheduler import Scheduler
from daemon.tokenizer import Tokenizer, TokenizerError
from daemon.worker_client import WorkerDied, WorkerProcess, WorkerSpec
from gpu_worker.kv_cache import block_bytes
from gpu_worker.loader import load_generation_config
from gpu_worker.model_config import ModelConfig

log = get_logger("tandem.lifecycle")
RESTART_BACKOFF_S = (0.5, 1, 2, 5, 10)


def prefix_blocks(config: Config) -> int:
    """KV blocks the prefix cache may pin, from prefix_cache_max_mb and the model's shape."""
    sched = config.scheduler
    if not sched.prefix_cache:
        return 0
    cfg = ModelConfig.from_file(config.model.path / "config.json")
    layers = len(cfg.full_attention_layers) + min(cfg.num_mtp_layers, 1)  # MTP's KV: one more
    size = block_bytes(layers, sched.kv_block_size, cfg.num_key_value_heads, cfg.head_dim,
                       8 if config.model.dtype == "float64" else 4,
                       quant=sched.kv_cache_dtype == "int8")
    per_slot = -(-sched.max_context // sched.kv_block_size)
    return max(1, min(sched.prefix_cache_max_mb * 2**20 // max(size, 1),
                      4 * per_slot * sched.max_slots))


def worker_spec(config: Config, extra_blocks: int) -> WorkerSpec:
    e = config.experts
    return WorkerSpec(run_dir=config.server.run_dir, model=config.model.path,
                      name=config.model.served_name, dtype=config.model.dtype,
                      backend=config.model.backend, max_slots=config.scheduler.max_slots,
                      max_context=config.scheduler.max_context,
                      block_size=config.scheduler.kv_block_size, extra_blocks=extra_blocks,
                      kv_cache_dtype=config.scheduler.kv_cache_dtype,
                      placement=e.placement, cpu_experts_per_layer=e.cpu_experts_per_layer,
                      cpu_workers=e.num_cpu_workers,
                      cpu_cores=";".join(",".join(map(str, g)) for g in e.cpu_cores),
                      cpu_isa=e.cpu_isa, cpu_dispatch=e.cpu_dispatch,
                      hot_experts=str(e.hot_experts or ""))


def serve(config: Config) -> int:
    configure_logging(config.logging.level, config.logging.json,
                      log_prompts=config.logging.log_prompts)
    run_dir = config.server.run_dir
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(run_dir / "daemon.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"tandem: error: another tandem daemon uses run_dir {run_dir} "
                  f"(set [server] run_dir to serve a second one)", file=sys.stderr)
            return 2
        return asyncio.run(Daemon(config).main())


class Daemon:
    """The daemon process: HTTP + ZeroMQ front ends, the scheduler, the worker's supervisor."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.metrics = Metrics()
        try:
            self.tokenizer = Tokenizer.from_dir(config.model.path)
        except TokenizerError as exc:
            log.warning("no tokenizer: text prompts are refused", error=str(exc))
            self.tokenizer = None
        eos = self.tokenizer.eos_token_ids if self.tokenizer else \
            load_generation_config(config.model.path).get("eos_token_ids", [])
        sched = config.scheduler
        self.extra_blocks = prefix_blocks(config)
        self.scheduler = Scheduler(
            max_slots=sched.max_slots, max_context=sched.max_context,
            max_queue=config.limits.max_queue, prefill_chunk=sched.prefill_chunk,
            block_size=sched.kv_block_size, checkpoint_interval=sched.checkpoint_interval,
            prefix_blocks=self.extra_blocks, tokenizer=self.tokenizer, eos_ids=eos,
            metrics=self.metrics, model_name=config.model.served_name,
            preemption=sched.preemption, speculation=config.speculation)
        self.stopping = asyncio.Event()
        self.worker: WorkerProcess | None = None

    async def main(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        app = make_app(self.scheduler, self.tokenizer, self.config, self.metrics)
        http = await start_site(app, self.config)
        zmq_api = ZmqApi(self.config, self.scheduler, self.tokenizer)
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
            self.worker = WorkerProcess(worker_spec(self.config, self.extra_blocks))
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
            log.info("gpu worker ready", pid=ready.pid, model=ready.model.name,
                     vocab=ready.model.vocab_size, slots=ready.model.max_slots,
                     kv_tokens=ready.model.kv_capacity_tokens,
                     placement=self.config.experts.placement, dtype=self.config.model.dtype,
                     backend=self.config.model.backend)
            self.scheduler.attach(self.worker)
            if not announced:
                systemd.notify(ready=True, status="serving")
                announced = True
            await self.scheduler.run()  # returns when the worker died
            await self.worker.kill()
            if self.stopping.is_set():
                return
            self.metrics.worker_restarted("gpu_worker")
            log.warning("restarting the gpu worker")

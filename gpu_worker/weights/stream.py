"""Streaming placement: every tensor goes from a WeightSource straight to where it lives.

The placement (an ExpertSplit: which experts of each MoE layer the CPU workers hold) is
decided before any weight is read, and the CPU workers' shards are created at their final
size from the shapes alone. Then, in phases (one log line each, one tqdm bar over bytes):

* ``dense``: every tensor but the routed experts -> the backend (``ops.weight``), one at a
  time; a renumbered layer's router rows are read in the split's order.
* ``experts GPU``: each MoE layer's backend experts, only those rows, read a run of
  experts at a time into the stack that is uploaded (for a bf16 model rounded to bf16 as
  they arrive: the host never holds the stack in float32).
* ``experts CPU``: each MoE layer's CPU experts, a run at a time, quantized straight into
  the workers' shared-memory shards.
* ``workers ready``: the worker processes start on the filled shards (shards kept by an
  earlier load, ``[experts] shard_cache``: started before ``dense`` and awaited after
  ``experts GPU``, so they come up while the backend's weights are read).

The runs of experts are read, rounded or quantized and tiled on ``default_threads()`` threads at
once (synthetic generation, Numba's quantizer and bf16 rounding and NumPy's copies release
the GIL; an 80B load is hours of one core's work), about ``chunk_bytes`` of float32 in flight
among them. So the host holds the model's resident parts (on NumPy the backend is host
memory) plus one tensor or ``chunk_bytes`` of experts in flight, never the whole model in
float32.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from tqdm import tqdm

from gpu_worker.experts.split import EXPERT_KEYS, ExpertSplit
from gpu_worker.kernels.bf16 import BF16, default_threads, round_into
from gpu_worker.kernels.int8_stack import BLOCK as INT8_BLOCK
from gpu_worker.kernels.int8_stack import Int8Stack, quantize_stack
from gpu_worker.model.model import Model, is_stack
from gpu_worker.model.ops import is_matrix
from gpu_worker.weights.source import WeightSource

CHUNK_BYTES = 256 * 2**20  # host working set: float32 bytes of experts read at once
PROGRESS_MIN_BYTES = 64 * 2**20  # progress=None shows the bar above this
_MOE_LAYER = re.compile(r"^model\.layers\.(\d+)\.mlp\.")
Log = Callable[..., None]  # log(event, **fields)

_logger = logging.getLogger("tandem.load")


def default_log(event: str, **fields: Any) -> None:
    _logger.info("%s %s", event, fields)


def stream_load(source: WeightSource, split: ExpertSplit | None, *, xp: Any, dtype: Any,
                host_dtype: Any, exact: bool, pool_options: dict | None = None,
                progress: bool | None = None, log: Log | None = None,
                chunk_bytes: int = CHUNK_BYTES, gpu_int8: bool = False) -> tuple[Model, Any]:
    """The model on its backend and, with a ``split``, its started CPU experts (an
    :class:`ExpertPlacement` whose pool is made with ``pool_options``: num_workers, cores,
    isa). ``host_dtype``: the float dtype tensors are read in before ``ops.weight``;
    ``gpu_int8``: the backend's routed experts as int8 blocks of 32 (Int8Stack), quantized
    a run at a time as they are read."""
    log = log or default_log
    loader = _Loader(source, split, np.dtype(host_dtype), chunk_bytes, log,
                     bf16=np.dtype(dtype) == BF16, gpu_int8=gpu_int8)
    t0 = time.perf_counter()
    pool = loader.make_pool(pool_options or {})
    try:
        total = loader.backend_bytes_to_read() + (
            loader.cpu_bytes_to_read() if pool is None or not pool.cached else 0)
        show = progress if progress is not None else total > PROGRESS_MIN_BYTES
        name = source.path.name if source.path is not None else "weights"
        # Shards made by an earlier load need nothing from this one: the workers start on
        # them while the backend's weights are read (their start is seconds of one core).
        # (spawned from this thread: a worker dies with the thread that started it)
        early = ready = None
        if pool is not None and pool.cached:
            pool.launch(wait=False)
            early = ThreadPoolExecutor(1, thread_name_prefix="tandem-early-workers")
            started = time.perf_counter()
            ready = early.submit(lambda: pool.await_launch() or time.perf_counter())
        try:
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {name}",
                      disable=not show, file=sys.stderr) as bar:
                loader.bar = bar
                model = Model(source.config, loader.backend_tensors(), xp=xp, dtype=dtype,
                              exact=exact, routing=getattr(source, "routing", None))
                if pool is not None and not pool.cached:
                    loader.fill_cpu(pool)
        except BaseException:
            if early is not None:
                early.shutdown()  # waits for it; the pool closes below, its workers too
            raise
        experts = None
        if pool is not None:
            from gpu_worker.experts.placement import ExpertPlacement  # noqa: PLC0415 (numba)

            if early is not None:
                loaded = time.perf_counter()
                try:
                    ready_at = ready.result()  # its error, if any, is raised here
                finally:
                    early.shutdown()
                loader.log("load workers ready", bytes=0,
                           seconds=round(ready_at - started, 3), workers=pool.num_workers,
                           during_load=True,
                           waited_after_load=round(max(ready_at - loaded, 0.0), 3))
            else:
                with loader.phase("workers ready", 0, workers=pool.num_workers):
                    pool.launch()
            experts, pool = ExpertPlacement.start(model, split, pool), None
    finally:
        if pool is not None:
            pool.close()
    log("model loaded", backend_bytes=resident_bytes(model),
        cpu_bytes=experts.pool.shard_bytes if experts else 0,
        seconds=round(time.perf_counter() - t0, 3))
    return model, experts


def resident_bytes(model: Model) -> int:
    """Bytes of the model's weights on its backend (each array once)."""
    arrays: dict[int, Any] = {}
    def own(d: dict[str, Any]) -> list[Any]:  # an input stack is counted by its views
        return [a for k, a in d.items() if not is_stack(k)]

    parts = [model.embed, model.lm_head, model.final_norm, *own(model.mtp or {})]
    for layer in [*model.layers, *([model.mtp_layer] if model.mtp_layer else [])]:
        parts += [layer.input_norm, layer.post_norm, *own(layer.attn), *own(layer.mlp)]
    for a in parts:
        arrays[id(a)] = a
    return sum(int(a.nbytes) for a in arrays.values())


class _Loader:
    """One streaming load: what goes where, the reads, the phase log lines."""

    def __init__(self, source: WeightSource, split: ExpertSplit | None, host_dtype: np.dtype,
                 chunk_bytes: int, log: Log, *, bf16: bool = False,
                 threads: int | None = None, gpu_int8: bool = False) -> None:
        self.source, self.split, self.host_dtype = source, split, host_dtype
        self.chunk_bytes, self.log = chunk_bytes, log
        # bf16: matrices in bf16
        self.bf16, self.threads = bf16, max(1, threads or default_threads())
        self.gpu_int8 = gpu_int8  # the backend's routed experts as int8 blocks
        self.cfg = source.config
        self.shapes = source.shapes()  # validated by the source before any data is read
        tied = self.cfg.tie_word_embeddings
        self.experts = [n for n in self.shapes if ".mlp.experts." in n]
        self.dense = [n for n in self.shapes
                      if ".mlp.experts." not in n and not (tied and n == "lm_head.weight")]
        self.bar: Any = None
        self._bar_lock = threading.Lock()  # runs on threads advance the one bar

    def advance(self, nbytes: int) -> None:
        with self._bar_lock:
            self.bar.update(nbytes)

    # -- what goes where ------------------------------------------------------------------
    def _layer(self, name: str) -> int | None:
        """The MoE layer a tensor of the split belongs to (None: not split, e.g. MTP)."""
        m = _MOE_LAYER.match(name)
        layer = int(m.group(1)) if m else None
        return layer if self.split is not None and layer in self.split.order else None

    def _gpu_ids(self, name: str) -> np.ndarray:
        layer = self._layer(name)
        return np.arange(self.shapes[name][0]) if layer is None else self.split.gpu_ids(layer)

    def _part_bytes(self, name: str, n: int) -> int:
        """Stored bytes of ``n`` experts of stacked tensor ``name``."""
        return self.source.nbytes(name) * n // max(1, self.shapes[name][0])

    def backend_bytes_to_read(self) -> int:
        return (sum(self.source.nbytes(n) for n in self.dense)
                + sum(self._part_bytes(n, len(self._gpu_ids(n))) for n in self.experts))

    def cpu_bytes_to_read(self) -> int:
        if self.split is None:
            return 0
        return sum(self._part_bytes(f"model.layers.{i}.mlp.experts.{k}", self.split.n_cpu[i])
                   for i in self.split.order for k in EXPERT_KEYS)

    def make_pool(self, options: dict) -> Any:
        """The CPU workers' pool with its shards made at their final size (no workers yet),
        and the ``plan`` log line; None without a split."""
        split, cfg = self.split, self.cfg
        t0 = time.perf_counter()
        pool = None
        if split is not None:
            from cpu_experts.pool import CpuExpertPool  # noqa: PLC0415 (numba, when used)
            from cpu_experts.shard import LayerShape  # noqa: PLC0415

            shapes = {i: LayerShape(split.n_cpu[i], cfg.moe_intermediate_size, cfg.hidden_size)
                      for i in split.order}
            cache = options.get("shard_cache")
            if cache:  # the shards' bytes follow from the source and the CPU experts' ids
                from gpu_worker.weights.fingerprint import source_facts  # noqa: PLC0415

                cache = (cache, {"source": source_facts(self.source), "cpu_ids": {
                    str(i): split.cpu_ids(i).tolist() for i in sorted(split.order)}})
            pool = CpuExpertPool(shapes, num_workers=options.get("num_workers") or None,
                                 cores=options.get("cores") or None, isa=options.get("isa"),
                                 weight_format=options.get("weight_format", "int8"),
                                 shard_cache=cache or None)
        n_cpu = sorted(set(split.n_cpu.values())) if split else [0]
        self.log("load plan", bytes=self.backend_bytes_to_read() + self.cpu_bytes_to_read(),
                 seconds=round(time.perf_counter() - t0, 3),
                 dense_bytes=sum(self.source.nbytes(n) for n in self.dense),
                 experts_gpu_per_layer=[cfg.num_experts - n for n in n_cpu],
                 experts_cpu_per_layer=n_cpu,
                 cpu_bytes=pool.shard_bytes if pool is not None else 0,
                 workers=pool.num_workers if pool is not None else 0,
                 cpu_shards_cached=bool(pool is not None and pool.cached))
        return pool

    # -- phases ---------------------------------------------------------------------------
    def phase(self, name: str, nbytes: int, **fields: Any) -> _Phase:
        return _Phase(self, name, nbytes, fields)

    def backend_tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(name, host array) of everything the backend holds, one at a time: dense, then
        each layer's backend experts."""
        with self.phase("dense", sum(self.source.nbytes(n) for n in self.dense)):
            for name in self.dense:
                arr = self.source.read(name, self.host_dtype)
                layer = self._layer(name)
                if layer is not None and name.endswith(".mlp.gate.weight"):
                    arr = arr[self.split.order[layer]]  # router rows [E, H] in the new order
                self.bar.update(self.source.nbytes(name))
                yield name, arr
        done = sum(self._part_bytes(n, len(self._gpu_ids(n))) for n in self.experts)
        with self.phase("experts GPU", done):
            for name in self.experts:
                ids = self._gpu_ids(name)
                read = self._read_int8 if self.gpu_int8 else self._read_stack
                yield name, read(name, ids)

    def _runs(self, n: int, per_expert: int) -> list[tuple[int, int]]:
        """``n`` experts of ``per_expert`` float bytes each as runs ``(a, b)`` for the
        threads: about ``chunk_bytes`` in flight among them (at least one expert a run)."""
        step = max(1, self.chunk_bytes // max(1, per_expert * self.threads))
        return [(a, min(n, a + step)) for a in range(0, n, step)]

    def _on_threads(self, job: Callable[..., None], runs: list[tuple[int, ...]]) -> None:
        """``job(*run)`` for every run, on up to :attr:`threads` threads; the first error
        is raised once the runs in flight have finished (the others never start)."""
        if self.threads == 1 or len(runs) <= 1:
            for run in runs:
                job(*run)
            return
        with ThreadPoolExecutor(min(self.threads, len(runs))) as pool:
            futures = [pool.submit(job, *run) for run in runs]
            try:
                for f in futures:
                    f.result()
            except BaseException:
                for f in futures:
                    f.cancel()
                raise

    def _each_run(self, name: str, ids: np.ndarray, itemsize: int,
                  put: Callable[[int, int], None]) -> None:
        """``put(a, b)`` (read experts ``ids[a:b]`` of ``name`` and store them) for each run
        of experts, on threads, counting each run's bytes as it finishes."""
        per = int(np.prod(self.shapes[name][1:])) * itemsize

        def job(a: int, b: int) -> None:
            put(a, b)
            self.advance(self._part_bytes(name, b - a))

        self._on_threads(job, self._runs(len(ids), per) or [(0, 0)])  # none: an empty read

    def _read_stack(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Experts ``ids`` of stacked tensor ``name`` (in that order), read a run at a time
        on threads; for a bf16 model rounded into a ``ml_dtypes.bfloat16`` stack as they
        arrive (what ``ops.weight`` stores), else in ``host_dtype``."""
        shape = self.shapes[name]
        rounded = self.bf16 and is_matrix(name, shape) and self.host_dtype == np.float32
        out = np.empty((len(ids), *shape[1:]), BF16 if rounded else self.host_dtype)

        def put(a: int, b: int) -> None:
            part = self.source.read(name, self.host_dtype, experts=ids[a:b])
            if rounded:
                round_into(part, out[a:b], threads=1)
            else:
                out[a:b] = part

        self._each_run(name, ids, self.host_dtype.itemsize, put)
        return out

    def _read_int8(self, name: str, ids: np.ndarray) -> Int8Stack:
        """Experts ``ids`` of stacked tensor ``name`` as int8 blocks of 32, read as float32
        and quantized by the CPU experts' int8 rule a run at a time on threads."""
        shape = self.shapes[name]
        q = np.empty((len(ids), *shape[1:]), np.int8)
        d = np.empty((len(ids), shape[1], shape[2] // INT8_BLOCK), np.uint16)

        def put(a: int, b: int) -> None:
            part = quantize_stack(self.source.read(name, np.float32, experts=ids[a:b]))
            q[a:b], d[a:b] = part.q, part.d

        self._each_run(name, ids, 4, put)
        return Int8Stack(q, d)

    def fill_cpu(self, pool: Any) -> None:
        """Each layer's CPU experts, a run at a time on threads (one set of threads for
        every layer: no idle tail per layer), quantized into the pool's shards (each run
        writes its own experts' bytes: the same bytes in any order)."""
        cfg, split = self.cfg, self.split
        per = 3 * cfg.moe_intermediate_size * cfg.hidden_size * 4  # float32 gate+up+down

        def job(layer: int, a: int, b: int) -> None:
            ids, p = split.cpu_ids(layer)[a:b], f"model.layers.{layer}.mlp.experts."
            stacks = [self._cpu_stack(p + k, ids) for k in EXPERT_KEYS]
            pool.fill(layer, a, *stacks)
            self.advance(sum(self._part_bytes(p + k, b - a) for k in EXPERT_KEYS))

        runs = [(layer, a, b) for layer in sorted(split.order)
                for a, b in self._runs(split.n_cpu[layer], per)]
        with self.phase("experts CPU", self.cpu_bytes_to_read(), cpu_bytes=pool.shard_bytes,
                        threads=self.threads):
            self._on_threads(job, runs)

    def _cpu_stack(self, name: str, ids: np.ndarray) -> Any:
        """Experts ``ids`` of ``name`` for ``pool.fill``: the blocks of 32 the source stores
        where it has them (a GGUF's Q8_0 / Q4_0 as cpu_experts.formats.Blocks, held without
        a second rounding where the pool's format allows), else float32."""
        read_blocks = getattr(self.source, "read_blocks", None)
        blocks = read_blocks(name, ids) if read_blocks is not None else None
        return blocks if blocks is not None else self.source.read(name, np.float32,
                                                                   experts=ids)


class _Phase:
    """Times one phase and logs it: ``load <name>`` with bytes read and seconds."""

    def __init__(self, loader: _Loader, name: str, nbytes: int, fields: dict) -> None:
        self.loader, self.name, self.nbytes, self.fields = loader, name, nbytes, fields

    def __enter__(self) -> _Phase:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.loader.log(f"load {self.name}", bytes=self.nbytes,
                            seconds=round(time.perf_counter() - self.t0, 3), **self.fields)

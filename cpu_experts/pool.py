"""CpuExpertPool: the GPU worker's handle on its cpu_experts processes.

It quantizes and shards the CPU-resident experts (by intermediate dimension, one shard per
worker) straight into shared memory made at its final size, a run of experts at a time, starts
one pinned worker process per shard (cpu_experts/processes.py), and dispatches one MoE layer
for all rows at once: activations are quantized straight into the shared ring, every worker
computes its partial ``sum_k w * expert_k(x)``, and the partials are summed here in worker
order. A GPU may drive the same ring itself (gpu_worker/experts/pinned_ring.py).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
import weakref
from collections.abc import Callable

import numpy as np

from cpu_experts import isa as cpu_isa
from cpu_experts import pool_checks as pc
from cpu_experts import rings, shard
from cpu_experts.cores import default_core_groups
from cpu_experts.dispatch_timer import DispatchTimer
from cpu_experts.errors import ERR_OK, status_error
from cpu_experts.formats import Blocks, check_format
from cpu_experts.processes import ShardFiles, WorkerProcesses
from cpu_experts.quant import BLOCK, quantize_rows_into, raise_non_finite
from cpu_experts.shard import LayerShape, QuantizedLayer

CHECK_EVERY_NS = 5_000_000  # how often a host wait checks that the workers live


class CpuExpertPool:
    """Worker processes computing the CPU-resident experts of every MoE layer.

    ``layers``: ``{layer: (gate [E, I, H], up [E, I, H], down [E, H, I])}`` float arrays, or a
    :class:`QuantizedLayer` per layer: quantized into the shards and the workers started here.
    Or a :class:`LayerShape` per layer (streaming load): the shards are made at their final
    size, :meth:`fill` writes the experts a run at a time and :meth:`launch` starts the
    workers. ``num_workers``: processes (None: one per NUMA node);
    ``cores``: one core list per worker (None: :func:`default_core_groups`).
    ``max_rows`` x ``max_k``: the ring's capacity per load (more rows go in several loads).
    ``isa``: the kernels' instruction set (cpu_experts/isa.py: ``portable``, ``avx2``,
    ``avx512vnni``; None: ``$TANDEM_CPU_ISA`` or the best this CPU has); every choice gives the
    same bits. ``prefetch_bytes``: how far ahead the kernels prefetch weights (None: default).
    ``weight_format``: "int8" (1.125 bytes per weight) or "int4" (0.5625; cpu_experts/formats.py).
    ``shard_cache``: (directory, facts the weights follow from): shards kept between runs
    (shard_cache.py); :attr:`cached`: an earlier pool made them, nothing is written.
    :attr:`layers` reads back what the workers hold (:class:`shard.TiledLayer`).
    """

    def __init__(self, layers: dict, *, num_workers: int | None = None,
                 cores: list[list[int]] | None = None, max_rows: int = 256,
                 max_k: int = 16, spin_us: float = 2000.0, start_timeout: float = 600.0,
                 isa: str | None = None, prefetch_bytes: int | None = None,
                 weight_format: str = "int8", shard_cache: tuple | None = None) -> None:
        self.isa = cpu_isa.NAMES[cpu_isa.select(isa)]  # a ValueError here, before any process
        self.weight_format = check_format(weight_format)
        if prefetch_bytes is not None and not 0 <= prefetch_bytes <= 1 << 20:
            raise ValueError(f"prefetch_bytes={prefetch_bytes}: want 0..1 MiB")
        self.prefetch_bytes = prefetch_bytes
        self._procs = WorkerProcesses()
        self._finalizer = weakref.finalize(self, self._procs.release)
        if not layers:
            raise ValueError("no layers given")
        shapes = {int(k): shard.layer_shape(v) for k, v in layers.items()}
        hidden = {s.hidden for s in shapes.values()}
        if len(hidden) != 1:
            raise ValueError(f"layers disagree on the hidden size: {sorted(hidden)}")
        self.hidden = hidden.pop()
        if cores is None:
            cores = default_core_groups(num_workers)
        if num_workers is not None and len(cores) != num_workers:
            raise ValueError(f"num_workers={num_workers} but {len(cores)} core groups given")
        self.cores = [sorted(int(c) for c in group) for group in cores]
        self.num_workers = len(self.cores)
        self.max_rows, self.max_k = max_rows, max_k
        self.bounds = [{layer: shard.shard_bounds(s.intermediate, self.num_workers)[w]
                        for layer, s in shapes.items()} for w in range(self.num_workers)]
        self._seq = 0
        self.timer: DispatchTimer | None = None  # set one to time host dispatches (benchmarks)
        # called once per host load between ringing the workers and awaiting them (the MTP
        # drafter's deferred work, gpu_worker/draft_overlap.py); None: nothing to do meanwhile
        self.while_waiting: Callable[[], None] | None = None
        self._in_flight: tuple[int, int] | None = None
        self._device = False  # a device session is open (device_begin)
        self._watchdog: threading.Thread | None = None  # started by the first device session
        self._session = threading.Event()  # the watchdog's view of _device
        self._spin_us, self._start_timeout = spin_us, start_timeout
        ring_size = rings.Ring.size(self.num_workers, max_rows, self.hidden, max_k)
        try:
            self._files: ShardFiles | None = ShardFiles(self._procs, shapes, self.bounds,
                                                        ring_size, self.weight_format,
                                                        shard_cache)
            self.cached = self._files.cached
            self.layers = self._files.layers
            self.shard_bytes = sum(self._files.sizes)  # the CPU experts' resident memory
            self.ring = rings.Ring(self._procs.files[0].buf, self.num_workers, max_rows,
                                   self.hidden, max_k)
            given = {int(k): v for k, v in layers.items() if not isinstance(v, LayerShape)}
            if given and len(given) != len(layers):
                raise ValueError("give every layer's weights, or only LayerShapes")
            for layer, v in given.items() if not self.cached else ():  # a layer at a time
                self.write(layer, 0, v if isinstance(v, QuantizedLayer)
                           else shard.quantize_layer(*v, self.weight_format))
            if given:
                self.launch()
        except BaseException:
            self.close()
            raise

    # -- lifecycle --------------------------------------------------------------------------

    def fill(self, layer: int, first: int, gate: np.ndarray | Blocks, up: np.ndarray | Blocks,
             down: np.ndarray | Blocks) -> None:
        """Experts ``first..`` of ``layer`` straight into every worker's shard, before
        :meth:`launch`. Each of ``gate/up [n, I, H]``, ``down [n, H, I]`` is a float array
        (quantized here by the canonical rule of :attr:`weight_format`) or a
        :class:`formats.Blocks` already quantized (a GGUF's Q8_0 / Q4_0): held as they are
        where the format allows, else converted (quant4.to_format)."""
        self.write(layer, first, shard.quantize_layer(gate, up, down, self.weight_format))

    def write(self, layer: int, first: int, ql: QuantizedLayer) -> None:
        """Tile canonical experts ``first..`` of ``layer`` (int8 values; int4 pools: in
        [-8, 7]) into every worker's shard."""
        if self._files is None:
            raise RuntimeError("the workers run already: shards are written before launch()")
        self._files.write(layer, first, ql)

    def launch(self, wait: bool = True) -> None:
        """Once every expert is written: unmap the shards here and start one worker per
        shard; returns when all are READY (shared names unlinked then). ``wait=False``: all
        start at once, and :meth:`await_launch` (any thread) waits for them."""
        files, self._files = self._files, None
        if files is None:
            raise RuntimeError("launch() once")
        files.seal()
        common = {"parent_pid": os.getpid(), "num_workers": self.num_workers,
                  "max_rows": self.max_rows, "hidden": self.hidden, "max_k": self.max_k,
                  "spin_us": self._spin_us, "isa": self.isa}
        if self.prefetch_bytes is not None:
            common["prefetch_bytes"] = self.prefetch_bytes
        self._procs.launch(files.specs(common, self.cores), self._start_timeout, wait)

    def await_launch(self) -> None:
        self._procs.await_launch()

    def check_alive(self) -> None:
        """Raise :class:`CpuWorkerDied` naming the first worker that has exited."""
        self._procs.check_alive()

    @property
    def ready_info(self) -> list[dict]:
        """Each worker's READY line: pid, threads, isa, cores, weights_mib..."""
        return self._procs.ready_info

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs.procs]

    def close(self, timeout: float = 5.0) -> None:
        """Stop the workers (politely, then by force) and release shared memory. Idempotent."""
        self.device_end()
        if self._watchdog is not None:
            self._procs.stop.set()
            self._watchdog.join()
            self._watchdog = None
        procs = self._procs.procs
        if self._procs.all_alive() and hasattr(self, "ring"):
            self.ring.header[rings.CMD] = rings.CMD_STOP
            self._ring_all()
            deadline = time.monotonic() + timeout
            for p in procs:
                try:
                    p.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        self._finalizer()

    def __enter__(self) -> CpuExpertPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- dispatch ---------------------------------------------------------------------------

    def dispatch(self, layer: int, x: np.ndarray, expert_ids: np.ndarray,
                 weights: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``x [R, H]`` float -> ``[R, H] float32`` = sum_k weights[r, k] * expert_{ids[r, k]}(x[r])
        over the pairs with ``expert_ids >= 0`` (-1: not on the CPU, skipped). ``out``: an
        optional C-contiguous float32 ``[R, H]`` array to write (and return) instead of a new
        one (a reused buffer saves the page faults of a fresh one per layer)."""
        if self.timer:
            self.timer.called()
        self._not_in_flight()
        x = np.asarray(x)
        if x.ndim != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x must be [rows, {self.hidden}], got {x.shape}")
        ids, w, E = pc.check_pairs(self.layers, self.max_k, layer, x.shape[0], expert_ids, weights)
        pc.check_all_ids(layer, ids, E, self.max_rows)
        x32 = np.ascontiguousarray(x, dtype=np.float32)  # [R, H]
        out = pc.out_array(out, x.shape[0], self.hidden)  # [R, H]
        ring = self.ring
        for rs in pc.load_slices(x.shape[0], self.max_rows):
            xl, il, wl, ol = pc.rows(rs, x32, ids, w, out)
            bad = quantize_rows_into(xl, ring.xq, ring.xd, xl.shape[0])
            if bad >= 0:
                raise_non_finite(xl, bad)
            if pc.fill_pairs(il, wl, ring.ids, ring.w, E) >= 0:
                raise pc.ids_out_of_range(layer, E)
            self._run(layer, xl.shape[0], ids.shape[1], ol)
        return out

    def dispatch_quantized(self, layer: int, q: np.ndarray, scales: np.ndarray,
                           expert_ids: np.ndarray, weights: np.ndarray,
                           out: np.ndarray | None = None) -> np.ndarray:
        """Like :meth:`dispatch` for activations already quantized by the canonical rule
        (e.g. by the fused GPU kernel): ``q [R, H] int8``, ``scales [R, H/32]`` float16 (or
        their uint16 bits)."""
        if self.timer:
            self.timer.called()
        self._not_in_flight()
        R = q.shape[0]
        if q.shape != (R, self.hidden) or q.dtype != np.int8:
            raise ValueError(f"q must be int8 [rows, {self.hidden}], got {q.dtype} {q.shape}")
        if scales.shape != (R, self.hidden // BLOCK) or scales.dtype.itemsize != 2:
            raise ValueError(f"scales must be float16 [rows, {self.hidden // BLOCK}], got "
                             f"{scales.dtype} {scales.shape}")
        ids, w, E = pc.check_pairs(self.layers, self.max_k, layer, R, expert_ids, weights)
        pc.check_all_ids(layer, ids, E, self.max_rows)
        bits = scales.view(np.uint16)
        out = pc.out_array(out, R, self.hidden)
        ring = self.ring
        for rs in pc.load_slices(R, self.max_rows):
            ql, bl, il, wl, ol = pc.rows(rs, q, bits, ids, w, out)
            if pc.fill_load(ql, bl, il, wl, ring.xq, ring.xd, ring.ids, ring.w, E) >= 0:
                raise pc.ids_out_of_range(layer, E)
            self._run(layer, ql.shape[0], ids.shape[1], ol)
        return out

    def _ring_all(self) -> None:
        self._seq += 1
        ctrl = self.ring.ctrl
        for w, bell in enumerate(self._procs.doorbells):
            ctrl[w, rings.SEQ_IN] = self._seq
            bell.ring()

    # -- split dispatch: the caller fills the ring itself (a GPU by DMA), starts, finishes ---

    def ring_region(self) -> tuple[int, int]:
        """``(address, bytes)`` of the shared ring in this process, for a caller that pins it
        (``cudaHostRegister``) so a GPU copies activations in and partials out by DMA."""
        return self.ring.ctrl.ctypes.data, self.ring.nbytes

    def inputs(self, rows: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Views of the ring's input regions for one load: ``xq [rows, H] int8``, ``xd [rows,
        H/32] uint16`` (fp16 bits of the canonical quantizer's scales), ``ids [rows, k] int32``
        (pool-local expert ids, -1 = skip) and ``w [rows, k] float32``; each one contiguous.
        Write them, then :meth:`start`. Not while a load is in flight."""
        self._check_load(rows, k)
        ids, w = self.ring.pairs(rows, k)
        return self.ring.xq[:rows], self.ring.xd[:rows], ids, w

    def _not_in_flight(self) -> None:
        if self._device:
            raise RuntimeError("a GPU drives the ring: device_end() first")
        if self._in_flight:
            raise RuntimeError("a dispatch is in flight: finish() it first")

    def _check_load(self, rows: int, k: int) -> None:
        """A load the ring can hold, and none in flight."""
        self._not_in_flight()
        if not 0 < rows <= self.max_rows or not 0 < k <= self.max_k:
            raise ValueError(f"rows={rows}, k={k}: want 1..{self.max_rows} rows and "
                             f"1..{self.max_k} experts per row")

    def start(self, layer: int, rows: int, k: int) -> None:
        """Start the workers on the ``rows`` x ``k`` load already in :meth:`inputs`; returns
        at once. Expert ids are checked by the workers (:meth:`finish` raises
        :class:`CpuExpertError` on a bad one)."""
        if layer not in self.layers:
            raise KeyError(f"layer {layer} has no CPU experts (have {sorted(self.layers)})")
        self._check_load(rows, k)
        if self.timer:
            self.timer.entered()
        self.ring.header[:4] = (rings.CMD_RUN, layer, rows, k)
        if self.timer:
            self.timer.rang()
        self._ring_all()
        self._in_flight = (layer, rows)

    def finish(self) -> np.ndarray:
        """Wait for the load started by :meth:`start`; return the workers' partial outputs
        ``[W, rows, H] float32``, a view of the ring valid until the next :meth:`start` (the
        layer's output is their sum in worker order)."""
        if not self._in_flight:
            raise RuntimeError("no dispatch in flight")
        layer, rows = self._in_flight
        try:
            self._await(self._seq)
        finally:
            self._in_flight = None
        ctrl = self.ring.ctrl
        if self.timer:
            self.timer.seen(ctrl)
        bad = [int(c) for c in ctrl[:self.num_workers, rings.STATUS] if c != ERR_OK]
        if bad:  # the first worker's error
            raise status_error(layer, bad[0])
        return self.ring.out[:, :rows]

    def _run(self, layer: int, rows: int, k: int, out: np.ndarray) -> None:
        """One dispatch of ``rows`` rows whose activations and pairs are already in the ring."""
        self.start(layer, rows, k)
        try:
            if self.while_waiting is not None:
                self.while_waiting()
        finally:
            parts = self.finish()
        np.copyto(out, parts[0])
        for wk in range(1, self.num_workers):
            out += parts[wk]
        if self.timer:
            self.timer.summed()

    # -- device session: a GPU writes the ring and rings the workers itself -----------------

    def device_begin(self) -> None:
        """Hand the ring to a GPU until :meth:`device_end` (gpu_worker/experts/pinned_ring.py):
        the workers spin on ``SEQ_IN`` without a deadline (a kernel's store starts them, no
        eventfd), and a watchdog thread sets ``header[ABORT]`` as soon as a worker dies, so a
        kernel waiting on ``SEQ_OUT`` gives up. The GPU takes sequence numbers from
        :meth:`next_seq`. Host dispatches raise meanwhile. Idempotent."""
        if self._device:
            return
        self._not_in_flight()
        header = self.ring.header
        header[rings.ABORT] = 0
        header[rings.SPIN] = 1
        for bell in self._procs.doorbells:  # wake the sleepers: they see SPIN and spin
            bell.ring()
        self._device = True
        self._session.set()
        if self._watchdog is None:  # one thread for the pool's life, idle between sessions
            self._watchdog = self._procs.start_watchdog(self._session, self.ring.header)

    def next_seq(self, n: int = 1) -> int:
        """The sequence number of the next load a GPU starts (it writes it to ``SEQ_IN``);
        ``n``: reserve that many consecutive ones (a CUDA graph's loads), the first returned."""
        if not self._device:
            raise RuntimeError("no device session: device_begin() first")
        self._seq += n
        return self._seq - n + 1

    def device_end(self) -> None:
        """End a device session (the caller has synchronized the GPU): the workers go back to
        spinning briefly, then sleeping on their doorbells. Idempotent."""
        if self._device:
            self._device = False
            self._session.clear()
            self.ring.header[rings.SPIN] = 0

    @property
    def aborted(self) -> bool:
        """Whether the watchdog saw a worker die during the device session."""
        return bool(self.ring.header[rings.ABORT])

    def kernel_total_ns(self) -> np.ndarray:
        """Each worker's kernel time summed over every load it served, ns."""
        return self.ring.ctrl[:, rings.KERNEL_SUM].copy()

    @property
    def last_kernel_ns(self) -> np.ndarray:
        """Each worker's kernel time of the last load, ns (benchmarks)."""
        return self.ring.ctrl[:, rings.KERNEL_NS].copy()

    def _await(self, seq: int) -> None:
        ctrl = self.ring.ctrl
        W = self.num_workers
        next_check = time.perf_counter_ns() + CHECK_EVERY_NS
        while True:
            done = 0
            for w in range(W):
                if ctrl[w, rings.SEQ_OUT] == seq:
                    done += 1
            if done == W:
                return
            # NOTE: no sleep here: a 50 us sleep costs ~100 us of latency per dispatch. Yield
            # instead, so a worker thread sharing this core (small machines) still runs.
            os.sched_yield()
            now = time.perf_counter_ns()
            if now > next_check:
                self.check_alive()
                next_check = now + CHECK_EVERY_NS


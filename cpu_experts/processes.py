"""The worker processes of one CpuExpertPool and everything else it must release.

Held apart from the pool (no reference back to it) so that the pool's finalizer and its
watchdog thread can run while an unclosed pool is being collected.
"""

from __future__ import annotations

import json
import mmap
import os
import select
import shutil
import subprocess
import sys
import threading

import numpy as np

from cpu_experts import rings, shard, shard_cache
from cpu_experts.errors import CpuWorkerDied

WATCH_EVERY_S = 0.005  # how often a device session's watchdog looks at the workers


class WorkerProcesses:
    """``python -m cpu_experts.worker`` processes, their shared files and doorbells."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.files: list[rings.SharedFile] = []
        self.doorbells: list[rings.Doorbell] = []
        self.stop = threading.Event()  # ends the watchdog thread
        self.ready_info: list[dict] = []  # each worker's READY line
        self.fds: list[int] = []  # per shard: written through (ShardFiles.write), then a
        # read-only handle on the unlinked file (ShardFiles.read)
        self.entries: list = []  # shard cache entries in use (shard_cache.CacheEntry)
        self.timeout = 0.0  # seconds a worker has to say READY (set by launch)

    def launch(self, specs: list[dict], timeout: float, wait: bool = True) -> None:
        """Start a worker per spec and wait for each READY (:meth:`await_launch`). Worker 0
        goes first: it compiles the kernels into Numba's cache; the rest load them. Without
        ``wait`` they all start at once and :meth:`await_launch` (on any thread) waits."""
        self.timeout = timeout
        self.spawn(specs[0])
        if wait:
            self.await_ready(0, timeout)
        for spec in specs[1:]:
            self.spawn(spec)
        if wait:
            self.await_launch()

    def await_launch(self) -> None:
        """Wait for the READY of every worker not yet ready; then unlink every shared file
        (nothing leaks in /dev/shm even if this process is killed) and drop the shards from
        :attr:`files` (``files[0]``, the ring, stays mapped)."""
        for w in range(len(self.ready_info), len(self.procs)):
            self.await_ready(w, self.timeout)
        for f in self.files[1:]:  # workers hold the weights now
            f.unlink()
            f.close()
        self.files[0].unlink()
        self.files = self.files[:1]

    def spawn(self, spec: dict) -> None:
        """Start one worker on ``spec`` (sent as one JSON line on its stdin)."""
        # NOTE: OpenMP threads spin ~ms between the kernel's parallel loops (as the worker's
        # own doorbell spin does) instead of sleeping; an explicit GOMP_SPINCOUNT wins.
        env = {"GOMP_SPINCOUNT": "3000000", **os.environ}
        env["NUMBA_NUM_THREADS"] = str(max(1, len(spec["cores"])))
        # NOTE: cpu_experts is an installed package (pip install -e .): the child finds it
        # from any working directory, no PYTHONPATH needed
        proc = subprocess.Popen([sys.executable, "-m", "cpu_experts.worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, pass_fds=(spec["doorbell_fd"],), env=env)
        self.procs.append(proc)
        proc.stdin.write((json.dumps(spec) + "\n").encode())
        proc.stdin.close()

    def await_ready(self, w: int, timeout: float) -> None:
        """Wait for worker ``w``'s READY line (kept in :attr:`ready_info`)."""
        proc = self.procs[w]
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else b""
        if not line:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                raise CpuWorkerDied(w, proc.pid, None, f"no READY within {timeout:.0f} s")
            raise CpuWorkerDied(w, proc.pid, proc.returncode, "exited before READY")
        info = json.loads(line)
        if info.get("kind") != "ready":
            raise CpuWorkerDied(w, proc.pid, proc.poll(), f"unexpected first message {info}")
        self.ready_info.append(info)

    def check_alive(self) -> None:
        """Raise :class:`CpuWorkerDied` naming the first worker that has exited."""
        for w, proc in enumerate(self.procs):
            if proc.poll() is not None:
                raise CpuWorkerDied(w, proc.pid, proc.returncode)

    def all_alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def start_watchdog(self, session: threading.Event, header: np.ndarray) -> threading.Thread:
        """A daemon thread that sets ``header[ABORT]`` when a worker dies while ``session``
        is set (a GPU kernel waiting on ``SEQ_OUT`` then gives up); it ends on :attr:`stop`."""
        thread = threading.Thread(target=_watch, args=(self, session, header), daemon=True,
                                  name="cpu-experts-watchdog")
        thread.start()
        return thread

    def release(self) -> None:
        self.stop.set()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            if p.stdout:
                p.stdout.close()
        for f in self.files:
            f.unlink()
            f.close()
        for d in self.doorbells:
            d.close()
        for fd in self.fds:
            os.close(fd)
        for entry in self.entries:
            entry.close()
        self.procs, self.files, self.doorbells, self.fds = [], [], [], []
        self.entries = []


class ShardFiles:
    """A pool's shared memory before its workers start: ``procs.files`` gets the ring (first)
    and one shard per worker, each created at its final size from the manifest of the
    layers' shapes (shard.plan_shard), then filled a run of experts at a time
    (:meth:`write`, from any number of threads at once): nothing is held twice. :meth:`seal`
    unmaps the shards here before the workers start; :attr:`layers` reads them back on
    demand through read-only handles.

    A run is tiled into a buffer of the calling thread's (reused) and written with
    ``pwrite``; the shards are never written through this process's mapping. Faulting the
    shared pages in here instead (4 KiB at a time, ~18 million faults for 70 GiB) put
    every page in this process's page tables, and anything that walks them (a monitor
    reading /proc/PID/smaps_rollup) then held the address space's lock for a time that
    grows with the bytes written, stalling every mmap/munmap of the load's threads
    (docs/loading.md, "Filling the shared memory")."""

    def __init__(self, procs: WorkerProcesses, shapes: dict[int, shard.LayerShape],
                 bounds: list[dict[int, tuple[int, int]]], ring_size: int,
                 fmt: str = "int8", cache: tuple[str, dict] | None = None) -> None:
        self.procs, self.shapes = procs, shapes
        plans = [shard.plan_shard(shapes, b, fmt) for b in bounds]
        self.manifests = [m for m, _ in plans]
        self.sizes = [size for _, size in plans]
        # cache (directory, facts the weights follow from): the shards are the files of the
        # entry keyed by the facts, the format and the workers' split (shard_cache.py); when
        # an earlier load completed it, they are mapped as they are and nothing is written
        self.entry = None
        if cache is not None:
            key = shard_cache.cache_key({**cache[1], "format": fmt, "bounds": [
                sorted((int(k), [int(x) for x in v]) for k, v in b.items()) for b in bounds]})
            self.entry = shard_cache.CacheEntry(cache[0], key, self.sizes)
            procs.entries.append(self.entry)
        self.cached = self.entry is not None and self.entry.complete
        _check_space(ring_size, rings.shm_dir())
        if not self.cached:
            _check_space(sum(self.sizes), rings.shm_dir() if cache is None else cache[0])
        procs.files.append(rings.SharedFile.create(ring_size, "ring"))
        self._dst: list[dict] = []  # views for read() before seal(), never written
        for w, size in enumerate(self.sizes):
            if self.entry is None:
                f = rings.SharedFile.create(size, f"experts{w}")
            else:
                f = rings.SharedFile(self.entry.path(w), None if self.cached else size)
                f.keep = True
            procs.files.append(f)
            procs.fds.append(os.open(f.path, os.O_RDONLY if self.cached else os.O_WRONLY))
            if not self.cached:
                self._dst.append(shard.views(f.buf, self.manifests[w]))
        self._entries = [{layer: [e for e in m if e[0] == layer] for layer in shapes}
                         for m in self.manifests]  # per worker, per layer: (gu, down)
        self._scratch = threading.local()  # .buf: each writing thread's tile buffer
        self._filled = {layer: np.full(s.num_experts, self.cached)
                        for layer, s in shapes.items()}
        self.layers = {layer: shard.TiledLayer(s, [b[layer] for b in bounds],
                                               lambda w, layer=layer: self.read(w, layer))
                       for layer, s in shapes.items()}

    def write(self, layer: int, first: int, ql: shard.QuantizedLayer) -> None:
        """Tile experts ``first..first + n`` of ``layer`` into every worker's shard."""
        if self.cached:
            raise RuntimeError("the shards come from the cache: nothing is written")
        want = self.shapes.get(layer)
        if want is None:
            raise KeyError(f"layer {layer} has no CPU experts (have {sorted(self.shapes)})")
        n = ql.num_experts
        if ((ql.intermediate, ql.hidden) != (want.intermediate, want.hidden)
                or not 0 <= first <= first + n <= want.num_experts):
            raise ValueError(f"layer {layer}: experts {first}..{first + n} of I={ql.intermediate}"
                             f", H={ql.hidden} do not fit {want}")
        for w, fd in enumerate(self.procs.fds):
            entries = self._entries[w][layer]
            scratch = self._buffer(shard.run_bytes(entries, n))
            shard.pwrite_experts(fd, entries, ql, self.layers[layer].bounds[w], first, scratch)
        self._filled[layer][first:first + n] = True

    def _buffer(self, nbytes: int) -> np.ndarray:
        """This thread's tile buffer, at least ``nbytes`` (grown, never shrunk, until seal)."""
        buf = getattr(self._scratch, "buf", None)
        if buf is None or buf.size < nbytes:
            buf = self._scratch.buf = np.empty(nbytes, np.uint8)
        return buf

    def seal(self) -> None:
        """Every expert written (else ValueError naming the first gap): keep a read-only
        handle on each shard, drop this process's mapping (the workers map them)."""
        for layer, filled in sorted(self._filled.items()):
            if not filled.all():
                raise ValueError(f"layer {layer}: expert {int(np.argmin(filled))} was never "
                                 "written to the CPU workers' shards")
        self._dst, self._scratch = [], threading.local()  # every thread's buffer goes
        for w, f in enumerate(self.procs.files[1:]):
            if not self.cached:
                fd, self.procs.fds[w] = self.procs.fds[w], os.open(f.path, os.O_RDONLY)
                os.close(fd)
            f.close()
        if self.entry is not None and not self.cached:
            self.entry.built()

    def specs(self, common: dict, cores: list[list[int]]) -> list[dict]:
        """Each worker's start spec (``common`` plus its shard, cores and a new doorbell)."""
        specs = []
        for w, wfile in enumerate(self.procs.files[1:]):
            bell = rings.Doorbell()
            self.procs.doorbells.append(bell)
            specs.append({**common, "index": w, "cores": cores[w], "doorbell_fd": bell.fd,
                          "ring_path": self.procs.files[0].path, "weights_path": wfile.path,
                          "manifest": self.manifests[w]})
        return specs

    def read(self, w: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of worker ``w``'s tiled ``(gu, down)`` of ``layer``."""
        if self._dst:
            return tuple(np.array(a) for a in self._dst[w][layer])
        entries = [e for e in self.manifests[w] if e[0] == layer]
        with mmap.mmap(self.procs.fds[w], self.sizes[w], prot=mmap.PROT_READ) as buf:
            arrays = shard.views(buf, entries)[layer]
            out = tuple(np.array(a) for a in arrays)
            del arrays
        return out


def _check_space(need: int, where: str) -> None:
    """Fail before any weight is read when ``where`` cannot hold the experts."""
    free = shutil.disk_usage(where).free
    if need > free:
        raise MemoryError(f"the CPU experts need {need / 2**30:.2f} GiB of shared memory, but "
                          f"{where} has {free / 2**30:.2f} GiB free (enlarge it, "
                          "e.g. mount -o remount,size=... /dev/shm, or put fewer experts on "
                          "the CPU)")


def _watch(procs: WorkerProcesses, session: threading.Event, header: np.ndarray) -> None:
    while not procs.stop.wait(WATCH_EVERY_S):
        if session.is_set() and any(p.poll() is not None for p in procs.procs):
            header[rings.ABORT] = 1

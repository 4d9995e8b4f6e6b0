"""Shared memory between the GPU worker (client) and its cpu_experts processes, plus the doorbell.

``SharedFile`` is a file in /dev/shm mapped by every process (weights of a shard, or a ring).
``Ring`` is the dispatch slot of one pool: one MoE layer is in flight at a time (layers are
sequential), so the ring has a single slot, laid out as

* ``ctrl [W, 16] int64``: one 128-byte row per worker; ``SEQ_IN`` (written by the client) and
  ``SEQ_OUT``/``STATUS``/``KERNEL_NS``/``T_START``/``T_END`` (written by the worker; the
  times are CLOCK_MONOTONIC ns, comparable across processes) sit on different cache lines.
* ``header [8] int64``: command, layer, rows, top-k of the dispatch in flight; ``SPIN`` (set
  by the client while a GPU rings the workers itself: they keep spinning on ``SEQ_IN``) and
  ``ABORT`` (set by the client when a worker died: GPU waits give up).
* inputs shared by all workers, written once per layer: ``xq [Rmax, H] int8``,
  ``xd [Rmax, H/32] uint16`` (fp16 scale bits), ``ids [Rmax*Kmax] int32``, ``w [Rmax*Kmax] f32``.
* outputs: ``out [W, Rmax, H] float32``, one partial per worker.
* ``hist [W, HIST] int64``: each worker's kernel time of load ``seq`` at ``seq % HIST`` (the
  benchmark reads a whole step's).

Protocol: the client writes inputs and header, then ``ctrl[w, SEQ_IN] = seq`` and rings
worker w's doorbell (an eventfd, one write per dispatch). A worker spins on ``SEQ_IN`` for a
short while, then drains its eventfd, re-reads ``SEQ_IN`` and only then blocks in poll(): a
ring that lands between the re-read and the block leaves the eventfd readable, so no wake-up
is lost. The worker writes its partial, ``STATUS`` and ``KERNEL_NS`` (and adds it to
``KERNEL_SUM``), then ``SEQ_OUT = seq``.

A GPU may play the client (gpu_worker/experts/pinned_ring.py): with ``header[SPIN]`` set (and
every doorbell rung once, to wake sleepers) the workers spin on ``SEQ_IN`` without a deadline,
so a kernel's store to ``SEQ_IN`` in the mapped ring starts them with no system call, and a
kernel polling ``SEQ_OUT`` sees them finish.
"""

from __future__ import annotations

import mmap
import os
import uuid

import numpy as np

from cpu_experts.quant import BLOCK

# NOTE: the GPU kernels get these as #defines generated from here
# (gpu_worker/experts/ring_kernels.py): change them here only.
SEQ_IN, SEQ_OUT, STATUS, KERNEL_NS, T_START, T_END, KERNEL_SUM = 0, 8, 9, 10, 11, 12, 13
CTRL_COLS = 16
CMD, LAYER, ROWS, TOPK, SPIN, ABORT = 0, 1, 2, 3, 4, 5
CMD_RUN, CMD_STOP = 1, 2
ALIGN = 64
HIST = 64


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")


class SharedFile:
    """A named shared-memory file mapped read-write; ``create`` sizes it, else it is attached.
    ``populate=True`` maps every page at once (see the note in ``__init__``)."""

    def __init__(self, path: str, size: int | None = None, populate: bool = False) -> None:
        self.path = path
        self.keep = False  # unlink() leaves it (a shard cache's file: shard_cache.py)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if size is not None else 0)
        fd = os.open(path, flags, 0o600)
        # NOTE: populate maps every page at once (MAP_POPULATE). Without it each 4 KiB page of
        # a shard costs a minor fault the first time the worker touches it, inside a layer's
        # dispatch: a cold expert then takes far longer than DRAM speed.
        mflags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        try:
            if size is not None:
                os.ftruncate(fd, max(size, 1))
            self.size = os.fstat(fd).st_size
            self.buf = mmap.mmap(fd, self.size, flags=mflags)
        finally:
            os.close(fd)

    @classmethod
    def create(cls, size: int, tag: str) -> SharedFile:
        name = f"tandem-{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        return cls(os.path.join(shm_dir(), name), size)

    def unlink(self) -> None:
        if self.keep:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        try:
            self.buf.close()
        except BufferError:
            pass  # numpy views still alive: the mapping goes when they do


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Ring:
    """Views of one pool's dispatch slot over a :class:`SharedFile` (see module docstring)."""

    def __init__(self, buf, num_workers: int, max_rows: int, hidden: int, max_k: int) -> None:
        self.num_workers, self.max_rows = num_workers, max_rows
        self.hidden, self.max_k = hidden, max_k
        off = 0

        def take(shape: tuple[int, ...], dtype) -> np.ndarray:
            nonlocal off
            count = int(np.prod(shape))
            arr = np.frombuffer(buf, dtype=dtype, count=count, offset=off).reshape(shape)
            off += _aligned(count * np.dtype(dtype).itemsize)
            return arr

        self.ctrl = take((num_workers, CTRL_COLS), np.int64)       # [W, 16]
        self.header = take((8,), np.int64)
        self.xq = take((max_rows, hidden), np.int8)                 # [Rmax, H]
        self.xd = take((max_rows, hidden // BLOCK), np.uint16)      # [Rmax, H/32] fp16 bits
        self.ids = take((max_rows * max_k,), np.int32)              # [Rmax*Kmax] flat
        self.w = take((max_rows * max_k,), np.float32)              # [Rmax*Kmax] flat
        self.out = take((num_workers, max_rows, hidden), np.float32)  # [W, Rmax, H]
        self.hist = take((num_workers, HIST), np.int64)             # [W, HIST]
        self.nbytes = off

    @staticmethod
    def size(num_workers: int, max_rows: int, hidden: int, max_k: int) -> int:
        """Bytes a ring of these dimensions needs (the same layout as ``__init__``)."""
        parts = [num_workers * CTRL_COLS * 8, 8 * 8, max_rows * hidden,
                 max_rows * hidden // BLOCK * 2, max_rows * max_k * 4, max_rows * max_k * 4,
                 num_workers * max_rows * hidden * 4, num_workers * HIST * 8]
        return sum(_aligned(p) for p in parts)

    def pairs(self, rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``ids [rows, k]`` and ``w [rows, k]`` views of the flat pair regions."""
        return self.ids[:rows * k].reshape(rows, k), self.w[:rows * k].reshape(rows, k)


class Doorbell:
    """An eventfd: the client rings it once per dispatch, the worker drains it before blocking."""

    def __init__(self, fd: int | None = None) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK) if fd is None else fd

    def ring(self) -> None:
        os.eventfd_write(self.fd, 1)

    def drain(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.fd)

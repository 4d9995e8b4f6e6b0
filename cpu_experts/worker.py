"""The cpu_experts worker process: pin to cores, map its weight shard and the ring, serve layers.

Started by :class:`cpu_experts.pool.CpuExpertPool` as ``python -m cpu_experts.worker`` with a
JSON spec on stdin (no pickle); prints one READY line (JSON) on stdout once its kernels are
compiled and warm, then serves dispatches from the ring until told to stop or its parent dies.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import select
import signal
import sys
import time
import traceback

from cpu_experts import rings, shard
from cpu_experts.errors import ERR_INTERNAL, ERR_NO_LAYER

PROTOCOL_VERSION = 1
PR_SET_PDEATHSIG = 1
PARENT_CHECK_NS = 200_000_000


def _die_with_parent(parent_pid: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the poll loop below still notices a dead parent
    if os.getppid() != parent_pid:
        os._exit(1)


class ExpertWorker:
    """One worker: its shard's layers, the shared ring, the doorbell; :meth:`serve` is the loop."""

    def __init__(self, spec: dict) -> None:
        from cpu_experts import isa, kernels  # numba: imported after affinity, thread count

        self.isa = isa.select(spec.get("isa"))
        self.moe_layer = kernels.layer_kernel(self.isa)
        self.ahead = int(spec.get("prefetch_bytes", kernels.PREFETCH_AHEAD))
        self.index = spec["index"]
        self.parent_pid = spec["parent_pid"]
        self.spin_ns = int(spec["spin_us"] * 1000)
        self.ring_file = rings.SharedFile(spec["ring_path"])
        self.ring = rings.Ring(self.ring_file.buf, spec["num_workers"], spec["max_rows"],
                               spec["hidden"], spec["max_k"])
        self.weights_file = rings.SharedFile(spec["weights_path"], populate=True)
        self.layers = shard.views(self.weights_file.buf, spec["manifest"])
        int4 = spec["manifest"] and spec["manifest"][0][3] == "uint8"  # tiles4.py's tiles
        self.weight_format = "int4" if int4 else "int8"
        self.doorbell = rings.Doorbell(spec["doorbell_fd"])
        self.poller = select.poll()
        self.poller.register(self.doorbell.fd, select.POLLIN)
        # NOTE: read before READY is sent: the first dispatch may arrive right after READY.
        self.last_seq = int(self.ring.ctrl[self.index, rings.SEQ_IN])

    def warm_up(self) -> None:
        """Compile (or load from cache) and run every kernel once on real weights."""
        import numpy as np

        layer = next(iter(self.layers.values()))
        H = self.ring.hidden
        xq = np.ones((1, H), np.int8)
        xd = np.full((1, H // 32), 0x2000, np.uint16)  # fp16 2**-7
        out = np.empty((1, H), np.float32)
        ids = np.zeros((1, 1), np.int32)
        self.moe_layer(*layer, xq, xd, ids, np.ones((1, 1), np.float32), out, self.ahead)

    def _wait(self, last: int) -> int:
        """The next ``SEQ_IN``: spin ``spin_us`` (without end while ``header[SPIN]`` is set: a
        GPU rings by a store to the ring, no eventfd), then block on the doorbell."""
        ctrl, header = self.ring.ctrl[self.index], self.ring.header
        while True:
            now = time.perf_counter_ns()
            deadline, parent_check = now + self.spin_ns, now + PARENT_CHECK_NS
            while True:
                seq = int(ctrl[rings.SEQ_IN])
                if seq != last:
                    return seq
                now = time.perf_counter_ns()
                if now >= deadline:
                    if not header[rings.SPIN]:
                        break
                    if now >= parent_check:
                        self._check_parent()
                        parent_check = now + PARENT_CHECK_NS
            self.doorbell.drain()
            seq = int(ctrl[rings.SEQ_IN])
            if seq != last:
                return seq
            if header[rings.SPIN]:
                continue  # a GPU session began after the spin ended: spin again
            if not self.poller.poll(200):
                self._check_parent()

    def _check_parent(self) -> None:
        if os.getppid() != self.parent_pid:
            os._exit(1)

    def serve(self) -> None:
        ring, ctrl = self.ring, self.ring.ctrl[self.index]
        out, hist = ring.out[self.index], ring.hist[self.index]
        views: dict[tuple[int, int], tuple] = {}  # (rows, k) -> the ring's pair views
        last = self.last_seq
        while True:
            seq = self._wait(last)
            last = seq
            cmd, layer, rows, k = ring.header[:4].tolist()
            if cmd == rings.CMD_STOP:
                ctrl[rings.SEQ_OUT] = seq
                return
            t0 = time.perf_counter_ns()
            weights = self.layers.get(layer)
            if weights is None:
                status = ERR_NO_LAYER
            else:
                pairs = views.get((rows, k))
                if pairs is None:
                    pairs = views[rows, k] = ring.pairs(rows, k)
                ids, w = pairs
                try:
                    status = self.moe_layer(*weights, ring.xq, ring.xd, ids, w, out,
                                            self.ahead)
                except Exception:  # a bug, not bad input: report it and keep serving
                    traceback.print_exc()
                    status = ERR_INTERNAL
            t1 = time.perf_counter_ns()
            ctrl[rings.KERNEL_NS] = t1 - t0
            ctrl[rings.KERNEL_SUM] += t1 - t0
            hist[seq % rings.HIST] = t1 - t0
            ctrl[rings.T_START] = t0
            ctrl[rings.T_END] = t1
            ctrl[rings.STATUS] = status
            ctrl[rings.SEQ_OUT] = seq


def main() -> int:
    spec = json.loads(sys.stdin.readline())
    _die_with_parent(spec["parent_pid"])
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid> prints where a worker is stuck
    if spec["cores"]:
        os.sched_setaffinity(0, spec["cores"])
    worker = ExpertWorker(spec)
    import numba

    from cpu_experts import isa

    numba.set_num_threads(min(len(os.sched_getaffinity(0)), numba.config.NUMBA_NUM_THREADS))
    worker.warm_up()
    ready = {"kind": "ready", "index": worker.index, "pid": os.getpid(),
             "protocol": PROTOCOL_VERSION, "threads": numba.get_num_threads(),
             "isa": isa.NAMES[worker.isa], "prefetch_bytes": worker.ahead,
             "weights_mib": worker.weights_file.size >> 20, "weight_format": worker.weight_format,
             "threading_layer": numba.threading_layer(), "cores": sorted(os.sched_getaffinity(0))}
    sys.stdout.write(json.dumps(ready) + "\n")
    sys.stdout.flush()
    worker.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())

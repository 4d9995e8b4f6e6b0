"""Time the streaming load's CPU phase alone (``_Loader.fill_cpu``): the rate per GiB written
into the CPU workers' shared memory, as the shards fill.

    python -m scripts.bench_fill_cpu --layers 8 --cpu-experts 446 --threads 2 \\
        --probe-every 0.2

Synthetic Qwen3-Next-80B-A3B widths (``--model``: a config under configs/models) cut to
``--layers`` layers; the last ``--cpu-experts`` experts of each layer go to ``--workers`` CPU
shards (the workers are never started). Every ``--every`` GiB read it prints the rate of
that stretch, this process's minor page faults and resident set. ``--probe-every S`` runs
a second process that reads this one's ``/proc/PID/smaps_rollup`` every S seconds, as
scripts/bench_load_probe.py does during a benchmark (0: none). ``--via-mmap`` writes the
shards the way the loader did before (through this process's mapping of them), to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from cpu_experts import shard
from cpu_experts.processes import ShardFiles
from gpu_worker.experts.split import plan_split
from gpu_worker.model_config import ModelConfig
from gpu_worker.weights import stream
from gpu_worker.weights.synthetic import SyntheticSource

GIB = 2**30
PROBE = """
import sys, time
pid, every = sys.argv[1], float(sys.argv[2])
while True:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            f.read()
    except OSError:
        break
    time.sleep(every)
"""


def _stat() -> tuple[int, int, float]:
    """(minor faults, resident bytes, CPU seconds) of this process."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return int(fields[7]), int(fields[21]) * 4096, cpu


class _Blocked:
    """Seconds the load's threads (a ThreadPoolExecutor's) spent blocked (neither running
    nor waiting for a core: a lock, the GIL, a sleeping syscall), from their schedstat.
    Robust to other processes crowding the cores, which only add run-queue time."""

    def __init__(self) -> None:
        self.total = 0.0
        self._last: dict[int, tuple[float, int, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            now, seen = time.monotonic(), {}
            for tid in [t.native_id for t in threading.enumerate()
                        if t.name.startswith("ThreadPoolExecutor")]:
                try:
                    on, rq, _ = Path(f"/proc/self/task/{tid}/schedstat").read_text().split()
                except (OSError, ValueError):
                    continue
                seen[tid] = (now, int(on), int(rq))
                if tid in self._last:
                    t0, on0, rq0 = self._last[tid]
                    self.total += max(0.0, now - t0 - (int(on) - on0 + int(rq) - rq0) / 1e9)
            self._last = seen

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class _Bar:
    """Stands in for the tqdm bar: prints a line every ``every`` bytes read."""

    def __init__(self, every: int, written_per_read: float) -> None:
        self.every, self.ratio = every, written_per_read
        self.done = self.mark = 0
        self.t0 = self.t_mark = time.perf_counter()
        self.f_mark, _, self.c_mark = _stat()
        self.blocked = _Blocked()
        self.b_mark = 0.0
        self.rows: list[dict] = []

    def update(self, n: int) -> None:
        self.done += n
        if self.done - self.mark >= self.every:
            t, (flt, rss, cpu), blocked = time.perf_counter(), _stat(), self.blocked.total
            row = {"written_gib": round(self.done * self.ratio / GIB, 2),
                   "s": round(t - self.t0, 1),
                   "mb_read_per_s": round((self.done - self.mark) / (t - self.t_mark) / 1e6, 1),
                   "cpu_s_per_gib": round((cpu - self.c_mark) * GIB / (self.done - self.mark), 2),
                   "blocked_s_per_gib": round((blocked - self.b_mark) * GIB
                                              / (self.done - self.mark), 2),
                   "faults": flt - self.f_mark, "rss_gib": round(rss / GIB, 2)}
            print(json.dumps(row), flush=True)
            self.rows.append(row)
            self.mark, self.t_mark, self.f_mark, self.c_mark = self.done, t, flt, cpu
            self.b_mark = blocked


def _write_via_mmap(self, layer: int, first: int, ql) -> None:
    """The old ShardFiles.write: tiles straight into this process's mapping of the shards."""
    for w, dst in enumerate(self._dst):
        shard.write_experts(dst[layer], ql, self.layers[layer].bounds[w], first)
    self._filled[layer][first:first + ql.num_experts] = True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-next-80b-a3b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--cpu-experts", type=int, default=446)
    ap.add_argument("--threads", type=int, default=None,
                    help="default: gpu_worker.kernels.bf16.default_threads()")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--chunk-mb", type=int, default=stream.CHUNK_BYTES >> 20)
    ap.add_argument("--every", type=float, default=1.0, help="GiB read between lines")
    ap.add_argument("--probe-every", type=float, default=0.0)
    ap.add_argument("--via-mmap", action="store_true")
    args = ap.parse_args(argv)
    if args.via_mmap:
        ShardFiles.write = _write_via_mmap

    raw = json.loads(Path(f"configs/models/{args.model}.json").read_text())
    raw["num_hidden_layers"] = args.layers
    cfg = ModelConfig.from_dict(raw)
    source = SyntheticSource(cfg, include_mtp=False)
    split = plan_split(cfg, "split", args.cpu_experts)
    loader = stream._Loader(source, split, np.dtype(np.float32), args.chunk_mb << 20,
                            lambda event, **f: print(event, json.dumps(f), flush=True),
                            threads=args.threads)
    pool = loader.make_pool({"num_workers": args.workers, "cores": [[0]] * args.workers})
    probe = None
    if args.probe_every > 0:
        probe = subprocess.Popen([sys.executable, "-c", PROBE, str(os.getpid()),
                                  str(args.probe_every)])
    try:
        ratio = pool.shard_bytes / loader.cpu_bytes_to_read()
        loader.bar = _Bar(int(args.every * GIB), ratio)
        t0 = time.perf_counter()
        loader.fill_cpu(pool)
        dt = time.perf_counter() - t0
        loader.bar.blocked.stop()
        print(json.dumps({"summary": vars(args),
                          "written_gib": round(pool.shard_bytes / GIB, 2),
                          "seconds": round(dt, 1),
                          "gib_per_s": round(pool.shard_bytes / GIB / dt, 3)}), flush=True)
    finally:
        if probe is not None:
            probe.kill()
            probe.wait()
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

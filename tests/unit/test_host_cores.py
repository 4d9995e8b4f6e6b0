"""The host cores (cpu_experts/cores.py): the daemon and the GPU worker keep to the cores the
CPU expert workers leave, their BLAS pools as wide as those cores; a GPU worker starts on the
daemon's start-up cores whatever the daemon keeps to by then."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cpu_experts.cores import host_cores
from daemon.config import load_config
from daemon.config_checks import ConfigError
from daemon.lifecycle import START_CORES, keep_to_host_cores, worker_config
from protocol.worker_config import WorkerConfig


@pytest.mark.parametrize(("usable", "groups", "want"), [
    (range(16), [list(range(2, 16))], [0, 1]),
    (range(16), [list(range(2, 9)), list(range(9, 16))], [0, 1]),
    (range(16), [[4, 5], [6, 7]], [0, 1, 2, 3, *range(8, 16)]),
    (range(2), [[0, 1]], []),  # a small machine: the workers share every core
    (range(16), [], []),  # no CPU expert workers
])
def test_the_host_cores_are_the_ones_no_worker_runs_on(usable, groups, want):
    assert host_cores(usable, groups) == want


PROBE = """
import json, os, threading
import numpy as np
from threadpoolctl import threadpool_info
from protocol.host_cores import pin_host_process
np.ones((300, 300)) @ np.ones((300, 300))  # the BLAS pool started
before = threading.Event(); stop = threading.Event()
t = threading.Thread(target=lambda: (before.set(), stop.wait())); t.start(); before.wait()
done = pin_host_process([{core}])
later = threading.Thread(target=stop.wait); later.start()
masks = {{tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}}
stop.set(); t.join(); later.join()
print(json.dumps({{"done": done, "masks": masks,
                  "blas": [p["num_threads"] for p in threadpool_info()
                           if p["user_api"] == "blas"]}}))
"""


def test_pinning_moves_every_thread_and_narrows_the_blas_pools():
    core = max(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", PROBE.format(core=core)], capture_output=True,
                         text=True, check=True, timeout=60)
    got = json.loads(out.stdout)
    assert len(got["masks"]) >= 3  # the main thread, one started before, one after
    assert all(mask == [core] for mask in got["masks"].values())
    assert got["blas"] and all(n == 1 for n in got["blas"])
    assert got["done"]["cores"] == [core] and got["done"]["threads_pinned"] >= 2


def test_the_worker_is_started_on_the_daemons_start_up_cores():
    config = worker_config(load_config(None, {}))
    assert config.affinity == START_CORES == tuple(sorted(os.sched_getaffinity(0)))
    back = WorkerConfig.from_json(config.to_json())
    assert back.affinity == config.affinity
    for bad in ([-1], ["0"], [0.5]):
        raw = json.loads(config.to_json()) | {"affinity": bad}
        with pytest.raises(ValueError, match="affinity"):
            WorkerConfig.from_json(json.dumps(raw))


def test_host_cores_outside_the_daemons_own_are_refused():
    before = os.sched_getaffinity(0)
    keep_to_host_cores([max(START_CORES) + 1000])
    keep_to_host_cores([])
    assert os.sched_getaffinity(0) == before


def test_the_pin_host_key_reaches_the_worker_and_is_checked():
    assert worker_config(load_config(None, {})).pin_host is True
    off = worker_config(load_config(None, {"experts.pin_host": False}))
    assert off.pin_host is False and WorkerConfig.from_json(off.to_json()).pin_host is False
    with pytest.raises(ConfigError, match="experts.pin_host"):
        load_config(None, {"experts.pin_host": "yes"})

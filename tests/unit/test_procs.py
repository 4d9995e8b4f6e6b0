"""scripts.procs: waiting for processes to end, and a script's server stopped with every
process below it."""

import subprocess
import sys
import time

from scripts.procs import alive, descendants, stop_server, wait_gone

# a parent that starts a child ignoring SIGTERM, prints the child's pid, then waits; with
# IGNORE set the parent ignores SIGTERM too
PARENT = """
import signal, subprocess, sys, time
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                          "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""


def start(mode: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE,
                            text=True)
    child = int(proc.stdout.readline())
    deadline = time.monotonic() + 10
    while child not in descendants(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc, child


def test_stop_server_ends_a_tree_whose_child_ignores_sigterm():
    proc, child = start("obey")
    assert alive(child)
    t0 = time.monotonic()
    assert stop_server(proc, timeout=1.0) == []  # the tree read before the parent went
    assert proc.returncode == -15 and not alive(child)
    assert time.monotonic() - t0 < 10


def test_stop_server_kills_a_server_that_ignores_sigterm_and_waits_for_a_given_tree():
    proc, child = start("ignore")
    assert stop_server(proc, [proc.pid, child], timeout=0.5) == []
    assert proc.returncode == -9 and not alive(child)


def test_wait_gone_waits_for_processes_and_kills_what_stays():
    quick = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    stuck = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                              "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
    assert alive(quick.pid) and alive(stuck.pid)
    children = [quick, stuck]  # zombies until this process waits for them
    assert wait_gone([quick.pid, stuck.pid], 2.0) == []  # a zombie counts as gone
    assert [p.wait(timeout=5) for p in children] == [0, -9]
    assert not alive(quick.pid)

"""Processes and ports on this machine, for the scripts that start a server and for the
integration tests: a free loopback port, the process tree below a pid, a process's command
line, waiting for processes to end (all from /proc)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, parents before children (one scan of /proc/*/stat)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])  # after "(comm) state"
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it."""
    return [root, *descendants(root)]


def cmdline(pid: int) -> str:
    """The command line of ``pid``, arguments joined by spaces ("" once it has exited)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, whose memory is already freed, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] not in ("Z", "X")


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` s for every one of ``pids`` to end; SIGKILL (and wait 10 s more
    for) those left. Returns the pids still running after that (normally none)."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if alive(p)]
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + 10
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if alive(p)]
    return left


def stop_server(proc: subprocess.Popen, tree: list[int] | None = None,
                timeout: float = 60) -> list[int]:
    """End a server started by a script: SIGTERM to ``proc`` (SIGKILL after ``timeout`` s),
    then wait for every process of ``tree`` (default: ``proc``'s descendants now) to end,
    killing those that outlast ``timeout`` (the next server needs the memory they hold).
    Returns the pids still running after that (normally none)."""
    tree = descendants(proc.pid) if tree is None else tree
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return wait_gone(tree, timeout)

"""daemon.systemd against a real AF_UNIX datagram socket standing in for systemd, and the
shipped unit file's settings."""

from __future__ import annotations

import asyncio
import configparser
import os
import shlex
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from daemon import systemd
from daemon.config import REPO_ROOT


@pytest.fixture
def listener(tmp_path, monkeypatch):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = tmp_path / "notify"
    sock.bind(str(path))
    sock.settimeout(2.0)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    yield sock
    sock.close()


def _fields(datagram: bytes) -> dict[str, str]:
    text = datagram.decode()
    assert text.endswith("\n")
    return dict(line.split("=", 1) for line in text.splitlines())


def test_ready_and_status_in_one_datagram(listener):
    assert systemd.notify(ready=True, status="serving tandem-tiny\non :8000")
    fields = _fields(listener.recv(4096))
    assert fields == {"READY": "1", "MAINPID": str(os.getpid()),
                      "STATUS": "serving tandem-tiny on :8000"}


def test_stopping_and_watchdog(listener):
    assert systemd.notify(stopping=True)
    assert _fields(listener.recv(4096)) == {"STOPPING": "1"}
    assert systemd.notify(watchdog=True)
    assert _fields(listener.recv(4096)) == {"WATCHDOG": "1"}


def test_abstract_namespace_socket(monkeypatch):
    name = f"tandem-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2.0)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert systemd.notify(ready=True)
        assert _fields(sock.recv(4096))["READY"] == "1"


def test_no_notify_socket_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert systemd.notify(ready=True) is False


def test_dead_socket_is_reported_not_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert systemd.notify(ready=True) is False
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")
    assert systemd.notify(ready=True) is False


def test_watchdog_interval(monkeypatch):
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert systemd.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "60000000")
    assert systemd.watchdog_interval() == 30.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert systemd.watchdog_interval() == 30.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # meant for another process
    assert systemd.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    for bad in ("0", "soon"):
        monkeypatch.setenv("WATCHDOG_USEC", bad)
        assert systemd.watchdog_interval() is None


async def test_watchdog_loop_pings_while_healthy(listener, monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "40000")  # ping every 20 ms
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    healthy = [True]
    task = asyncio.create_task(systemd.watchdog_loop(lambda: healthy[0]))
    try:
        listener.settimeout(1.0)
        loop = asyncio.get_running_loop()
        for _ in range(3):
            data = await loop.run_in_executor(None, listener.recv, 4096)
            assert _fields(data) == {"WATCHDOG": "1"}
        healthy[0] = False
        await asyncio.sleep(0.05)  # let a ping already in flight land
        listener.setblocking(False)
        while True:
            try:
                listener.recv(4096)
            except BlockingIOError:
                break
        await asyncio.sleep(0.1)  # five intervals, no pings while unhealthy
        with pytest.raises(BlockingIOError):
            listener.recv(4096)
    finally:
        task.cancel()


async def test_watchdog_loop_returns_without_a_watchdog(monkeypatch):
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    await asyncio.wait_for(systemd.watchdog_loop(), timeout=1.0)


def test_unit_file():
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # keys are case-sensitive
    parser.read(REPO_ROOT / "configs" / "tandem.service")
    service = parser["Service"]
    assert service["Type"] == "notify"
    assert service["ExecStart"].startswith("tandem serve --config /etc/tandem/tandem.toml")
    assert int(service["WatchdogSec"]) > 0
    assert service["Restart"] == "on-failure"
    assert service["KillMode"] == "control-group"
    assert service["RuntimeDirectory"] == "tandem"
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict",
                       "ProtectHome": "read-only", "PrivateTmp": "yes", "PrivateDevices": "no",
                       "LockPersonality": "yes"}.items():
        assert service[key] == value, key
    assert set(service["RestrictAddressFamilies"].split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}
    assert "MemoryDenyWriteExecute" not in service  # JIT compilers need W+X pages
    assert parser["Install"]["WantedBy"] == "multi-user.target"


def test_unit_file_passes_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    tandem = Path(sys.executable).parent / "tandem"  # the console script of this install
    unit = (REPO_ROOT / "configs" / "tandem.service").read_text()
    (tmp_path / "tandem.service").write_text(unit.replace("ExecStart=tandem ",
                                                          f"ExecStart={tandem} "))
    proc = subprocess.run([analyze, "verify", "--man=no", str(tmp_path / "tandem.service")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "tandem.service" not in proc.stderr, proc.stderr


def test_unit_file_install_steps_put_tandem_where_systemd_looks():
    """ExecStart names `tandem` bare: systemd (>= 239) looks it up in a fixed search path, so
    the documented install step must link it into one of those directories."""
    search_path = {Path(d) for d in ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin",
                                     "/usr/bin")}
    unit = (REPO_ROOT / "configs" / "tandem.service").read_text()
    steps = [line.lstrip("#").strip() for line in unit.splitlines() if line.startswith("#")]
    link = shlex.split(next(s for s in steps if s.startswith("ln ")).split("#")[0])
    assert link[-2].endswith("/bin/tandem")  # the console script of the install step's venv
    assert Path(link[-1]).parent in search_path and Path(link[-1]).name == "tandem"

"""systemd service notifications (sd_notify(3)) without libsystemd.

The protocol: send newline-separated `KEY=VALUE` assignments in one datagram to the AF_UNIX
socket named by $NOTIFY_SOCKET (a leading '@' means the abstract namespace). Outside systemd
$NOTIFY_SOCKET is unset and every call is a no-op. The watchdog (WatchdogSec=) wants
`WATCHDOG=1` more often than $WATCHDOG_USEC; `watchdog_interval()` gives half of it.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable

import structlog

log = structlog.stdlib.get_logger(__name__)


def _address(value: str) -> str | None:
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None  # vsock: and other schemes are not supported


def notify(*, ready: bool = False, stopping: bool = False, reloading: bool = False,
           watchdog: bool = False, status: str | None = None) -> bool:
    """Send one notification; True when it was delivered, False outside systemd or on error
    (a failed notification is logged, never raised: it must not take the service down)."""
    target = os.environ.get("NOTIFY_SOCKET")
    if not target:
        return False
    address = _address(target)
    if address is None:
        log.warning("systemd_notify_unsupported_socket", socket=target)
        return False
    lines = []
    if ready:
        lines += ["READY=1", f"MAINPID={os.getpid()}"]
    if reloading:
        lines.append("RELOADING=1")
    if stopping:
        lines.append("STOPPING=1")
    if watchdog:
        lines.append("WATCHDOG=1")
    if status is not None:
        lines.append("STATUS=" + status.replace("\n", " "))
    if not lines:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall("\n".join(lines).encode() + b"\n")
    except OSError as exc:
        log.warning("systemd_notify_failed", socket=target, error=str(exc))
        return False
    return True


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of $WATCHDOG_USEC), or None when systemd does
    not watch this process."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 2e6 if value > 0 else None


async def watchdog_loop(is_healthy: Callable[[], bool] = lambda: True) -> None:
    """Ping the watchdog every `watchdog_interval()` seconds while `is_healthy()`; returns at
    once when there is no watchdog. Run it as a task and cancel it on shutdown. Pings come
    from the event loop, so a blocked loop also stops them and systemd restarts the service."""
    interval = watchdog_interval()
    if interval is None:
        return
    while True:
        if is_healthy():
            notify(watchdog=True)
        else:
            log.warning("systemd_watchdog_skipped", reason="unhealthy")
        await asyncio.sleep(interval)

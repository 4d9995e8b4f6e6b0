"""One tiny wrapper per socket role; which side binds and which connects is decided in
`_ROLES`, nowhere else.

    daemon --- worker link (ipc://{run_dir}/worker.sock) --- gpu_worker
      DaemonToWorker: DEALER, binds       WorkerToDaemon: ROUTER, connects
    daemon --- client link (ipc://{run_dir}/client.sock or tcp:// + CURVE) --- clients
      DaemonToClients: ROUTER, binds      ClientToDaemon: DEALER, connects

Why DEALER/ROUTER for the worker link: the daemon owns the run dir and outlives worker
restarts, so it binds; a bound DEALER has no peer until a worker connects, so a plan is
never queued for a dead worker (send times out instead). The worker's ROUTER names its
one peer b"daemon" (CONNECT_ROUTING_ID) and sets ROUTER_MANDATORY, so it can send READY
at once and notices a vanished daemon as a send timeout. Make a new DaemonToWorker per
worker incarnation. The client ROUTER also sets ROUTER_MANDATORY: sending to a client
that is gone, or not reading, returns False instead of dropping tokens silently. A client's
DEALER sets IMMEDIATE: with no (authenticated) connection, send() times out instead of
queueing requests for a daemon that is not there.

Every wrapper has a sync and an asyncio (`Async...`) variant with the same methods.
Not thread-safe: use a wrapper from one thread (or one event loop) only.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from protocol.codec import DEFAULT_LIMITS, Limits, decode, encode
from protocol.curve import CurveClientKeys, CurveServerKeys, make_client, make_server
from protocol.errors import ProtocolError
from protocol.messages import (
    CLIENT_TO_DAEMON,
    DAEMON_TO_CLIENT,
    DAEMON_TO_WORKER,
    MAX_REQUEST_ID_LEN,
    WORKER_TO_DAEMON,
    Message,
    MsgKind,
)

IPC_PATH_MAX = 107  # sun_path is 108 bytes with the NUL
DAEMON_PEER_ID = b"daemon"


def worker_address(run_dir: str | os.PathLike) -> str:
    return f"ipc://{Path(run_dir)}/worker.sock"


def client_address(run_dir: str | os.PathLike) -> str:
    return f"ipc://{Path(run_dir)}/client.sock"


class SocketConfigError(ValueError):
    """An endpoint that Tandem refuses to open (e.g. tcp:// without CURVE keys)."""


@dataclass(frozen=True, slots=True)
class _Role:
    socket_type: int
    binds: bool
    sends: frozenset[MsgKind]
    receives: frozenset[MsgKind]
    fixed_peer: bytes | None = None  # ROUTER with one known peer
    drop_unreachable: bool = False  # ROUTER to many peers: unreachable peer -> send() False
    sndhwm: int = 1000
    immediate: bool = False  # queue nothing until a connection is up (and authenticated)


_ROLES = {
    "daemon_to_worker": _Role(zmq.DEALER, True, DAEMON_TO_WORKER, WORKER_TO_DAEMON),
    "worker_to_daemon": _Role(zmq.ROUTER, False, WORKER_TO_DAEMON, DAEMON_TO_WORKER,
                              fixed_peer=DAEMON_PEER_ID),
    "daemon_to_clients": _Role(zmq.ROUTER, True, DAEMON_TO_CLIENT, CLIENT_TO_DAEMON,
                               drop_unreachable=True, sndhwm=10_000),
    "client_to_daemon": _Role(zmq.DEALER, False, CLIENT_TO_DAEMON, DAEMON_TO_CLIENT,
                              immediate=True),
}


def _ipc_path(address: str) -> str:
    path = address.removeprefix("ipc://")
    if len(os.fsencode(path)) > IPC_PATH_MAX:
        raise SocketConfigError(f"ipc path {path!r} is longer than {IPC_PATH_MAX} bytes; "
                                "use a shorter run dir")
    return path


class _Endpoint:
    """Opens the role's socket: options, CURVE, bind or connect, 0600 on ipc files."""

    ROLE: ClassVar[str]
    _sync: ClassVar[bool] = True

    def __init__(self, address: str, *, context: zmq.Context | None = None,
                 limits: Limits = DEFAULT_LIMITS, server_keys: CurveServerKeys | None = None,
                 client_keys: CurveClientKeys | None = None):
        role = self._role = _ROLES[self.ROLE]
        self.address = address
        self.limits = limits
        scheme = address.split("://", 1)[0]
        if scheme not in ("ipc", "tcp", "inproc"):
            raise SocketConfigError(f"unsupported address {address!r}: use ipc:// or tcp://")
        keys = server_keys if role.binds else client_keys
        if scheme == "tcp" and keys is None:
            kind = "server_keys=CurveServerKeys" if role.binds else "client_keys=CurveClientKeys"
            raise SocketConfigError(f"{address}: tcp:// requires CURVE keys ({kind}(...)); "
                                    "use ipc:// for local clients")
        # A CURVE server gets its own context: its ZAP handler is per context.
        self._owned_ctx = context is None and server_keys is not None
        ctx_cls = zmq.Context if self._sync else zmq.asyncio.Context
        ctx = ctx_cls() if self._owned_ctx else (context or ctx_cls.instance())
        self._ctx = ctx
        sock = self._sock = ctx.socket(role.socket_type)
        self._auth = None
        sock.linger = 0
        sock.setsockopt(zmq.MAXMSGSIZE, limits.max_part_bytes)
        sock.sndhwm = role.sndhwm
        sock.immediate = int(role.immediate)
        if role.socket_type == zmq.ROUTER:
            sock.router_mandatory = 1
        try:
            if server_keys is not None:
                self._auth = make_server(sock, server_keys)
            if client_keys is not None:
                make_client(sock, client_keys)
            if role.binds:
                path = _ipc_path(address) if scheme == "ipc" else None
                sock.bind(address)
                self.address = sock.last_endpoint.decode()  # tcp port 0 -> the real port
                if path is not None:
                    os.chmod(path, 0o600)
            else:
                if scheme == "ipc":
                    _ipc_path(address)
                if role.fixed_peer is not None:
                    sock.setsockopt(zmq.CONNECT_ROUTING_ID, role.fixed_peer)
                sock.connect(address)
        except BaseException:
            self.close()
            raise

    @classmethod
    def in_run_dir(cls, run_dir: str | os.PathLike, **kwargs: Any):
        """This role's endpoint at its ipc address inside `run_dir`."""
        worker = cls.ROLE in ("daemon_to_worker", "worker_to_daemon")
        return cls((worker_address if worker else client_address)(run_dir), **kwargs)

    @property
    def socket(self) -> zmq.Socket:
        """The raw socket, for polling; send and receive through the wrapper."""
        return self._sock

    def close(self) -> None:
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._owned_ctx:
            self._ctx.term()
            self._owned_ctx = False

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _frames_out(self, msg: Message, peer: bytes | None) -> list:
        if msg.KIND not in self._role.sends:
            raise ValueError(f"{type(msg).__name__} may not be sent on {self.ROLE}")
        peer = peer if peer is not None else self._role.fixed_peer
        return ([peer] if peer is not None else []) + encode(msg)

    def _send_error(self, exc: zmq.ZMQError) -> bool:
        """True: retry later (peer not connected yet / queue full); False: give up."""
        if exc.errno not in (errno.EHOSTUNREACH, errno.EAGAIN):
            raise exc
        return not self._role.drop_unreachable

    def _decode_in(self, frames: list) -> tuple[bytes | None, Message]:
        peer = None
        if self._role.socket_type == zmq.ROUTER:
            peer, frames = frames[0].bytes, frames[1:]
        try:
            return peer, decode(frames, limits=self.limits, allowed=self._role.receives)
        except ProtocolError as exc:
            exc.peer = peer
            exc.request_id = _request_id(frames, self.limits)
            raise


def _request_id(frames: list, limits: Limits) -> str | None:
    """The `request_id` a message that failed to decode names in its body, if any (so the
    error reply can say which request failed)."""
    if len(frames) < 2:
        return None
    body = memoryview(frames[1]).cast("B")
    if body.nbytes > limits.max_body_bytes:
        return None
    try:
        value = msgpack.unpackb(body, raw=False, strict_map_key=True,
                                ext_hook=lambda code, data: None)
    except Exception:  # msgpack raises a zoo of ValueError/TypeError subclasses
        return None
    rid = value.get("request_id") if type(value) is dict else None
    return rid if type(rid) is str and 0 < len(rid) <= MAX_REQUEST_ID_LEN else None


def _remaining(deadline: float | None, what: str) -> float:
    if deadline is None:
        return 1.0
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(what)
    return left


class _SyncIO(_Endpoint):
    def _send(self, msg: Message, peer: bytes | None, timeout: float | None) -> bool:
        frames = self._frames_out(msg, peer)
        deadline = None if timeout is None else time.monotonic() + timeout
        backoff = 0.0005
        while True:
            try:
                self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return True
            except zmq.ZMQError as exc:
                if not self._send_error(exc):
                    return False
            time.sleep(min(backoff, _remaining(deadline, f"send on {self.address} timed out")))
            backoff = min(backoff * 2, 0.02)

    def _recv(self, timeout: float | None) -> tuple[bytes | None, Message]:
        ms = None if timeout is None else max(int(timeout * 1000), 0)
        if not self._sock.poll(ms, zmq.POLLIN):
            raise TimeoutError(f"nothing received on {self.address} within {timeout}s")
        return self._decode_in(self._sock.recv_multipart(copy=False))


class _AsyncIO(_Endpoint):
    _sync = False

    async def _send(self, msg: Message, peer: bytes | None, timeout: float | None) -> bool:
        frames = self._frames_out(msg, peer)
        deadline = None if timeout is None else time.monotonic() + timeout
        backoff = 0.0005
        while True:
            try:
                await self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return True
            except zmq.ZMQError as exc:
                if not self._send_error(exc):
                    return False
            await asyncio.sleep(min(backoff, _remaining(deadline, f"send on {self.address} "
                                                                  "timed out")))
            backoff = min(backoff * 2, 0.02)

    async def _recv(self, timeout: float | None) -> tuple[bytes | None, Message]:
        try:
            frames = await asyncio.wait_for(self._sock.recv_multipart(copy=False), timeout)
        except TimeoutError:
            raise TimeoutError(f"nothing received on {self.address} within {timeout}s") from None
        return self._decode_in(frames)


# ---------------------------------------------------------------- the roles


class DaemonToWorker(_SyncIO):
    """The daemon's end of the worker link (DEALER, binds)."""

    ROLE = "daemon_to_worker"

    def send(self, msg: Message, timeout: float | None = None) -> None:
        """Raises TimeoutError if no worker takes it within `timeout` seconds."""
        self._send(msg, None, timeout)

    def recv(self, timeout: float | None = None) -> Message:
        """Raises TimeoutError, or ProtocolError for a malformed message."""
        return self._recv(timeout)[1]


class WorkerToDaemon(DaemonToWorker):
    """The gpu_worker's end of the worker link (ROUTER with the one peer b"daemon", connects)."""

    ROLE = "worker_to_daemon"


class ClientToDaemon(DaemonToWorker):
    """A client's end of the client link (DEALER, connects)."""

    ROLE = "client_to_daemon"


class DaemonToClients(_SyncIO):
    """The daemon's end of the client link (ROUTER, binds); peers are routing ids."""

    ROLE = "daemon_to_clients"

    def send_to(self, peer: bytes, msg: Message) -> bool:
        """False if the client is gone or not reading (its queue is full): cancel its work."""
        return self._send(msg, peer, None)

    def recv(self, timeout: float | None = None) -> tuple[bytes, Message]:
        """(peer, message). A ProtocolError carries the sender in `.peer` for an ErrorReply."""
        peer, msg = self._recv(timeout)
        assert peer is not None
        return peer, msg


class AsyncDaemonToWorker(_AsyncIO):
    ROLE = "daemon_to_worker"

    async def send(self, msg: Message, timeout: float | None = None) -> None:
        await self._send(msg, None, timeout)

    async def recv(self, timeout: float | None = None) -> Message:
        return (await self._recv(timeout))[1]


class AsyncWorkerToDaemon(AsyncDaemonToWorker):
    ROLE = "worker_to_daemon"


class AsyncClientToDaemon(AsyncDaemonToWorker):
    ROLE = "client_to_daemon"


class AsyncDaemonToClients(_AsyncIO):
    """The daemon's end of the client link (asyncio). It also tells which clients went
    away (`gone()`): a socket monitor reports closed connections by file descriptor, and
    every received message records its peer's descriptor (zmq.SRCFD). Monitor events are
    read before each message is decoded, so a descriptor that a new client reuses is never
    taken for the old one's."""

    ROLE = "daemon_to_clients"

    def __init__(self, address: str, **kwargs: Any) -> None:
        super().__init__(address, **kwargs)
        self._fd_of: dict[bytes, int] = {}  # peer -> descriptor of its connection
        self._gone: list[bytes] = []
        monitor = f"inproc://tandem-client-monitor-{id(self):x}"
        self._sock.monitor(monitor, zmq.EVENT_DISCONNECTED)
        self._monitor = zmq.Context.shadow(self._ctx.underlying).socket(zmq.PAIR)
        self._monitor.linger = 0
        self._monitor.connect(monitor)

    async def send_to(self, peer: bytes, msg: Message) -> bool:
        return await self._send(msg, peer, None)

    async def recv(self, timeout: float | None = None) -> tuple[bytes, Message]:
        peer, msg = await self._recv(timeout)
        assert peer is not None
        return peer, msg

    def gone(self) -> list[bytes]:
        """The peers whose connection closed since the last call."""
        self._read_monitor()
        gone, self._gone = self._gone, []
        return gone

    def _decode_in(self, frames: list) -> tuple[bytes | None, Message]:
        self._read_monitor()
        with contextlib.suppress(zmq.ZMQError, AttributeError):
            self._fd_of[frames[0].bytes] = frames[-1].get(zmq.SRCFD)
        return super()._decode_in(frames)

    def _read_monitor(self) -> None:
        while self._monitor.poll(0):
            event = parse_monitor_message(self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                fd = event["value"]
                for peer in [p for p, f in self._fd_of.items() if f == fd]:
                    del self._fd_of[peer]
                    self._gone.append(peer)

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(linger=0)
        super().close()

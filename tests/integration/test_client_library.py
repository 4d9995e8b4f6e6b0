"""The client library (sync and asyncio) against a small real ROUTER server built from
protocol.sockets in a thread: it echoes each prompt back one token per tick, interleaving
all active requests, so routing by request id, cancellation and errors are exercised on
real ZeroMQ sockets."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
import time

import pytest

from protocol.client import AsyncTandemClient, TandemClient
from protocol.errors import (
    BadRequestError,
    ProtocolError,
    ProtocolViolationError,
    QueueFullError,
    TandemTimeoutError,
)
from protocol.messages import (
    PROTOCOL_VERSION,
    CancelRequest,
    ErrorCode,
    ErrorReply,
    Phase,
    SlotStatus,
    StatusReply,
    StatusRequest,
    SubmitRequest,
    TokenEvent,
    Usage,
)
from protocol.sockets import DaemonToClients

TICK_S = 0.002


class EchoServer(threading.Thread):
    """Echo daemon. Prompt text comes back one character per event (token id = ord);
    prompt_ids come back as "<id>"; chat messages as their joined contents. Prompts
    "!queue_full", "!bad", "!anonymous_error" and "!silent" answer with an error or never
    answer."""

    def __init__(self, run_dir: str):
        super().__init__(daemon=True)
        self.run_dir = run_dir
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.active: dict[tuple[bytes, str], dict] = {}
        self.cancelled: list[str] = []
        self.submitted: list[SubmitRequest] = []

    def run(self) -> None:
        with DaemonToClients.in_run_dir(self.run_dir) as sock:
            self.ready.set()
            while not self.stopping.is_set():
                try:
                    peer, msg = sock.recv(timeout=TICK_S)
                    self.handle(sock, peer, msg)
                except TimeoutError:
                    pass
                except ProtocolError as exc:
                    sock.send_to(exc.peer, ErrorReply(code=ErrorCode.PROTOCOL, message=str(exc)))
                for key in list(self.active):
                    self.emit(sock, key)

    def handle(self, sock: DaemonToClients, peer: bytes, msg) -> None:
        if isinstance(msg, SubmitRequest):
            self.submitted.append(msg)
            if msg.prompt in ("!queue_full", "!bad"):
                full = msg.prompt == "!queue_full"
                code = ErrorCode.QUEUE_FULL if full else ErrorCode.BAD_REQUEST
                sock.send_to(peer, ErrorReply(code=code, message="no", request_id=msg.request_id,
                                              retry_after_s=1.0))
            elif msg.prompt == "!anonymous_error":  # an error the daemon cannot attribute
                sock.send_to(peer, ErrorReply(code=ErrorCode.PROTOCOL, message="garbled"))
            elif msg.prompt != "!silent":
                if msg.prompt is not None:
                    pieces = [(ord(c), c) for c in msg.prompt]
                elif msg.prompt_ids is not None:
                    pieces = [(int(t), f"<{t}>") for t in msg.prompt_ids]
                else:
                    pieces = [(ord(c), c) for c in "|".join(m.content for m in msg.messages)]
                self.active[(peer, msg.request_id)] = {"req": msg, "pieces": pieces, "n": 0}
        elif isinstance(msg, CancelRequest):
            self.cancelled.append(msg.request_id)
            state = self.active.pop((peer, msg.request_id), None)
            if state is not None:
                sock.send_to(peer, TokenEvent(request_id=msg.request_id, index=state["n"],
                                              token_ids=[], text="", finish_reason="cancelled"))
        elif isinstance(msg, StatusRequest):
            slots = [SlotStatus(slot=i, request_id=rid, phase=Phase.DECODE, prompt_done=0,
                                prompt_len=0, num_generated=s["n"])
                     for i, ((_, rid), s) in enumerate(self.active.items())]
            sock.send_to(peer, StatusReply(query_id=msg.query_id, model="echo",
                                           protocol_version=PROTOCOL_VERSION, max_slots=8,
                                           queue_depth=0, slots=slots))

    def emit(self, sock: DaemonToClients, key: tuple[bytes, str]) -> None:
        state = self.active[key]
        req, n = state["req"], state["n"]
        token, text = state["pieces"][n]
        state["n"] = n = n + 1
        finish = "length" if n >= req.max_tokens else "stop" if n == len(state["pieces"]) else None
        usage = None
        if finish is not None:
            del self.active[key]
            if req.include_usage:
                usage = Usage(prompt_tokens=len(state["pieces"]), completion_tokens=n)
        sock.send_to(key[0], TokenEvent(request_id=req.request_id, index=n - 1,
                                        token_ids=[token], text=text, finish_reason=finish,
                                        usage=usage))


@pytest.fixture
def server():
    run_dir = tempfile.mkdtemp(prefix="tdm-")
    os.chmod(run_dir, 0o700)
    srv = EchoServer(run_dir)
    srv.start()
    assert srv.ready.wait(5)
    yield srv
    srv.stopping.set()
    srv.join(5)
    shutil.rmtree(run_dir, ignore_errors=True)


def wait_for(cond, timeout=2.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_generate_text_ids_and_chat(server):
    with TandemClient(run_dir=server.run_dir, timeout=5) as client:
        out = client.generate("Hello", max_tokens=100, temperature=0, seed=3, stop=["\n"])
        assert (out.text, out.token_ids, out.finish_reason) == ("Hello", [72, 101, 108, 108, 111],
                                                                "stop")
        assert out.usage == Usage(prompt_tokens=5, completion_tokens=5)
        out = client.generate(prompt_ids=[7, 8, 9], max_tokens=2)
        assert (out.text, out.token_ids, out.finish_reason) == ("<7><8>", [7, 8], "length")
        out = client.generate(messages=[{"role": "user", "content": "ab"},
                                        {"role": "user", "content": "c"}], max_tokens=10)
        assert out.text == "ab|c"
    sent = server.submitted[0]
    assert sent.sampling.temperature == 0 and sent.sampling.seed == 3 and sent.stop == ["\n"]


def test_concurrent_requests_on_one_connection_are_routed_by_id(server):
    prompts = {"alpha": "a" * 30, "beta": "b" * 20, "gamma": "c" * 25}
    with TandemClient(run_dir=server.run_dir, timeout=5) as client:
        ids = {name: client.submit(p, max_tokens=100) for name, p in prompts.items()}
        # Consume in reverse order: the others' events are buffered meanwhile.
        for name in reversed(list(prompts)):
            events = list(client.stream(ids[name]))
            assert [e.index for e in events] == list(range(len(prompts[name])))
            assert "".join(e.text for e in events) == prompts[name]
            assert events[-1].finish_reason == "stop"
            assert all(e.request_id == ids[name] for e in events)


def test_cancel_and_leaving_a_stream_early(server):
    with TandemClient(run_dir=server.run_dir, timeout=5) as client:
        long_rid = client.submit("x" * 5000, max_tokens=5000)
        other = client.submit("keep going", max_tokens=100)
        stream = client.stream(long_rid)
        first = next(stream)
        assert first.text == "x"
        client.cancel(long_rid)
        rest = list(stream)
        assert rest[-1].finish_reason == "cancelled" and len(rest) < 4999
        assert "".join(e.text for e in client.stream(other)) == "keep going"
        # Breaking out of a stream cancels the request on the daemon.
        rid = client.submit("y" * 5000, max_tokens=5000)
        for _ in client.stream(rid):
            break
        wait_for(lambda: rid in server.cancelled)
        assert client.status().active_slots == 0


def test_errors_are_typed_and_timeouts_cancel(server):
    with TandemClient(run_dir=server.run_dir, timeout=0.3) as client:
        with pytest.raises(QueueFullError) as info:
            client.generate("!queue_full")
        assert info.value.retry_after_s == 1.0 and info.value.code == ErrorCode.QUEUE_FULL
        with pytest.raises(BadRequestError):
            client.generate("!bad")
        rid = client.submit("!silent")
        with pytest.raises(TandemTimeoutError):
            list(client.stream(rid))
        wait_for(lambda: rid in server.cancelled)
        with pytest.raises(ValueError):
            client.submit("a", prompt_ids=[1])
        with pytest.raises(ValueError):
            client.submit("a", temperature=-1)
        # An error without a request id fails the requests still waiting for a first answer,
        # not those already streaming.
        streaming = client.submit("s" * 50, max_tokens=50)
        events = client.stream(streaming)
        assert next(events).text == "s"
        with pytest.raises(ProtocolViolationError):
            client.generate("!anonymous_error")
        assert "".join(e.text for e in events) == "s" * 49
        # After all that, the connection still serves.
        assert client.generate("ok").text == "ok"


def test_no_daemon_is_a_timeout_not_a_hang():
    with tempfile.TemporaryDirectory(prefix="tdm-") as run_dir, \
            TandemClient(run_dir=run_dir, timeout=0.2) as client:
        start = time.monotonic()
        with pytest.raises(TandemTimeoutError):
            client.submit("anyone there?")
        assert time.monotonic() - start < 2


def test_status(server):
    with TandemClient(run_dir=server.run_dir, timeout=5) as client:
        rid = client.submit("z" * 1000, max_tokens=1000)
        status = client.status()
        assert status.model == "echo" and status.protocol_version == PROTOCOL_VERSION
        assert [s.request_id for s in status.slots] == [rid] and status.active_slots == 1
        client.cancel(rid)


async def test_async_client_concurrent_generate_cancel_and_status(server):
    async with AsyncTandemClient(run_dir=server.run_dir, timeout=5) as client:
        prompts = [f"request {i} " * (i + 2) for i in range(4)]
        outs = await asyncio.gather(*(client.generate(p, max_tokens=500) for p in prompts))
        assert [o.text for o in outs] == prompts
        assert all(o.finish_reason == "stop" for o in outs)
        assert len({o.request_id for o in outs}) == 4

        rid = await client.submit("q" * 5000, max_tokens=5000)
        status = await client.status()
        assert rid in [s.request_id for s in status.slots]
        events = []
        async for event in client.stream(rid):
            events.append(event)
            if len(events) == 3:
                await client.cancel(rid)
        assert events[-1].finish_reason == "cancelled" and len(events) < 100

        with pytest.raises(QueueFullError):
            await client.generate("!queue_full")
        rid = await client.submit("!silent")
        with pytest.raises(TandemTimeoutError):
            async for _ in client.stream(rid, timeout=0.2):
                pass
        await asyncio.to_thread(wait_for, lambda: rid in server.cancelled)

"""Socket roles over real ZeroMQ sockets: ipc round trips and 0600 files, typed errors for
bad input on a live socket, CURVE on tcp://127.0.0.1 (right key works, wrong key hears
nothing), and refusal of tcp:// without keys."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import tempfile

import msgpack
import numpy as np
import pytest
import zmq

from protocol.codec import Limits, encode
from protocol.curve import CurveClientKeys, CurveServerKeys, new_keypair
from protocol.errors import ProtocolError
from protocol.errors import ProtocolErrorCode as E
from protocol.messages import (
    ErrorCode,
    ErrorReply,
    Heartbeat,
    Ping,
    Pong,
    SamplingParams,
    SlotWork,
    StatusRequest,
    StepPlan,
    SubmitRequest,
    WorkKind,
    token_array,
)
from protocol.sockets import (
    AsyncDaemonToClients,
    AsyncDaemonToWorker,
    AsyncWorkerToDaemon,
    ClientToDaemon,
    DaemonToClients,
    DaemonToWorker,
    SocketConfigError,
    WorkerToDaemon,
    client_address,
    worker_address,
)


@pytest.fixture
def run_dir():
    path = tempfile.mkdtemp(prefix="tdm-")  # short: ipc paths are limited to 107 bytes
    os.chmod(path, 0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def prefill(n: int) -> StepPlan:
    return StepPlan(step_id=1, slots=[SlotWork(
        slot=0, request_id="r", kind=WorkKind.PREFILL, input_ids=token_array(range(n)),
        start_pos=0, num_tokens=n, needs_logits=True, prompt_len=n,
        sampling=SamplingParams(seed=1))])


def test_worker_link_round_trip_over_ipc(run_dir):
    assert worker_address(run_dir) == f"ipc://{run_dir}/worker.sock"
    with DaemonToWorker.in_run_dir(run_dir) as daemon, WorkerToDaemon.in_run_dir(run_dir) as worker:
        mode = os.stat(os.path.join(run_dir, "worker.sock")).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        # The worker can speak first (READY) without waiting for the daemon.
        worker.send(Heartbeat(seq=1, time_ns=5), timeout=2)
        assert daemon.recv(timeout=2) == Heartbeat(seq=1, time_ns=5)
        daemon.send(prefill(100_000), timeout=2)
        plan = worker.recv(timeout=2)
        assert isinstance(plan, StepPlan)
        ids = plan.slots[0].input_ids
        assert ids.dtype == np.int32 and np.array_equal(ids, np.arange(100_000))
        assert not ids.flags.writeable  # a borrowed view of the received frame


def test_roles_refuse_messages_of_the_wrong_direction(run_dir):
    with DaemonToWorker.in_run_dir(run_dir) as daemon, WorkerToDaemon.in_run_dir(run_dir) as worker:
        with pytest.raises(ValueError):
            daemon.send(Heartbeat(seq=1, time_ns=1), timeout=1)  # worker -> daemon only
        # A worker that sends a daemon -> worker kind gets a typed error on the daemon side.
        worker.socket.send_multipart([b"daemon", *encode(prefill(3))])
        with pytest.raises(ProtocolError) as info:
            daemon.recv(timeout=2)
        assert info.value.code == E.UNEXPECTED_KIND


def test_daemon_send_times_out_without_a_worker(run_dir):
    with DaemonToWorker.in_run_dir(run_dir) as daemon, pytest.raises(TimeoutError):
        daemon.send(Ping(nonce=1, time_ns=1), timeout=0.1)


def test_client_link_typed_errors_and_keeps_serving(run_dir):
    limits = Limits(max_body_bytes=4096, max_frame_bytes=1 << 20)
    with DaemonToClients.in_run_dir(run_dir, limits=limits) as daemon, \
            ClientToDaemon(client_address(run_dir)) as client:
        assert stat.S_IMODE(os.stat(os.path.join(run_dir, "client.sock")).st_mode) == 0o600
        raw = client.socket
        for frames, code in [
            ([b"\x7f", msgpack.packb({})], E.UNKNOWN_KIND),
            ([b"\x30", b"\xc1garbage"], E.MALFORMED),
            (encode(SubmitRequest(request_id="big", prompt="x" * 10_000)), E.TOO_LARGE),
            ([b"\x32", msgpack.packb({"query_id": "q", "extra": 1})], E.UNKNOWN_FIELD),
        ]:
            raw.send_multipart(frames)
            with pytest.raises(ProtocolError) as info:
                daemon.recv(timeout=2)
            assert info.value.code == code and info.value.peer
            # The daemon answers on the same socket and then serves normally.
            daemon.send_to(info.value.peer, ErrorReply(code=ErrorCode.PROTOCOL,
                                                       message=info.value.message))
            reply = client.recv(timeout=2)
            assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.PROTOCOL
        client.send(Ping(nonce=9, time_ns=0))
        peer, msg = daemon.recv(timeout=2)
        assert msg == Ping(nonce=9, time_ns=0)
        assert daemon.send_to(peer, Pong(nonce=9, time_ns=0))
        assert client.recv(timeout=2) == Pong(nonce=9, time_ns=0)
        assert daemon.send_to(b"no-such-client", Pong(nonce=1, time_ns=0)) is False


def test_parts_over_maxmsgsize_drop_only_that_client(run_dir):
    limits = Limits(max_body_bytes=4096, max_frame_bytes=64 << 10)
    with DaemonToClients.in_run_dir(run_dir, limits=limits) as daemon, \
            ClientToDaemon.in_run_dir(run_dir) as rogue, \
            ClientToDaemon.in_run_dir(run_dir) as polite:
        assert daemon.socket.getsockopt(zmq.MAXMSGSIZE) == 64 << 10
        rogue.send(SubmitRequest(request_id="huge", prompt_ids=token_array(range(100_000))))
        with pytest.raises(TimeoutError):  # libzmq dropped the connection, nothing decoded
            daemon.recv(timeout=0.2)
        polite.send(StatusRequest(query_id="still there?"))
        assert daemon.recv(timeout=2)[1] == StatusRequest(query_id="still there?")


async def test_async_roles_round_trip(run_dir):
    with AsyncDaemonToWorker.in_run_dir(run_dir) as daemon, \
            AsyncWorkerToDaemon.in_run_dir(run_dir) as worker:
        await worker.send(Heartbeat(seq=2, time_ns=3), timeout=2)
        assert await daemon.recv(timeout=2) == Heartbeat(seq=2, time_ns=3)
        await daemon.send(prefill(5000), timeout=2)
        plan = await worker.recv(timeout=2)
        assert plan.slots[0].input_ids.tolist() == list(range(5000))
        with pytest.raises(TimeoutError):
            await daemon.recv(timeout=0.05)
    with AsyncDaemonToClients.in_run_dir(run_dir) as daemon, \
            ClientToDaemon.in_run_dir(run_dir) as client:
        client.send(StatusRequest(query_id="q1"), timeout=2)
        peer, msg = await daemon.recv(timeout=2)
        assert msg == StatusRequest(query_id="q1")
        assert await daemon.send_to(peer, Pong(nonce=1, time_ns=2))
        assert client.recv(timeout=2) == Pong(nonce=1, time_ns=2)


def test_tcp_requires_curve_keys():
    with pytest.raises(SocketConfigError, match="CURVE"):
        DaemonToClients("tcp://127.0.0.1:0")
    with pytest.raises(SocketConfigError, match="CURVE"):
        ClientToDaemon("tcp://127.0.0.1:5555")
    with pytest.raises(SocketConfigError, match="shorter run dir"):
        DaemonToClients.in_run_dir("/tmp/" + "x" * 120)
    with pytest.raises(ValueError):
        CurveServerKeys(public_key=b"short", secret_key=b"short", client_public_keys=frozenset())


def test_curve_over_tcp_admits_only_listed_clients():
    server_pub, server_sec = new_keypair()
    good_pub, good_sec = new_keypair()
    bad_pub, bad_sec = new_keypair()
    keys = CurveServerKeys(public_key=server_pub, secret_key=server_sec,
                           client_public_keys=frozenset({good_pub}))
    with DaemonToClients("tcp://127.0.0.1:0", server_keys=keys) as daemon:
        assert daemon.address.startswith("tcp://127.0.0.1:") and not daemon.address.endswith(":0")
        good = ClientToDaemon(daemon.address, client_keys=CurveClientKeys(
            public_key=good_pub, secret_key=good_sec, server_public_key=server_pub))
        bad = ClientToDaemon(daemon.address, client_keys=CurveClientKeys(
            public_key=bad_pub, secret_key=bad_sec, server_public_key=server_pub))
        with good, bad:
            good.send(StatusRequest(query_id="friend"), timeout=3)
            with pytest.raises(TimeoutError):  # refused by ZAP: no connection to send on
                bad.send(StatusRequest(query_id="intruder"), timeout=0.3)
            peer, msg = daemon.recv(timeout=3)
            assert msg == StatusRequest(query_id="friend")
            assert daemon.send_to(peer, Pong(nonce=1, time_ns=1))
            assert good.recv(timeout=3) == Pong(nonce=1, time_ns=1)
            with pytest.raises(TimeoutError):  # the unlisted key never got through
                daemon.recv(timeout=0.1)
            with pytest.raises(TimeoutError):
                bad.recv(timeout=0.1)


async def test_the_daemon_learns_which_clients_went_away(run_dir):
    with AsyncDaemonToClients.in_run_dir(run_dir) as daemon:
        first, second = ClientToDaemon.in_run_dir(run_dir), ClientToDaemon.in_run_dir(run_dir)
        first.send(StatusRequest(query_id="a"), timeout=2)
        second.send(StatusRequest(query_id="b"), timeout=2)
        peers = {}
        for _ in range(2):
            peer, msg = await daemon.recv(timeout=2)
            peers[msg.query_id] = peer
        assert daemon.gone() == []
        first.close()
        deadline = asyncio.get_running_loop().time() + 3
        gone = []
        while not gone and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
            gone = daemon.gone()
        assert gone == [peers["a"]]
        second.send(StatusRequest(query_id="c"), timeout=2)  # the other one is still served
        peer, msg = await daemon.recv(timeout=2)
        assert msg.query_id == "c" and peer == peers["b"]
        second.close()


def test_a_protocol_error_names_the_request_it_failed(run_dir):
    with DaemonToClients.in_run_dir(run_dir) as daemon, \
            ClientToDaemon.in_run_dir(run_dir) as client:
        frames = encode(SubmitRequest(request_id="mine-7", prompt="x"))
        body = msgpack.unpackb(frames[1])
        body["max_tokens"] = "many"
        client.socket.send_multipart([frames[0], msgpack.packb(body)])
        with pytest.raises(ProtocolError) as info:
            daemon.recv(timeout=2)
        assert info.value.request_id == "mine-7" and info.value.peer is not None

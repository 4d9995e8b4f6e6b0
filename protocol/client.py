"""The ZeroMQ client library: `TandemClient` (blocking) and `AsyncTandemClient` (asyncio).

    with TandemClient(run_dir="/run/tandem") as client:
        print(client.generate("Once upon a time", max_tokens=32, temperature=0).text)

One connection carries any number of concurrent requests; events are routed by request id.
Leaving `stream()` before the final event (break, exception, timeout) cancels the request.
A client object is not thread-safe: use it from one thread (or one event loop).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import os
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from protocol.client_messages import MODEL_DEFAULT_FIELDS
from protocol.codec import DEFAULT_LIMITS, Limits
from protocol.curve import CurveClientKeys
from protocol.errors import ProtocolError, TandemError, TandemTimeoutError, error_from_reply
from protocol.messages import (
    CancelRequest,
    ChatMessage,
    ErrorReply,
    Message,
    SamplingParams,
    StatusReply,
    StatusRequest,
    SubmitRequest,
    TokenEvent,
    Usage,
    token_array,
)
from protocol.run_dir import check_client_run_dir
from protocol.sockets import AsyncClientToDaemon, ClientToDaemon, client_address

DEFAULT_TIMEOUT_S = 60.0


@dataclass(slots=True)
class Completion:
    """The whole output of one request, as `generate()` returns it."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None

    def add(self, event: TokenEvent) -> None:
        self.text += event.text
        self.token_ids.extend(event.token_ids)
        self.finish_reason = event.finish_reason
        self.usage = event.usage or self.usage


def build_submit(prompt: str | None = None, *, prompt_ids: Sequence[int] | None = None,
                 messages: Sequence[dict | ChatMessage] | None = None, max_tokens: int = 256,
                 temperature: float | None = None, top_p: float | None = None,
                 top_k: int | None = None, min_p: float | None = None, seed: int | None = None,
                 stop: Sequence[str] = (), priority: int = 0, stream: bool = True,
                 include_usage: bool = True, request_id: str | None = None,
                 speculation: bool = True, user: str | None = None,
                 **penalties: float) -> SubmitRequest:
    """A SubmitRequest from keyword arguments; raises ValueError on bad values.
    temperature, top_p, top_k, min_p left out (None) take the model's generation defaults
    (generation_config.json), as on the HTTP API; `seed` left out: a random one.
    `penalties`: repetition_penalty, presence_penalty, frequency_penalty. `user`: OpenAI's
    field (a synthetic model's routing key, docs/synthetic.md; real models ignore it)."""
    chat = None
    if messages is not None:
        chat = [m if isinstance(m, ChatMessage) else ChatMessage(role=m["role"],
                                                                 content=m["content"])
                for m in messages]
    given = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p}
    sampling = SamplingParams(seed=seed, **{k: v for k, v in given.items() if v is not None},
                              **penalties)
    return SubmitRequest(
        request_id=request_id or uuid.uuid4().hex, prompt=prompt,
        prompt_ids=None if prompt_ids is None else token_array(prompt_ids), messages=chat,
        sampling=sampling, max_tokens=max_tokens, stop=list(stop), stream=stream,
        priority=priority, include_usage=include_usage, speculation=speculation, user=user,
        sampling_from_model=[k for k in MODEL_DEFAULT_FIELDS if given[k] is None])


class _Core(abc.ABC):
    """Routing shared by both clients: events and errors by request id, replies by query id."""

    _socket_cls: type  # ClientToDaemon or AsyncClientToDaemon

    def __init__(self, address: str | None = None, *, run_dir: str | os.PathLike | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S, client_keys: CurveClientKeys | None = None,
                 limits: Limits = DEFAULT_LIMITS, context: Any = None):
        if (address is None) == (run_dir is None):
            raise ValueError("give exactly one of address, run_dir")
        self.address = address or client_address(check_client_run_dir(run_dir))
        self.timeout = timeout
        self._conn = self._socket_cls(self.address, client_keys=client_keys, limits=limits,
                                      context=context)
        self._fresh: set[str] = set()  # submitted, no event yet

    @abc.abstractmethod
    def _deliver(self, request_id: str, item: TokenEvent | TandemError) -> None:
        """Hand an event or error to the waiter of ``request_id``."""

    @abc.abstractmethod
    def _deliver_status(self, query_id: str, item: StatusReply | TandemError) -> None:
        """Hand a status reply or error to the waiter of ``query_id``."""

    @abc.abstractmethod
    def _open_ids(self) -> tuple[list[str], list[str]]:
        """(request ids, query ids) still waiting for an answer."""

    def _route(self, msg: Message) -> None:
        if isinstance(msg, TokenEvent):
            self._fresh.discard(msg.request_id)
            self._deliver(msg.request_id, msg)
        elif isinstance(msg, StatusReply):
            self._deliver_status(msg.query_id, msg)
        elif isinstance(msg, ErrorReply):
            err = error_from_reply(msg)
            if msg.request_id is not None:
                self._fresh.discard(msg.request_id)
                self._deliver(msg.request_id, err)
                return
            # No id: the daemon could not tell which message failed; fail whatever is waiting
            # for its first answer.
            requests, queries = self._open_ids()
            for rid in [r for r in requests if r in self._fresh]:
                self._fresh.discard(rid)
                self._deliver(rid, err)
            for qid in queries:
                self._deliver_status(qid, err)


def _garbled(exc: ProtocolError) -> TandemError:
    return TandemError(f"daemon sent a malformed message: {exc}")


def _ends(item: TokenEvent | TandemError) -> bool:
    """Whether a stream's item is its last (an error or a finished event)."""
    return isinstance(item, TandemError) or item.finish_reason is not None


def _event(item: TokenEvent | TandemError) -> TokenEvent:
    """The event, or raise the error that ends the stream."""
    if isinstance(item, TandemError):
        raise item
    return item


class TandemClient(_Core):
    """Blocking client. `timeout` bounds every wait for the daemon (seconds between events)."""

    _socket_cls = ClientToDaemon

    def __init__(self, address: str | None = None, **kwargs: Any):
        super().__init__(address, **kwargs)
        self._inbox: dict[str, deque[TokenEvent | TandemError]] = {}
        self._replies: dict[str, StatusReply | TandemError | None] = {}

    def _deliver(self, request_id: str, item: TokenEvent | TandemError) -> None:
        if request_id in self._inbox:  # else finished or cancelled here: drop
            self._inbox[request_id].append(item)

    def _deliver_status(self, query_id: str, item: StatusReply | TandemError) -> None:
        if query_id in self._replies:
            self._replies[query_id] = item

    def _open_ids(self) -> tuple[list[str], list[str]]:
        return list(self._inbox), [q for q, r in self._replies.items() if r is None]

    def _pump(self, timeout: float) -> None:
        try:
            self._route(self._conn.recv(timeout))
        except TimeoutError:
            raise TandemTimeoutError(f"no answer from {self.address} within {timeout}s") from None
        except ProtocolError as exc:
            raise _garbled(exc) from exc

    def _send(self, msg: Message) -> None:
        try:
            self._conn.send(msg, timeout=self.timeout)
        except TimeoutError:
            raise TandemTimeoutError(f"could not send to {self.address}") from None

    def submit(self, prompt: str | None = None, **kwargs: Any) -> str:
        """Start a request (see `build_submit` for the arguments); returns its request id."""
        req = build_submit(prompt, **kwargs)
        if req.request_id in self._inbox:
            raise ValueError(f"request id {req.request_id!r} is already in flight")
        self._inbox[req.request_id] = deque()
        self._fresh.add(req.request_id)
        try:
            self._send(req)
        except BaseException:
            del self._inbox[req.request_id]
            raise
        return req.request_id

    def stream(self, request_id: str, *, timeout: float | None = None) -> Iterator[TokenEvent]:
        """The request's TokenEvents up to and including the final one (finish_reason set).
        Raises the TandemError of an ErrorReply, or TandemTimeoutError after `timeout`
        seconds without an event."""
        if request_id not in self._inbox:
            raise KeyError(f"unknown request id {request_id!r}")
        inbox, wait = self._inbox[request_id], timeout or self.timeout
        done = False
        try:
            while True:
                while not inbox:
                    self._pump(wait)
                item = inbox.popleft()
                done = _ends(item)
                yield _event(item)
                if done:
                    return
        finally:
            self._inbox.pop(request_id, None)
            self._fresh.discard(request_id)
            if not done:  # the caller walked away: stop the work on the daemon
                with contextlib.suppress(TimeoutError):
                    self._conn.send(CancelRequest(request_id=request_id), timeout=self.timeout)

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        """Submit and wait for the whole output."""
        rid = self.submit(prompt, **kwargs)
        out = Completion(rid)
        for event in self.stream(rid):
            out.add(event)
        return out

    def cancel(self, request_id: str) -> None:
        """Ask the daemon to stop the request; its stream ends with finish_reason "cancelled"."""
        self._send(CancelRequest(request_id=request_id))

    def status(self, *, timeout: float | None = None) -> StatusReply:
        qid = uuid.uuid4().hex
        self._replies[qid] = None
        try:
            self._send(StatusRequest(query_id=qid))
            while self._replies[qid] is None:
                self._pump(timeout or self.timeout)
            reply = self._replies[qid]
        finally:
            self._replies.pop(qid, None)
        if isinstance(reply, TandemError):
            raise reply
        return reply

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> TandemClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncTandemClient(_Core):
    """asyncio client; a background task reads the socket and routes events to waiters."""

    _socket_cls = AsyncClientToDaemon

    def __init__(self, address: str | None = None, **kwargs: Any):
        super().__init__(address, **kwargs)
        self._queues: dict[str, asyncio.Queue[TokenEvent | TandemError]] = {}
        self._replies: dict[str, asyncio.Future[StatusReply]] = {}
        self._reader: asyncio.Task | None = None

    def _deliver(self, request_id: str, item: TokenEvent | TandemError) -> None:
        if request_id in self._queues:
            self._queues[request_id].put_nowait(item)

    def _deliver_status(self, query_id: str, item: StatusReply | TandemError) -> None:
        fut = self._replies.get(query_id)
        if fut is not None and not fut.done():
            if isinstance(item, TandemError):
                fut.set_exception(item)
            else:
                fut.set_result(item)

    def _open_ids(self) -> tuple[list[str], list[str]]:
        return list(self._queues), list(self._replies)

    async def _read_loop(self) -> None:
        while True:
            try:
                self._route(await self._conn.recv())
            except ProtocolError as exc:  # garbage from the daemon fails everything waiting
                err = _garbled(exc)
                for rid in list(self._queues):
                    self._deliver(rid, err)
                for qid in list(self._replies):
                    self._deliver_status(qid, err)

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def _send(self, msg: Message) -> None:
        self._ensure_reader()
        try:
            await self._conn.send(msg, timeout=self.timeout)
        except TimeoutError:
            raise TandemTimeoutError(f"could not send to {self.address}") from None

    async def submit(self, prompt: str | None = None, **kwargs: Any) -> str:
        req = build_submit(prompt, **kwargs)
        if req.request_id in self._queues:
            raise ValueError(f"request id {req.request_id!r} is already in flight")
        self._queues[req.request_id] = asyncio.Queue()
        self._fresh.add(req.request_id)
        try:
            await self._send(req)
        except BaseException:
            del self._queues[req.request_id]
            raise
        return req.request_id

    async def stream(self, request_id: str, *,
                     timeout: float | None = None) -> AsyncIterator[TokenEvent]:
        if request_id not in self._queues:
            raise KeyError(f"unknown request id {request_id!r}")
        queue, wait = self._queues[request_id], timeout or self.timeout
        done = False
        try:
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), wait)
                except TimeoutError:
                    raise TandemTimeoutError(f"no event within {wait}s",
                                             request_id=request_id) from None
                done = _ends(item)
                yield _event(item)
                if done:
                    return
        finally:
            self._queues.pop(request_id, None)
            self._fresh.discard(request_id)
            if not done:
                with contextlib.suppress(TimeoutError):
                    await self._conn.send(CancelRequest(request_id=request_id),
                                          timeout=self.timeout)

    async def generate(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        rid = await self.submit(prompt, **kwargs)
        out = Completion(rid)
        async for event in self.stream(rid):
            out.add(event)
        return out

    async def cancel(self, request_id: str) -> None:
        await self._send(CancelRequest(request_id=request_id))

    async def status(self, *, timeout: float | None = None) -> StatusReply:
        qid = uuid.uuid4().hex
        fut = self._replies[qid] = asyncio.get_running_loop().create_future()
        try:
            await self._send(StatusRequest(query_id=qid))
            return await asyncio.wait_for(fut, timeout or self.timeout)
        except TimeoutError:
            raise TandemTimeoutError(f"no status reply within {timeout or self.timeout}s") from None
        finally:
            self._replies.pop(qid, None)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        self._conn.close()

    async def __aenter__(self) -> AsyncTandemClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

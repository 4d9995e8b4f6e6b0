"""The ZeroMQ client API: SubmitRequest / CancelRequest / StatusRequest in, events out."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets

from daemon.config import Config
from daemon.logs import get_logger
from daemon.openai_schema import PRIORITY_RANGE, ROLES
from daemon.request import (
    EngineUnavailable,
    GenerationRequest,
    QueueFull,
    RequestRejected,
)
from daemon.scheduler import Scheduler
from daemon.tokenizer import TokenizerError
from protocol.codec import Limits
from protocol.curve import CurveServerKeys
from protocol.errors import ProtocolError
from protocol.messages import (
    MAX_SEED,
    PROTOCOL_VERSION,
    CancelRequest,
    ChatMessage,
    ErrorCode,
    ErrorReply,
    ModelInfo,
    Phase,
    Ping,
    Pong,
    SamplingParams,
    SlotStatus,
    StatusReply,
    StatusRequest,
    SubmitRequest,
    TokenEvent,
    Usage,
    penalty_error,
    vocab_error,
)
from protocol.sockets import AsyncDaemonToClients

log = get_logger("tandem.api_zmq")
REAP_POLL_S = 0.25  # how often closed client connections are looked for
# daemon.progress states (the worker's reports); a queued request holds no slot
PHASES = {"idle": None, "prefilling": Phase.PREFILL, "decoding": Phase.DECODE}


class ZmqApi:
    def __init__(self, config: Config, scheduler: Scheduler, tokenizer) -> None:
        self.config = config
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.vocab_size: int | None = getattr(tokenizer, "vocab_size", None)
        self.defaults: dict[str, float] = {}  # the model's sampling defaults (READY)
        server = config.server
        keys = None
        if server.zmq_endpoint.startswith("tcp://"):
            secret = server.zmq_curve_secret_key_file.read_text().strip()
            keys = CurveServerKeys(server.zmq_curve_public_key.encode(), secret.encode(),
                                   frozenset(k.encode() for k in server.zmq_curve_client_keys))
        server.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Bodies over max_body_bytes get a typed TOO_LARGE; parts over 4x that are dropped by
        # libzmq before they are buffered (zmq.MAXMSGSIZE = max_part_bytes).
        limit = server.max_body_bytes
        limits = Limits(max_body_bytes=limit, max_frame_bytes=4 * limit,
                        max_total_bytes=8 * limit)
        self.sock = AsyncDaemonToClients(server.zmq_endpoint, server_keys=keys, limits=limits)
        self.address = self.sock.address
        self._streams: dict[tuple[bytes, str], asyncio.Task] = {}

    async def serve(self) -> None:
        reaper = asyncio.create_task(self._reap())
        try:
            await self._serve()
        finally:
            reaper.cancel()

    async def _reap(self) -> None:
        """Cancel the requests of clients that went away (every kind of request: a
        non-streaming one sends nothing until it ends, so no failed send would tell)."""
        while True:
            await asyncio.sleep(REAP_POLL_S)
            for peer in self.sock.gone():
                for p, rid in [k for k in self._streams if k[0] == peer]:
                    if self.scheduler.cancel(_internal_id(p, rid)):
                        log.info("client_disconnected", request_id=_internal_id(p, rid))

    async def _serve(self) -> None:
        while True:
            try:
                peer, msg = await self.sock.recv()
            except ProtocolError as exc:
                log.info("zmq_protocol_error", error=str(exc), request_id=exc.request_id)
                if exc.peer is not None:
                    await self.sock.send_to(exc.peer, ErrorReply(
                        code=ErrorCode.PROTOCOL, message=str(exc), request_id=exc.request_id))
                continue
            if isinstance(msg, SubmitRequest):
                await self._submit(peer, msg)
            elif isinstance(msg, CancelRequest):
                self.scheduler.cancel(_internal_id(peer, msg.request_id))
            elif isinstance(msg, StatusRequest):
                await self.sock.send_to(peer, self._status(msg.query_id))
            elif isinstance(msg, Ping):
                await self.sock.send_to(peer, Pong(nonce=msg.nonce, time_ns=msg.time_ns))

    def worker_ready(self, info: ModelInfo) -> None:
        """The worker's READY: its vocabulary bounds prompt ids; its sampling defaults fill
        the fields a request leaves to the model (SubmitRequest.sampling_from_model)."""
        self.vocab_size = info.vocab_size
        self.defaults = info.generation_defaults.as_dict()

    def close(self) -> None:
        for task in self._streams.values():
            task.cancel()
        self.sock.close()

    async def _submit(self, peer: bytes, msg: SubmitRequest) -> None:
        rid = msg.request_id
        try:
            req = self._request(peer, msg)
            handle = self.scheduler.submit(req)
        except (RequestRejected, ValueError) as exc:
            return await self._error(peer, ErrorCode.BAD_REQUEST, str(exc), rid)
        except QueueFull as exc:
            return await self.sock.send_to(peer, ErrorReply(
                code=ErrorCode.QUEUE_FULL, message=str(exc), request_id=rid,
                retry_after_s=exc.retry_after))
        except EngineUnavailable as exc:
            return await self._error(peer, ErrorCode.WORKER_DIED, str(exc), rid)
        except Exception:  # a fault of ours: say so, keep serving the others
            log.exception("internal_error", request_id=rid)
            return await self._error(peer, ErrorCode.INTERNAL, "internal server error", rid)
        log.info("zmq_request_submitted", request_id=req.request_id,
                 prompt_tokens=len(req.prompt_ids), max_tokens=req.max_tokens,
                 stream=msg.stream, priority=req.priority)
        task = asyncio.create_task(self._stream(peer, msg, handle))
        self._streams[(peer, rid)] = task
        task.add_done_callback(lambda _: self._streams.pop((peer, rid), None))

    def _request(self, peer: bytes, msg: SubmitRequest) -> GenerationRequest:
        limits = self.config
        history = None  # a chat's tokens its next turn repeats
        if msg.prompt_ids is not None:
            ids = [int(t) for t in msg.prompt_ids]
            error = vocab_error(ids, self.vocab_size)
            if error is not None:  # the HTTP API refuses them alike
                raise RequestRejected(error)
        else:
            if self.tokenizer is None:
                raise RequestRejected("this model has no tokenizer: send prompt_ids")
            try:
                if msg.messages is None:
                    ids = self.tokenizer.encode(msg.prompt)
                else:
                    messages = [_message(m) for m in msg.messages]
                    ids = self.tokenizer.encode_chat(messages)
                    history = self.tokenizer.chat_history_len(ids, messages)
            except TokenizerError as exc:
                raise RequestRejected(str(exc)) from None
            if not ids:
                raise RequestRejected("the prompt encodes to zero tokens")
        if len(ids) > limits.max_prompt_tokens:
            raise RequestRejected(f"the prompt has {len(ids)} tokens; the limit is "
                                  f"{limits.max_prompt_tokens}")
        if msg.max_tokens > limits.max_tokens:
            raise RequestRejected(f"max_tokens {msg.max_tokens} exceeds the limit "
                                  f"{limits.max_tokens}")
        lo, hi = PRIORITY_RANGE
        if not lo <= msg.priority <= hi:
            raise RequestRejected(f"priority must be in [{lo}, {hi}], got {msg.priority}")
        s = msg.sampling
        model = {k: v for k, v in self.defaults.items() if k in msg.sampling_from_model}
        neutral = {k: getattr(SamplingParams(), k) for k in msg.sampling_from_model}
        s = dataclasses.replace(s, **{**neutral, **model})
        seed = s.seed if s.seed is not None else secrets.randbelow(MAX_SEED + 1)
        penalty = s.unsupported()
        if penalty is not None:  # the HTTP API refuses them alike
            raise RequestRejected(penalty_error(penalty))
        sampling = dataclasses.replace(s, seed=seed)
        return GenerationRequest(
            request_id=_internal_id(peer, msg.request_id), prompt_ids=ids,
            sampling=sampling, max_tokens=msg.max_tokens,
            stop=tuple(msg.stop), priority=msg.priority, speculation=msg.speculation,
            user=msg.user, history_len=history)

    async def _stream(self, peer: bytes, msg: SubmitRequest, handle) -> None:
        index, ids, text = 0, [], []
        async for event in handle:
            usage = None
            if event.usage is not None and msg.include_usage:
                usage = Usage(prompt_tokens=event.usage.prompt_tokens,
                              completion_tokens=event.usage.completion_tokens,
                              cached_tokens=event.usage.cached_tokens)
            if event.finish_reason is not None:
                log.info("request_finished", request_id=handle.request_id,
                         finish_reason=event.finish_reason, error=event.error)
            if event.finish_reason == "error":
                error = event.error or "error"
                code = (ErrorCode.INTERNAL if error.startswith("internal error")
                        else ErrorCode.WORKER_DIED)
                await self._error(peer, code, error, msg.request_id)
                return
            if not msg.stream:
                ids += event.token_ids
                text.append(event.text)
                if event.finish_reason is None:
                    continue
                event.token_ids, event.text = ids, "".join(text)
            sent = await self.sock.send_to(peer, TokenEvent(
                request_id=msg.request_id, index=index, token_ids=list(event.token_ids),
                text=event.text, finish_reason=event.finish_reason, usage=usage))
            index += 1
            if not sent:  # the client went away: free its slot
                handle.cancel()
                with contextlib.suppress(Exception):
                    async for _ in handle:
                        pass
                return

    def _status(self, query_id: str) -> StatusReply:
        snap = self.scheduler.snapshot()
        slots = [SlotStatus(slot=s["slot"], request_id=s["request_id"], phase=PHASES[s["state"]],
                            prompt_done=s["prompt_done"], prompt_len=s["prompt_total"],
                            num_generated=s["generated"]) for s in snap["slots"]]
        return StatusReply(query_id=query_id, model=self.scheduler.model_name,
                           protocol_version=PROTOCOL_VERSION,
                           max_slots=len(slots), queue_depth=snap["queue_depth"], slots=slots)

    async def _error(self, peer: bytes, code: ErrorCode, message: str, rid: str | None) -> None:
        await self.sock.send_to(peer, ErrorReply(code=code, message=message, request_id=rid))


def _message(m: ChatMessage) -> dict[str, str]:
    if m.role not in ROLES:
        raise RequestRejected(f"message role must be one of {', '.join(ROLES)}, got "
                              f"{m.role!r}")
    return {"role": "system" if m.role == "developer" else m.role, "content": m.content}


def _internal_id(peer: bytes, request_id: str) -> str:
    """Client request ids are unique per connection; the scheduler's must be global."""
    return f"zmq-{peer.hex()}-{request_id}"


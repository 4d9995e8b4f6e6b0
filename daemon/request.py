"""What the front ends (HTTP, ZeroMQ) hand to the scheduler and what they get back."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib

from protocol.messages import SamplingParams

FINISH_REASONS = ("stop", "length", "cancelled", "error")


class RequestRejected(Exception):
    """Bad input the scheduler found (e.g. prompt + max_tokens over the context limit).
    Front ends answer it with HTTP 400 / ErrorReply BAD_REQUEST."""


class QueueFull(Exception):
    """The admission queue is full; retry after ``retry_after`` seconds (HTTP 503)."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineUnavailable(Exception):
    """The worker tree is not up (starting, restarting or shut down): HTTP 503."""


@dataclasses.dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop: tuple[str, ...] = ()  # stop strings: output ends before the first match
    priority: int = 0  # higher preempts lower
    eos: bool = True  # stop at the model's EOS ids
    progress: bool = False  # push prompt-progress events (RequestEvent.progress) while waiting
    speculation: bool = True  # False: never draft for it (nor index its text globally)
    user: str | None = None  # OpenAI's `user`: a synthetic model's routing key (user_route_key)
    # a chat's prompt tokens that its next turn repeats (Tokenizer.chat_history_len): the
    # scheduler ends a prefill chunk and keeps a prefix checkpoint there
    history_len: int | None = None


def user_route_key(user: str) -> int:
    """A synthetic model's routing key for ``user`` (SlotWork.route_key): 63 bits of its
    BLAKE2b, the same in every process and run (Python's hash() is salted per process)."""
    digest = hashlib.blake2b(user.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclasses.dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclasses.dataclass(slots=True)
class RequestEvent:
    """A chunk of output: new token ids and the text they complete (stop strings removed).
    The last event of a request has ``finish_reason`` set and carries ``usage``."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: str | None = None
    usage: Usage | None = None
    progress: dict | None = None  # a prompt-progress event (no tokens): daemon.progress.row


class RequestHandle:
    """Async iterator over one request's events; ``cancel()`` frees its slot at the next
    step boundary."""

    def __init__(self, request_id: str, canceller) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestEvent] = asyncio.Queue()
        self._cancel = canceller
        self.done = False

    def push(self, event: RequestEvent) -> None:
        self._queue.put_nowait(event)

    def cancel(self) -> None:
        if not self.done:
            self._cancel(self.request_id)

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> RequestEvent:
        if self.done:
            raise StopAsyncIteration
        event = await self._queue.get()
        if event.finish_reason is not None:
            self.done = True
        return event

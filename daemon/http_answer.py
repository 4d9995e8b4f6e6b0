"""Turning a RequestHandle's events into an HTTP answer: one JSON object, or an SSE stream
(`data: {chunk}\\n\\n` ... `data: [DONE]\\n\\n`) in OpenAI's shapes.

While waiting for events it watches the connection: a client that went away, or a request
past its deadline, ends the wait; the caller then cancels the request (its slot is freed at
the next step boundary).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import structlog
from aiohttp import web

from daemon.openai_format import Formatter
from daemon.openai_reasoning import ReasoningStream, split_reasoning
from daemon.openai_schema import ApiError
from daemon.openai_tools import ToolCallStream, parse_tool_calls
from daemon.request import RequestEvent, RequestHandle

log = structlog.stdlib.get_logger(__name__)

DISCONNECT_POLL_S = 0.25
DONE = ("stop", "length")  # finish reasons of a request that completed normally
PROGRESS_EVENT = b"event: progress\n"  # named: EventSource "message" listeners skip it


class ClientGone(Exception):
    """The HTTP client closed its connection."""


class RequestTimeout(Exception):
    """The request ran past limits.request_timeout_s."""


async def events(request: web.Request, handle: RequestHandle,
                 timeout_s: float) -> AsyncIterator[RequestEvent]:
    """The handle's events until the last; raises ClientGone or RequestTimeout (0: none)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s if timeout_s else math.inf
    pending: asyncio.Future[RequestEvent] | None = None
    try:
        while not handle.done:
            pending = pending or asyncio.ensure_future(handle.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=DISCONNECT_POLL_S)
            if done:
                event, pending = pending.result(), None
                yield event
            # NOTE: checked after every event too: a busy request must notice its client left
            if not handle.done and (request.transport is None
                                    or request.transport.is_closing()):
                raise ClientGone
            if loop.time() > deadline and not handle.done:
                raise RequestTimeout(f"the request timed out after {timeout_s:g} s")
    finally:
        if pending is not None:
            pending.cancel()  # NOTE: a cancelled Queue.get loses no event


def failed(event: RequestEvent | None) -> ApiError:
    """The error of a request that ended with "error" or "cancelled" (not by its client)."""
    if event is None:
        return ApiError(500, "the request ended without a result", type="server_error",
                        code="internal_error", reason=None)
    message = event.error or ("the request was cancelled by the server (shutting down)"
                              if event.finish_reason == "cancelled" else
                              f"the request ended with {event.finish_reason}")
    return ApiError(503, message, type="server_error", code=f"request_{event.finish_reason}",
                    reason=None)


def progress_chunk(fmt: Formatter, progress: dict[str, Any]) -> dict[str, Any]:
    """A prompt-progress event's data (named SSE event ``progress``; docs/http_api.md)."""
    return {"id": fmt.request_id, "object": "tandem.prompt_progress", "created": fmt.created,
            "model": fmt.model, "progress": progress}


def _timeout(exc: RequestTimeout) -> ApiError:
    return ApiError(504, str(exc), type="server_error", code="timeout", reason=None)


def _finished(start: float, finish_reason: str | None, usage: dict[str, Any]) -> None:
    log.info("request_finished", finish_reason=finish_reason,
             prompt_tokens=usage["prompt_tokens"], completion_tokens=usage["completion_tokens"],
             seconds=round(time.monotonic() - start, 4))


async def collect(request: web.Request, handle: RequestHandle, fmt: Formatter, n_prompt: int,
                  timeout_s: float, tools: frozenset[str] | None = None,
                  reasoning: bool = False) -> web.Response:
    """The whole answer as one JSON object (ApiError when the request failed). With `tools`
    (the names of the functions offered), tool-call blocks of a completed answer that call
    one of them become `tool_calls`; with `reasoning` (chat), a leading <think> block becomes
    `reasoning_content`."""
    start, texts, count, last = time.monotonic(), [], 0, None
    try:
        async with contextlib.aclosing(events(request, handle, timeout_s)) as stream:
            async for last in stream:
                if last.progress is not None:  # never the last event; none are asked for here
                    continue
                texts.append(last.text)
                count += len(last.token_ids)
    except ClientGone:
        log.info("client_disconnected")
        return web.Response(status=499)  # nobody reads it
    except RequestTimeout as exc:
        raise _timeout(exc) from None
    if last is None or last.finish_reason not in DONE:
        raise failed(last)
    usage = fmt.usage(last.usage, n_prompt, count)
    _finished(start, last.finish_reason, usage)
    text, calls, finish, thought = "".join(texts), [], last.finish_reason, None
    if reasoning and fmt.kind == "chat":
        thought, text = split_reasoning(text)
    if tools and finish == "stop":
        text, calls = parse_tool_calls(text, tools)
        finish = "tool_calls" if calls else finish
    return web.json_response(fmt.response(text, finish, usage, calls, thought))


async def stream(request: web.Request, handle: RequestHandle, fmt: Formatter, n_prompt: int,
                 timeout_s: float, include_usage: bool, tools: frozenset[str] | None = None,
                 reasoning: bool = False) -> web.StreamResponse:
    """Server-sent events. Errors after the headers went out become an error event. With
    `tools`, text from a `<tool_call>` tag on is held back and sent as `tool_calls`; with
    `reasoning` (chat), a leading <think> block is sent as `reasoning_content` deltas."""
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no", "X-Request-Id": fmt.request_id})
    await response.prepare(request)

    async def send(obj: dict[str, Any], event: bytes = b"") -> None:
        await response.write(event + b"data: " + json.dumps(obj, ensure_ascii=False).encode()
                             + b"\n\n")

    start, count = time.monotonic(), 0
    calls = ToolCallStream(tools) if tools else None
    thought = ReasoningStream() if reasoning and fmt.kind == "chat" else None

    async def send_text(pieces: list[tuple[str, str]]) -> None:
        for kind, piece in pieces:
            if kind == "reasoning":
                await send(fmt.chunk(reasoning=piece, include_usage=include_usage))
                continue
            piece = calls.feed(piece) if calls else piece
            if piece:
                await send(fmt.chunk(text=piece, include_usage=include_usage))

    try:
        if fmt.kind == "chat":
            await send(fmt.chunk(role=True, include_usage=include_usage))
        async with contextlib.aclosing(events(request, handle, timeout_s)) as stream_:
            async for event in stream_:
                if event.progress is not None:  # asked for with stream_options.include_progress
                    await send(progress_chunk(fmt, event.progress), PROGRESS_EVENT)
                    continue
                count += len(event.token_ids)
                await send_text(thought.feed(event.text) if thought
                                else [("content", event.text)])
                if event.finish_reason in DONE:
                    finish = event.finish_reason
                    if thought is not None:
                        await send_text(thought.finish())
                    if calls is not None:
                        rest, found = calls.finish(parse=finish == "stop")
                        if rest:
                            await send(fmt.chunk(text=rest, include_usage=include_usage))
                        if found:
                            await send(fmt.chunk(tool_calls=found, include_usage=include_usage))
                            finish = "tool_calls"
                    await send(fmt.chunk(finish_reason=finish, include_usage=include_usage))
                    usage = fmt.usage(event.usage, n_prompt, count)
                    if include_usage:
                        await send(fmt.usage_chunk(usage))
                    _finished(start, event.finish_reason, usage)
                elif event.finish_reason is not None:
                    await send(failed(event).body())
    except (ClientGone, ConnectionError):
        log.info("client_disconnected", completion_tokens=count)
        return response
    except RequestTimeout as exc:
        error = _timeout(exc)
    except Exception:
        log.exception("internal_error_in_stream")
        error = ApiError(500, f"internal server error (request id {fmt.request_id})",
                         type="server_error", code="internal_error")
    else:
        error = None
    with contextlib.suppress(ConnectionError):  # the client may be gone by now
        if error is not None:
            await send(error.body())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    return response

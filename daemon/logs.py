"""structlog setup: one JSON object per line on stderr (the journal under systemd).

Request ids are bound with `bind_request(request_id)` (contextvars, so every log line of that
request's task carries it). Prompt and output text is never logged unless
`configure_logging(..., log_prompts=True)`: values under the keys in `TEXT_KEYS` are replaced
by their length, whoever logs them. Standard-library loggers (aiohttp, asyncio) go through the
same renderer.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import structlog
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

TEXT_KEYS = frozenset({"prompt", "prompt_text", "messages", "text", "completion", "output",
                       "stop", "tools"})
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR}


class _Redactor:
    def __init__(self, log_prompts: bool) -> None:
        self.log_prompts = log_prompts

    def __call__(self, logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
        if not self.log_prompts:
            for key in TEXT_KEYS.intersection(event):
                value = event[key]
                event[key] = (f"<redacted: {len(value)} chars>" if isinstance(value, str)
                              else "<redacted>")
        return event


def configure_logging(level: str = "info", json: bool = True, *, log_prompts: bool = False,
                      stream: TextIO | None = None) -> None:
    """Route structlog and the standard `logging` module to `stream` (default stderr)."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {', '.join(LEVELS)}, got {level!r}")
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _Redactor(log_prompts),
    ]
    renderer: Any = (structlog.processors.JSONRenderer(ensure_ascii=False) if json
                     else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[structlog.stdlib.filter_by_level, *shared,
                    structlog.processors.StackInfoRenderer(),
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer]))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(LEVELS[level])


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.stdlib.get_logger(name)


@contextlib.contextmanager
def bind_request(request_id: str, **fields: Any) -> Iterator[None]:
    """Tag every log line written inside the block (in this task) with `request_id`."""
    tokens = structlog.contextvars.bind_contextvars(request_id=request_id, **fields)
    try:
        yield
    finally:
        structlog.contextvars.reset_contextvars(**tokens)


class AccessLog(AbstractAccessLogger):
    """aiohttp's access log as one structured line per HTTP request, with the request id
    the answer carries in X-Request-Id."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse,
            time: float) -> None:
        get_logger("tandem.access").info(
            "http_access", request_id=response.headers.get("X-Request-Id"),
            peer=request.remote, method=request.method, path=request.path,
            status=response.status, bytes=response.body_length, seconds=round(time, 4),
            user_agent=request.headers.get("User-Agent"))

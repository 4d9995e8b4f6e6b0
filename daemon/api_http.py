"""The OpenAI-compatible HTTP API (aiohttp): completions, chat completions, models, health,
readiness, metrics and slots.

A generation request is validated (openai_schema), its chat template applied and tokenized
here, checked against the limits, and submitted to the scheduler as a GenerationRequest; its
RequestHandle's events become one JSON answer or an SSE stream. Every error is answered in
OpenAI's shape. A client that disconnects (or a request past `limits.request_timeout_s`) has its
request cancelled, which frees the slot at the next step boundary.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import secrets
import time
import uuid
from collections.abc import Callable
from typing import Any

import structlog
from aiohttp import web

from daemon import http_answer
from daemon.config import Config
from daemon.logs import AccessLog, bind_request
from daemon.metrics import Metrics
from daemon.openai_format import Formatter
from daemon.openai_schema import ApiError, ParsedRequest, bad, parse_chat, parse_completion
from daemon.request import (
    EngineUnavailable,
    GenerationRequest,
    QueueFull,
    RequestHandle,
    RequestRejected,
)
from daemon.tokenizer import TokenizerError
from protocol.messages import MAX_SEED, ModelInfo, SamplingParams, vocab_error

log = structlog.stdlib.get_logger(__name__)

OPEN_PATHS = ("/health", "/ready")  # answered without an API key
CANCEL_WAIT_S = 2.0  # at shutdown: time for cancelled requests' handlers to answer
API: web.AppKey[HttpApi] = web.AppKey("tandem_api")
REQUEST_ID = web.RequestKey("request_id", str)


def make_app(scheduler: Any, tokenizer: Any, config: Config, metrics: Metrics, *,
             generation_defaults: dict[str, Any] | None = None,
             worker_health: Callable[[], dict | None] | None = None) -> web.Application:
    """The aiohttp application. `scheduler` may be None while the engine starts: generation
    requests are then validated and answered 503. `generation_defaults` (temperature, top_p,
    top_k, min_p used when a request leaves them out) default to what the worker reports at
    READY (`HttpApi.worker_ready`: the model's generation_config.json). `worker_health`, when
    given, adds the worker's liveness (pid, heartbeats, seconds since last heard) to /health."""
    api = HttpApi(scheduler, tokenizer, config, metrics, generation_defaults, worker_health)
    app = web.Application(client_max_size=config.server.max_body_bytes,
                          middlewares=[api.middleware])
    app[API] = api
    app.on_shutdown.append(api.on_shutdown)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/v1/models/{model:.+}", api.model)
    app.router.add_get("/v1/slots", api.slots)
    app.router.add_get("/health", api.health)
    app.router.add_get("/ready", api.ready)
    app.router.add_get("/metrics", api.metrics_text)
    return app


async def start_site(app: web.Application, config: Config) -> web.AppRunner:
    """Listen on config.server.host:port. `await runner.cleanup()` stops listening, drains
    running requests (HttpApi.on_shutdown) and closes the connections. A connection that
    sends no complete request head within limits.body_timeout_s is closed (a half-sent
    body is answered 408 by the handlers)."""
    runner = web.AppRunner(app, access_log_class=AccessLog, shutdown_timeout=CANCEL_WAIT_S,
                           keepalive_timeout=config.limits.body_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, config.server.host, config.server.port, reuse_address=True)
    await site.start()
    return runner


class HttpApi:
    def __init__(self, scheduler: Any, tokenizer: Any, config: Config, metrics: Metrics,
                 generation_defaults: dict[str, Any] | None,
                 worker_health: Callable[[], dict | None] | None = None) -> None:
        self.scheduler, self.tokenizer, self.config, self.metrics = (
            scheduler, tokenizer, config, metrics)
        self.model_name = getattr(scheduler, "model_name", None) or config.model.served_name
        self.model_names = {self.model_name, config.model.served_name, *config.model.aliases}
        self.created = int(time.time())
        self.fixed_defaults = generation_defaults is not None
        self.defaults = generation_defaults or {}
        self.vocab_size: int | None = getattr(tokenizer, "vocab_size", None)
        self.worker_health = worker_health
        self._keys = [k.encode() for k in config.server.api_keys]
        self.active: dict[str, RequestHandle] = {}  # generation requests being answered
        self.draining = False

    def worker_ready(self, info: ModelInfo) -> None:
        """The worker's READY: its vocabulary bounds prompt ids; its sampling defaults apply
        unless make_app was given some."""
        self.vocab_size = info.vocab_size
        if not self.fixed_defaults:
            self.defaults = info.generation_defaults.as_dict()

    async def on_shutdown(self, app: web.Application) -> None:
        """Graceful stop (the listening sockets are closed already): let running requests
        finish for up to server.shutdown_grace_s, then cancel the rest, whose clients get an
        error event (streams) or a 503, and give their handlers a moment to send it."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.server.shutdown_grace_s
        while self.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.active:
            log.info("shutdown_cancelling_requests", count=len(self.active))
        for handle in list(self.active.values()):
            handle.cancel()
        deadline = loop.time() + CANCEL_WAIT_S
        while self.active and loop.time() < deadline:
            await asyncio.sleep(0.05)

    # ---- middleware: request id, auth, errors ------------------------------------------------
    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        prefix = {"/v1/completions": "cmpl", "/v1/chat/completions": "chatcmpl"}.get(
            request.path, "req")
        request_id = request[REQUEST_ID] = f"{prefix}-{uuid.uuid4().hex}"
        with bind_request(request_id):
            try:
                if self._keys and request.path not in OPEN_PATHS:
                    self._authorize(request)
                response = await handler(request)
            except ApiError as exc:
                response = self._error(exc)
            except web.HTTPException as exc:  # unknown route, wrong method, body too large
                response = self._error(_from_http(exc, self.config.server.max_body_bytes))
            except Exception:
                log.exception("internal_error", path=request.path)
                response = self._error(ApiError(
                    500, f"internal server error (request id {request_id})",
                    type="server_error", code="internal_error", reason=None))
            if not response.prepared:
                response.headers["X-Request-Id"] = request_id
            return response

    def _authorize(self, request: web.Request) -> None:
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        given = key.strip().encode()
        ok = False
        for expected in self._keys:  # NOTE: compare with every key: time does not leak which
            ok |= hmac.compare_digest(given, expected)
        if scheme.lower() != "bearer" or not ok:
            raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", reason="unauthorized",
                           headers={"WWW-Authenticate": 'Bearer realm="tandem"'})

    def _error(self, exc: ApiError) -> web.Response:
        if exc.reason is not None:
            self.metrics.request_rejected(exc.reason)
        log.info("request_rejected" if exc.reason else "request_failed", status=exc.status,
                 code=exc.code, param=exc.param, error=exc.message)
        return web.json_response(exc.body(), status=exc.status, headers=exc.headers)

    # ---- simple endpoints --------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if self.worker_health is None:
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "ok", "worker": self.worker_health()})

    async def ready(self, request: web.Request) -> web.Response:
        snap = self._snapshot()
        if snap is None or not snap.get("ready"):
            return web.json_response({"status": "starting"}, status=503)
        return web.json_response({"status": "ready", "model": self.model_name})

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": self.metrics.content_type})

    async def models(self, request: web.Request) -> web.Response:
        names = [self.model_name, *sorted(self.model_names - {self.model_name})]
        return web.json_response({"object": "list",
                                  "data": [self._model_card(name) for name in names]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in self.model_names:
            raise _model_not_found(name, self.model_name)
        return web.json_response(self._model_card(name))

    def _model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "tandem",
                "root": self.model_name, "max_model_len": self._max_context()}

    async def slots(self, request: web.Request) -> web.Response:
        snap = self._snapshot()
        if snap is None:
            raise ApiError(503, "the engine is not running", type="server_error",
                           code="engine_unavailable", reason="unavailable")
        return web.json_response(snap)

    def _snapshot(self) -> dict[str, Any] | None:
        if self.scheduler is None:
            return None
        return self.scheduler.snapshot()

    def _max_context(self) -> int:
        return getattr(self.scheduler, "max_context", None) or self.config.scheduler.max_context

    # ---- generation --------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.metrics.request_received("completions")
        return await self._generate(request, parse_completion(await self._json(request)))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        self.metrics.request_received("chat_completions")
        return await self._generate(request, parse_chat(await self._json(request)))

    async def _json(self, request: web.Request) -> Any:
        kind = request.headers.get("Content-Type", "").partition(";")[0].strip().lower()
        if kind and kind != "application/json" and not kind.endswith("+json"):
            # NOTE: also what keeps a web page from posting here with a "simple" request
            raise ApiError(415, f"the request body must be JSON: send 'Content-Type: "
                           f"application/json', not {kind!r}", code="unsupported_media_type",
                           reason="bad_content_type")
        timeout = self.config.limits.body_timeout_s
        try:  # raises HTTPRequestEntityTooLarge past client_max_size
            raw = await asyncio.wait_for(request.read(), timeout)
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {timeout:g} s",
                           code="request_timeout", reason="body_timeout",
                           headers={"Connection": "close"}) from None
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise bad(None, f"the request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise bad(None, "the request body is nested too deeply") from None
        if b"\\u" in raw:  # an escaped lone surrogate decodes to a str no one can encode
            try:
                json.dumps(body, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError as exc:
                raise bad(None, f"the request body holds an unpaired UTF-16 surrogate "
                          f"({exc.object[exc.start]!a}): strings must be valid Unicode") \
                    from None
        return body

    async def _generate(self, request: web.Request, req: ParsedRequest) -> web.StreamResponse:
        if req.model is not None and req.model not in self.model_names:
            raise _model_not_found(req.model, self.model_name)
        # tokenizing a long prompt takes milliseconds: keep the event loop streaming meanwhile
        prompt_ids, history = await asyncio.get_running_loop().run_in_executor(
            None, self._prompt_ids, req)
        gen = GenerationRequest(request_id=request[REQUEST_ID], prompt_ids=prompt_ids,
                                sampling=self._sampling(req),
                                max_tokens=self._max_tokens(len(prompt_ids), req.max_tokens,
                                                           _prompt_param(req)),
                                stop=req.stop, priority=req.priority, eos=not req.ignore_eos,
                                progress=req.stream and req.include_progress,
                                speculation=req.speculation, user=req.user,
                                history_len=history)
        handle = self._submit(gen)
        self.active[gen.request_id] = handle
        fmt = Formatter(req.kind, request[REQUEST_ID], self.model_name, int(time.time()))
        log.info("request_submitted", kind=req.kind, prompt_tokens=len(prompt_ids),
                 max_tokens=gen.max_tokens, stream=req.stream, priority=req.priority)
        timeout = self.config.limits.request_timeout_s
        split = self.config.server.split_reasoning
        try:
            if req.stream:
                return await http_answer.stream(request, handle, fmt, len(prompt_ids), timeout,
                                                req.include_usage, tools=_tool_names(req.tools),
                                                reasoning=split)
            return await http_answer.collect(request, handle, fmt, len(prompt_ids), timeout,
                                             tools=_tool_names(req.tools), reasoning=split)
        except asyncio.CancelledError:
            log.info("client_disconnected")
            raise
        finally:
            self.active.pop(gen.request_id, None)
            if not handle.done:
                handle.cancel()

    def _prompt_ids(self, req: ParsedRequest) -> tuple[list[int], int | None]:
        """The prompt's ids and, for a chat, the tokens its next turn repeats."""
        if isinstance(req.prompt, list):
            error = vocab_error(req.prompt, self.vocab_size)
            if error is not None:
                raise bad("prompt", error)
            return list(req.prompt), None
        if self.tokenizer is None:
            raise bad(_prompt_param(req), "this model has no tokenizer: send 'prompt' as a "
                      "list of token ids")
        try:
            ids = (self.tokenizer.encode(req.prompt) if req.kind == "completion" else
                   self.tokenizer.encode_chat(req.messages, tools=req.tools,
                                              enable_thinking=req.enable_thinking))
        except TokenizerError as exc:
            raise bad(_prompt_param(req), str(exc)) from None
        if not ids:
            raise bad(_prompt_param(req), "the prompt encodes to zero tokens")
        if req.kind == "completion":
            return ids, None
        return ids, self.tokenizer.chat_history_len(ids, req.messages, tools=req.tools,
                                                    enable_thinking=req.enable_thinking)

    def _max_tokens(self, n_prompt: int, asked: int | None, param: str) -> int:
        limit, ctx = self.config.max_prompt_tokens, self._max_context()
        if n_prompt > limit:
            raise ApiError(400, f"the prompt has {n_prompt} tokens, more than the limit of "
                           f"{limit}", param=param, code="context_length_exceeded",
                           reason="prompt_too_long")
        cap = self.config.max_tokens
        if asked is not None and asked > cap:
            raise bad("max_tokens", f"'max_tokens' must be <= {cap}, got {asked}")
        if asked is not None and n_prompt + asked > ctx:
            raise ApiError(400, f"the prompt ({n_prompt} tokens) plus max_tokens ({asked}) is "
                           f"{n_prompt + asked} tokens, more than the context limit of {ctx}",
                           param="max_tokens", code="context_length_exceeded",
                           reason="prompt_too_long")
        room = ctx - n_prompt
        if room < 1:
            raise ApiError(400, f"the prompt has {n_prompt} tokens and leaves no room in the "
                           f"context limit of {ctx}", param=param,
                           code="context_length_exceeded", reason="prompt_too_long")
        return asked if asked is not None else min(cap, room)

    def _sampling(self, req: ParsedRequest) -> SamplingParams:
        d = self.defaults

        def pick(value: Any, key: str, fallback: Any) -> Any:
            return value if value is not None else d.get(key, fallback)

        seed = req.seed if req.seed is not None else secrets.randbelow(MAX_SEED + 1)
        try:
            return SamplingParams(temperature=pick(req.temperature, "temperature", 1.0),
                                  top_p=pick(req.top_p, "top_p", 1.0),
                                  top_k=pick(req.top_k, "top_k", 0),
                                  min_p=pick(req.min_p, "min_p", 0.0), seed=seed)
        except ValueError as exc:
            raise bad(None, str(exc)) from None

    def _submit(self, gen: GenerationRequest) -> RequestHandle:
        if self.scheduler is None:
            raise _unavailable("the engine is starting")
        if self.draining:
            raise _unavailable("the server is shutting down")
        try:
            return self.scheduler.submit(gen)
        except QueueFull as exc:
            retry = str(max(1, math.ceil(exc.retry_after)))
            raise ApiError(503, f"the server is busy: {exc}", type="server_error",
                           code="queue_full", reason="queue_full",
                           headers={"Retry-After": retry}) from None
        except RequestRejected as exc:
            raise ApiError(400, str(exc), reason="rejected") from None
        except EngineUnavailable as exc:
            raise _unavailable(str(exc)) from None


def _tool_names(tools: list[dict[str, Any]] | None) -> frozenset[str] | None:
    """The functions a request offers (None: no tools, no tool-call parsing)."""
    return frozenset(t["function"]["name"] for t in tools) if tools else None


def _prompt_param(req: ParsedRequest) -> str:
    return "prompt" if req.kind == "completion" else "messages"


def _model_not_found(name: str, served: str) -> ApiError:
    return ApiError(404, f"the model '{name}' does not exist; this server serves '{served}'",
                    param="model", code="model_not_found", reason="model_not_found")


def _unavailable(message: str) -> ApiError:
    return ApiError(503, f"the engine is unavailable: {message}", type="server_error",
                    code="engine_unavailable", reason="unavailable",
                    headers={"Retry-After": "5"})


def _from_http(exc: web.HTTPException, max_body: int) -> ApiError:
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return ApiError(413, f"the request body is larger than the limit of {max_body} bytes "
                        f"(server.max_body_bytes)", code="body_too_large",
                        reason="body_too_large")
    if isinstance(exc, web.HTTPNotFound):
        return ApiError(404, "no such endpoint", code="not_found", reason="not_found")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return ApiError(405, f"method {exc.method} is not allowed here", reason="bad_method",
                        headers={"Allow": ", ".join(sorted(exc.allowed_methods))})
    return ApiError(exc.status, exc.reason, reason="http_error")

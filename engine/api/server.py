"""The OpenAI-compatible HTTP API on rank 0 (aiohttp): models, completions, chat, health, metrics.

Statuses say who failed: 400 a bad request, 500 this request alone (a fault while
sampling, detokenizing or shaping its reply; resending it would fail again), and 503 with
`Retry-After` only when the engine is busy, draining or has failed (its ring included).
A stream that has already sent tokens ends with an SSE error event and no
`finish_reason`, so the client can tell it is incomplete. A client that goes away cancels
its stream, which frees its slot in the next round. Bodies are read under a deadline and a
bound that holds for compressed ones too (`engine.api.bodies`, the runner's own
decompression off), and parsed, checked and tokenized on a worker thread, so a 1 MB prompt does not hold the loop.

The app owns the lane host's round loop: it starts with the app and, when the app shuts
down, every stream left ends (503s and SSE error events) before the server waits for
their handlers to write them, and only then does the loop stop.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiohttp import web

from engine.api.auth import api_secret_middlewares
from engine.api.bodies import read_body
from engine.api.connections import ConnectionGuard, HttpLimits
from engine.api.errors import (
    RETRY_AFTER_S,
    ApiError,
    bad,
    request_failed,
    sse_event,
    unavailable,
)
from engine.api.json_values import load_body
from engine.api.metrics import EngineMetrics
from engine.api.schema import ParsedRequest, ServedModel, parse_chat, parse_completion
from engine.lanes.host import (
    Busy,
    Done,
    EngineFailed,
    Failed,
    LaneHost,
    NeverFits,
    Stream,
    Token,
)
from engine.lanes.text import TextCodec

log = structlog.get_logger()

__all__ = ["RETRY_AFTER_S", "ApiConfig", "make_app", "unavailable"]

PARSE_THREADS = 2  # bodies parsed and tokenized at once, off the event loop


@dataclass(frozen=True)
class ApiConfig:
    served: ServedModel
    system_fingerprint: str  # the placement id
    created: int = 0
    api_secret: str = field(default="", repr=False)  # "" (standalone): the API stays open
    limits: HttpLimits = field(default_factory=HttpLimits)
    hops: tuple[str, ...] = ()  # each hop's transport (tcp, nccl, gloo); () standalone


HOST = web.AppKey("host", LaneHost)
CONFIG = web.AppKey("config", ApiConfig)
METRICS = web.AppKey("metrics", EngineMetrics)
CONNECTIONS = web.AppKey("connections", ConnectionGuard)
PARSERS = web.AppKey("parsers", ThreadPoolExecutor)
ROUND_LOOP = web.AppKey("round_loop", asyncio.Task)  # ends only when the engine fails


class DrainClock:
    """When this engine's drain ends at the latest (None: not draining), for /health."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.deadline: float | None = None

    def start(self, deadline_s: float) -> None:
        if self.deadline is None:  # a second SIGTERM changes nothing, nor its deadline
            self.deadline = self.clock() + deadline_s

    def seconds_left(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - self.clock())


DRAIN_CLOCK = web.AppKey("drain_clock", DrainClock)
SHUTTING_DOWN = "the engine is shutting down"


def make_app(host: LaneHost, config: ApiConfig, metrics: EngineMetrics) -> web.Application:
    guard = ConnectionGuard(config.limits)
    app = web.Application(middlewares=[guard.middleware,
                                       *api_secret_middlewares(config.api_secret),
                                       _errors_as_json],
                          client_max_size=config.limits.max_body_bytes)
    app[HOST], app[CONFIG], app[METRICS], app[CONNECTIONS] = host, config, metrics, guard
    app[DRAIN_CLOCK] = DrainClock()
    app.cleanup_ctx.append(_parser_threads)
    app.cleanup_ctx.append(_round_loop)
    app.on_shutdown.append(_end_streams)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", prometheus)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app


async def _parser_threads(app: web.Application) -> AsyncIterator[None]:
    app[PARSERS] = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="parse")
    yield
    app[PARSERS].shutdown(wait=False, cancel_futures=True)


async def _round_loop(app: web.Application) -> AsyncIterator[None]:
    host = app[HOST]
    app[ROUND_LOOP] = asyncio.create_task(host.run(), name="rounds")
    yield
    _end_streams_now(host)
    app[ROUND_LOOP].cancel()
    await asyncio.gather(app[ROUND_LOOP], return_exceptions=True)
    host.close()


async def _end_streams(app: web.Application) -> None:
    """Before the server waits for the handlers: give each a last event to answer with."""
    _end_streams_now(app[HOST])


def _end_streams_now(host: LaneHost) -> None:
    if not host.failure:  # a failure already ended every stream, with its own reason
        host.fail(SHUTTING_DOWN)


def route_label(request: web.Request) -> str:
    """The route's template, never the raw path: unknown paths must not grow /metrics."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def _errors_as_json(request: web.Request, handler: Callable) -> web.StreamResponse:
    try:
        response = await handler(request)
    except ApiError as error:
        response = error.response()
    except web.HTTPException as exc:  # 404 / 405 / 413 from aiohttp, as OpenAI-style bodies
        response = ApiError(exc.status, exc.reason, kind="invalid_request_error").response()
    except (asyncio.CancelledError, ConnectionError):
        raise  # the client went away: nothing to answer
    except Exception as exc:  # noqa: BLE001 - one request's bug is that request's 500
        log.error("request failed", route=route_label(request),
                  error=f"{type(exc).__name__}: {exc}")
        response = request_failed(f"this request failed: {type(exc).__name__}").response()
    request.app[METRICS].requests.labels(route_label(request), str(response.status)).inc()
    return response


async def health(request: web.Request) -> web.Response:
    """200 `ok`; 503 `failed` with its reason; 503 `draining` with the requests still in
    flight and the seconds left until the drain's deadline. A draining engine answers 503
    (with Retry-After) because it takes no new request, so anything that routes by health
    sends it none; its status says `draining`, not `failed`, so nothing counts it failed.
    `rounds_owed_s` is the round loop's progress: how long rounds have been owed with none
    landing (0 idle; it stays under a round's time while rounds land). Rank 0 fails itself
    once it reaches the round deadline (engine.api.serve), so a stuck round loop turns this
    503 `failed` then, instead of answering 200 while requests hang."""
    host, fingerprint = request.app[HOST], request.app[CONFIG].system_fingerprint
    if host.failure:
        return web.json_response({"status": "failed", "reason": host.failure}, status=503)
    seconds_left = request.app[DRAIN_CLOCK].seconds_left()
    if host.draining or seconds_left is not None:
        return web.json_response(
            {"status": "draining", "in_flight": host.slots_in_use() + len(host.waiting),
             "drain_seconds_left": round(seconds_left or 0.0, 1),
             "rounds_owed_s": round(host.rounds_owed_s(), 1),
             "system_fingerprint": fingerprint},
            status=503, headers={"Retry-After": str(RETRY_AFTER_S)})
    body = {"status": "ok", "slots_in_use": host.slots_in_use(),
            "rounds_owed_s": round(host.rounds_owed_s(), 1),
            "system_fingerprint": fingerprint,
            "prompt_cache": request.app[METRICS].prompt_cache_figures()}
    if request.app[CONFIG].hops:
        body["hops"] = list(request.app[CONFIG].hops)
    return web.json_response(body)


async def prometheus(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(),
                        content_type="text/plain", charset="utf-8")


async def models(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    return web.json_response({"object": "list", "data": [{
        "id": config.served.model_id, "object": "model", "created": config.created,
        "owned_by": "ringfleet", "max_model_len": config.served.context}]})


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_completion, CompletionFormat)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_chat, ChatFormat)


async def _generate(request: web.Request, parse: Callable, fmt: type) -> web.StreamResponse:
    config, host = request.app[CONFIG], request.app[HOST]
    if host.failure:  # fail fast: no need to read and tokenize what cannot be served
        raise unavailable(f"the engine has failed: {host.failure}")
    raw = await read_body(request, config.limits.max_body_bytes, config.limits.body_s)

    def parse_and_tokenize() -> ParsedRequest:
        return parse(load_body(raw), config.served)

    loop = asyncio.get_running_loop()
    parsed = await loop.run_in_executor(request.app[PARSERS], parse_and_tokenize)
    try:
        stream = host.submit(parsed.generation)
    except Busy as exc:
        raise unavailable(str(exc)) from exc
    except NeverFits as exc:
        raise bad(str(exc), "max_tokens", "context_length_exceeded") from exc
    except EngineFailed as exc:
        raise unavailable(f"the engine has failed: {exc}") from exc
    request.app[METRICS].prompt_tokens.inc(len(parsed.generation.prompt_ids))
    out = fmt(config, host.codec, parsed)
    try:
        if parsed.stream:
            return await _stream(request, stream, out)
        return await _whole(stream, out)
    except (ApiError, asyncio.CancelledError, ConnectionError):
        raise
    except Exception as exc:  # shaping one reply failed: that reply's 500
        log.error("reply failed", error=f"{type(exc).__name__}: {exc}")
        raise request_failed(f"shaping this reply failed: {type(exc).__name__}") from exc
    finally:
        stream.cancel()  # a no-op for a finished stream; frees the slot of an abandoned one


async def _whole(stream: Stream, out: CompletionFormat) -> web.Response:
    tokens: list[Token] = []
    while True:
        event = await stream.events.get()
        if isinstance(event, Token):
            tokens.append(event)
        elif isinstance(event, Failed):
            raise _failure(event, "before the reply was complete")
        else:
            return web.json_response(out.whole(tokens, event))


async def _stream(request: web.Request, stream: Stream, out: CompletionFormat) -> web.StreamResponse:
    event = await stream.events.get()
    if isinstance(event, Failed):  # nothing sent yet: a plain error status
        raise _failure(event, "before the first token")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(payload: dict[str, Any] | str) -> None:
        await response.write(sse_event(payload))

    try:
        for chunk in out.opening():
            await send(chunk)
        while True:
            if isinstance(event, Token):
                if event.text or out.parsed.logprobs:
                    await send(out.chunk([event], None))
            elif isinstance(event, Done):
                await send(out.chunk([], event.finish_reason))
                if out.parsed.include_usage:
                    await send(dict(out.envelope(chunk=True), choices=[], usage=out.usage(event)))
                await send("[DONE]")
                break
            else:  # tokens were sent: an error event and no finish_reason marks it incomplete
                await send(_failure(event, "mid-stream").body())
                break
            event = await stream.events.get()
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as exc:  # noqa: BLE001 - shaping this stream failed: end it alone
        log.error("stream reply failed", error=f"{type(exc).__name__}: {exc}")
        stream.cancel()
        await send(request_failed(f"shaping this reply failed: {type(exc).__name__}").body())
    await response.write_eof()
    return response


def _failure(event: Failed, when: str) -> ApiError:
    """A request's own failure is a 500; the engine's (or its ring's) a retryable 503."""
    if event.per_request:
        return request_failed(f"this request failed {when}: {event.reason}")
    return unavailable(f"the engine failed {when}: {event.reason}")


class CompletionFormat:
    """Shapes events as /v1/completions objects."""

    prefix, whole_object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, config: ApiConfig, codec: TextCodec, parsed: ParsedRequest) -> None:
        self.config, self.codec, self.parsed = config, codec, parsed
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.text_offset = 0

    def envelope(self, *, chunk: bool) -> dict[str, Any]:
        return {"id": self.id, "object": self.chunk_object if chunk else self.whole_object,
                "created": self.created, "model": self.config.served.model_id,
                "system_fingerprint": self.config.system_fingerprint}

    def usage(self, done: Done) -> dict[str, Any]:
        return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
                # the drafter's tokens, in the fields OpenAI gives predicted outputs
                "completion_tokens_details": {
                    "accepted_prediction_tokens": done.accepted_tokens,
                    "rejected_prediction_tokens": done.drafted_tokens - done.accepted_tokens}}

    def opening(self) -> list[dict[str, Any]]:
        return []

    def whole(self, tokens: list[Token], done: Done) -> dict[str, Any]:
        choice = {"index": 0, "text": "".join(t.text for t in tokens),
                  "finish_reason": done.finish_reason, "logprobs": self.logprobs(tokens)}
        return dict(self.envelope(chunk=False), choices=[choice], usage=self.usage(done))

    def chunk(self, tokens: list[Token], finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "text": "".join(t.text for t in tokens),
                  "finish_reason": finish_reason, "logprobs": self.logprobs(tokens)}
        return dict(self.envelope(chunk=True), choices=[choice])

    def logprobs(self, tokens: list[Token]) -> dict[str, Any] | None:
        if not self.parsed.logprobs or not tokens:
            return None
        text = self.codec.token_text
        offsets = []
        for t in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(t.text)
        return {"tokens": [text(t.token_id) for t in tokens],
                "token_logprobs": [t.choice.logprob for t in tokens],
                "top_logprobs": [_by_text(t.choice.top, text) for t in tokens],
                "text_offset": offsets}


def _by_text(top: tuple[tuple[int, float], ...], text: Callable[[int], str]) -> dict[str, float]:
    """Completions key alternatives by text; tokens that read the same keep the likeliest."""
    out: dict[str, float] = {}
    for token_id, logprob in top:  # most likely first
        out.setdefault(text(token_id), logprob)
    return out


class ChatFormat(CompletionFormat):
    """Shapes events as /v1/chat/completions objects."""

    prefix, whole_object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def opening(self) -> list[dict[str, Any]]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""},
                  "finish_reason": None, "logprobs": None}
        return [dict(self.envelope(chunk=True), choices=[choice])]

    def whole(self, tokens: list[Token], done: Done) -> dict[str, Any]:
        message = {"role": "assistant", "content": "".join(t.text for t in tokens)}
        choice = {"index": 0, "message": message, "finish_reason": done.finish_reason,
                  "logprobs": self.logprobs(tokens)}
        return dict(self.envelope(chunk=False), choices=[choice], usage=self.usage(done))

    def chunk(self, tokens: list[Token], finish_reason: str | None) -> dict[str, Any]:
        delta = {"content": "".join(t.text for t in tokens)} if tokens else {}
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason,
                  "logprobs": self.logprobs(tokens)}
        return dict(self.envelope(chunk=True), choices=[choice])

    def logprobs(self, tokens: list[Token]) -> dict[str, Any] | None:
        if not self.parsed.logprobs or not tokens:
            return None

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.codec.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [dict(entry(t.token_id, t.choice.logprob),
                                 top_logprobs=[entry(i, lp) for i, lp in t.choice.top])
                            for t in tokens]}

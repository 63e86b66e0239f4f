"""The front door: a stable OpenAI-compatible endpoint that proxies to a serving replica's
rank 0, streaming included, with the fleet's client semantics.

- a model with several serving replicas: the request goes to the one that holds its
  conversation while that one has a free slot (supervisor.affinity), else to the one with
  the most free slots (`by_free_slots`); one that cannot take it before anything was sent to the client
  (unreachable, lost, or its own 503: busy, draining, failed) hands it to the next, so a
  503 reaches the client only when every replica is full or down;
- a replica whose rank 0 did not answer /health after a relay to it timed out, was refused
  or was reset is suspect (supervisor.relays): it is routed nothing new until its /health
  answers again, without waiting for the supervisor's verdict;

- no serving replica for the model, or the replica lost before its first byte (unreachable,
  closed, failed by the supervisor, silent past the ring's dead-ring time): 503,
  `Retry-After`, an OpenAI-style error body; an engine's own 503 (failed, busy, draining)
  keeps its `Retry-After`;
- any other reply of the engine about this one request (a 400 for a bad parameter, a 500
  for a failure of this request alone) passes through as it is, with no `Retry-After`;
- the upstream lost after tokens were sent: an SSE error event, and no `finish_reason`;
- a model the fleet does not serve: 404 `model_not_found`; with API keys configured, a
  request without one of them: 401 (/metrics too; only /health is open).
The client's own `Authorization` never travels upstream; the replica's secret does.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from engine.api.auth import bearer_token
from engine.api.bodies import read_body
from engine.api.connections import (
    ConnectionGuard,
    GuardedSite,
    HttpLimits,
    default_max_connections,
)
from engine.api.errors import RETRY_AFTER_S, ApiError
from engine.api.errors import unavailable as engine_unavailable
from engine.api.repeated_errors import RepeatedLog
from supervisor.affinity import conversation_key
from supervisor.front_door_metrics import OTHER, FrontDoorMetrics, model_label, route_label
from supervisor.relays import (
    Relays,
    ReplicaLost,
    ReplicaWatch,
    UpstreamSilence,
    read_until_lost,
    until_lost,
)

log = structlog.get_logger()

CONNECT_TIMEOUT_S = 5.0
MAX_BODY_BYTES = 16 << 20
LINGERING_S = 2.0  # a refused body is drained this long at most before the connection closes
PROXIED_HEADERS = ("Content-Type", "Retry-After", "Cache-Control")
TRANSPORT_ERRORS = (aiohttp.ClientError, OSError, TimeoutError, asyncio.IncompleteReadError)
OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)


def out_of_descriptors(exc: BaseException) -> bool:
    """Whether a connection failed for want of a descriptor here: the front door's own
    trouble, which says nothing about the replica."""
    cause = getattr(exc, "os_error", None) or exc
    return isinstance(cause, OSError) and cause.errno in OUT_OF_DESCRIPTORS


@dataclass(frozen=True)
class Route:
    """Where a model's requests go now, or why nowhere (`status`, `message`)."""

    url: str = ""  # rank 0's base URL, e.g. http://10.0.0.2:8000
    replica: str = ""
    status: int = 200
    message: str = ""
    api_secret: str = ""  # sent upstream as `Authorization: Bearer …` when set
    fallbacks: tuple[Route, ...] = ()  # the model's other serving replicas, next best first


@dataclass(frozen=True)
class ReplicaLoad:
    """One serving replica as the front door weighs it."""

    replica: str
    slots: int  # streams its rank 0 serves at once (the model's `parallel`)
    in_use: int  # the more of: relays open to it here, slots its rank 0 last said were taken

    @property
    def free(self) -> int:
        return self.slots - self.in_use


def by_free_slots(loads: list[ReplicaLoad], turn: int = 0) -> list[ReplicaLoad]:
    """The replicas in the order a request tries them: most free slots first; among equals,
    round-robin by `turn` (a counter the caller advances), so idle replicas share the load."""
    out: list[ReplicaLoad] = []
    for free in sorted({load.free for load in loads}, reverse=True):
        equals = sorted((load for load in loads if load.free == free), key=lambda x: x.replica)
        shift = turn % len(equals)
        out += equals[shift:] + equals[:shift]
    return out


class TryElsewhere(Exception):
    """This replica did not take the request and nothing reached the client: the next may."""


def front_door_limits() -> HttpLimits:
    """Rank 0's own connection bounds (heads, idle time, bodies), with half its connection
    cap, since a relayed connection holds two descriptors, and room for long prompts."""
    return HttpLimits(max_connections=max(8, default_max_connections() // 2),
                      max_body_bytes=MAX_BODY_BYTES)


@dataclass(frozen=True)
class FrontDoorConfig:
    # (model id or None, the conversation's key or None: supervisor.affinity) -> where to go
    router: Callable[[str | None, str | None], Route]
    models: Callable[[], list[dict[str, Any]]]  # /v1/models entries
    # The keys, or where to read them per request (fleet-front-door's synced route table).
    api_keys: frozenset[str] | Callable[[], frozenset[str]] = frozenset()
    relays: Relays = field(default_factory=Relays)  # the supervisor fails replicas here
    silence: UpstreamSilence = field(default_factory=UpstreamSilence)
    limits: HttpLimits = field(default_factory=front_door_limits)

    def keys(self) -> frozenset[str]:
        return self.api_keys() if callable(self.api_keys) else self.api_keys


CONFIG = web.AppKey("front_door_config", FrontDoorConfig)
SESSION = web.AppKey("front_door_session", aiohttp.ClientSession)
LOGS = web.AppKey("front_door_logs", RepeatedLog)
GUARD = web.AppKey("front_door_guard", ConnectionGuard)
METRICS = web.AppKey("front_door_metrics", FrontDoorMetrics)
MODEL_LABEL = web.RequestKey("model_label", str)  # the request's model as /metrics has it


def error(status: int, message: str, *, kind: str = "server_error", code: str | None = None,
          param: str | None = None) -> web.Response:
    """An OpenAI-style error, built by engine.api.errors like rank 0's."""
    return ApiError(status, message, kind=kind, code=code, param=param).response()


def unavailable(message: str) -> web.Response:
    """503 + Retry-After, as rank 0 says it."""
    return engine_unavailable(message).response()


def sse_error(message: str) -> bytes:
    """A stream's last event when its replica was lost after tokens were sent."""
    return engine_unavailable(message).event()


def key_matches(given: bytes, keys: frozenset[str]) -> bool:
    matched = False
    for key in keys:  # every key compared, so timing says nothing about which one is near
        matched |= hmac.compare_digest(given, key.encode("utf-8", "surrogatepass"))
    return matched


@web.middleware
async def count_requests(request: web.Request, handler: Callable) -> web.StreamResponse:
    """Counts each reply by fixed labels (supervisor.front_door_metrics); a client gone
    (the handler cancelled) got no reply and is not counted."""
    try:
        response = await handler(request)
    except web.HTTPException as exc:  # aiohttp's own 404 and 405
        _count(request, exc.status)
        raise
    _count(request, response.status)
    return response


def _count(request: web.Request, status: int) -> None:
    request.app[METRICS].requests.labels(route_label(request),
                                         request.get(MODEL_LABEL, OTHER), str(status)).inc()


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(), content_type="text/plain",
                        charset="utf-8")


@web.middleware
async def check_api_key(request: web.Request, handler: Callable) -> web.StreamResponse:
    keys = request.app[CONFIG].keys()
    if keys and request.path != "/health":
        given = bearer_token(request)  # the scheme's name in any case (RFC 9110 11.1)
        if not given or not key_matches(given, keys):
            return error(401, "a valid API key is required (Authorization: Bearer KEY)",
                         kind="invalid_request_error", code="invalid_api_key")
    return await handler(request)


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": request.app[CONFIG].models()})


async def health(request: web.Request) -> web.Response:
    entries = request.app[CONFIG].models()
    serving = [m["id"] for m in entries if m.get("serving")]
    return web.json_response({"status": "ok" if serving else "no serving replica",
                              "serving": serving}, status=200 if serving else 503)


async def proxy(request: web.Request) -> web.StreamResponse:
    config = request.app[CONFIG]
    try:
        raw = await read_body(request, config.limits.max_body_bytes, config.limits.body_s)
    except ApiError as exc:  # 408, 413 (a compressed body too, stopped at the bound), 415
        return exc.response()
    try:
        body = json.loads(raw)
    except ValueError:
        return error(400, "the body is not valid JSON", kind="invalid_request_error")
    if not isinstance(body, dict):
        return error(400, "expected a JSON object", kind="invalid_request_error")
    model = body.get("model")
    route = config.router(model if isinstance(model, str) else None, conversation_key(body))
    request[MODEL_LABEL] = model_label(model, route)
    if route.status == 503:
        return unavailable(route.message)
    if route.status != 200:
        code = "model_not_found" if route.status == 404 else None
        return error(route.status, route.message, kind="invalid_request_error", code=code,
                     param="model")
    relays = config.relays
    targets = [t for t in (route, *route.fallbacks) if relays.failure(t.replica) is None]
    if not targets:
        failure = relays.failure(route.replica)
        return unavailable(f"the replica serving {model!r} failed ({failure}); retry shortly")
    for target in targets:
        if relays.suspicion(target.replica) is not None:
            relays.recheck(target.replica, lambda t=target: answers_health(
                request.app[SESSION], t, config.silence.probe_timeout_s))
    suspects = [t for t in targets if relays.suspicion(t.replica) is not None]
    targets = [t for t in targets if t not in suspects]
    if not targets:
        return unavailable(f"rank 0 of the replica serving {model!r} did not answer "
                           f"({relays.suspicion(suspects[0].replica)}); retry shortly")
    refusal: web.StreamResponse | None = None
    tried: list[str] = []
    for i, target in enumerate(targets):
        with relays.open(target.replica) as watch:
            relay = Relay(request, target, watch, bool(body.get("stream")),
                          last=i == len(targets) - 1, tried=tuple(tried))
            try:
                return await relay.run(raw, model)
            except TryElsewhere as exc:
                refusal = exc.args[0] if exc.args else None
                tried.append(target.replica)
                request.app[METRICS].handed_on.labels(request[MODEL_LABEL]).inc()
    return refusal or unavailable(f"no replica of {model!r} took the request; retry shortly")


class Relay:
    """One client request carried to rank 0 and its reply carried back."""

    def __init__(self, request: web.Request, route: Route, watch: ReplicaWatch,
                 stream: bool, last: bool = True, tried: tuple[str, ...] = ()) -> None:
        self.request, self.route, self.watch, self.stream = request, route, watch, stream
        self.last = last  # no other replica to hand the request to
        self.tried = tried  # the replicas that did not take it before this one
        self.config = request.app[CONFIG]
        self.session = request.app[SESSION]
        self.logs = request.app[LOGS]
        self.log = log.bind(replica=route.replica, path=request.path)

    def warn(self, message: str, **kw: Any) -> None:
        # One line per kind of loss and replica per interval: a replica's hundred streams
        # cut at once are one line with a count.
        self.logs.note(f"{message} ({self.route.replica})", replica=self.route.replica,
                       path=self.request.path, **kw)

    def upstream_headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.route.api_secret:
            headers["Authorization"] = f"Bearer {self.route.api_secret}"
        return headers

    async def alive(self) -> bool:
        """Whether rank 0 answers /health at all within the probe timeout."""
        return await answers_health(self.session, self.route,
                                    self.config.silence.probe_timeout_s)

    async def bounded(self, work: Any, *, until_suspect: bool = False) -> Any:
        return await until_lost(work, self.watch, self.config.silence, self.alive,
                                until_suspect=until_suspect)

    async def run(self, raw: bytes, model: Any) -> web.StreamResponse:
        # Until the reply's head arrives the request may go to another replica: a completion
        # has no effect outside its reply, and the one left behind is cancelled on rank 0
        # when this connection closes (if it ever started). After the head, never.
        try:
            upstream = await self.bounded(self.session.post(
                self.route.url + self.request.path, data=raw, headers=self.upstream_headers()),
                until_suspect=True)
        except ReplicaLost as exc:
            self.warn("upstream lost before the reply", cause=str(exc))
            return self.refused(unavailable(f"{exc}; retry shortly"))
        except TRANSPORT_ERRORS as exc:
            if out_of_descriptors(exc):  # another replica would fail the same way
                self.warn("no descriptor for the upstream connection", error=str(exc))
                return unavailable("the front door is out of connections; retry shortly")
            self.warn("upstream not reachable", error=str(exc) or type(exc).__name__)
            # Refused or reset: a stale kept-alive connection too, so rank 0 is asked before
            # it is held suspect (a failed probe makes it so: ReplicaWatch).
            await self.watch.alive(self.alive)
            return self.refused(unavailable(f"the replica serving {model!r} is not reachable; "
                                            "retry shortly"))
        if upstream.status == 503 and not self.last:  # busy, draining or failed: the next
            upstream.close()
            raise TryElsewhere(None)
        complete = False
        try:
            response = await self.relay(upstream)
            complete = True
            return response
        finally:
            # A reply not carried whole (a client gone, a replica lost) closes the upstream
            # connection, which cancels the request on rank 0 and frees its slot.
            if complete and upstream.content.at_eof():
                upstream.release()
            else:
                upstream.close()

    def refused(self, response: web.Response) -> web.Response:
        """`response` for the client when no other replica is left to try."""
        if self.last:
            return response
        raise TryElsewhere(response)

    async def relay(self, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        headers = {k: upstream.headers[k] for k in PROXIED_HEADERS if k in upstream.headers}
        headers["X-Ringfleet-Replica"] = self.route.replica
        if self.tried:  # why this reply was slow, and where it was not served
            headers["X-Ringfleet-Tried"] = ", ".join(self.tried)
        is_sse = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
        if not (self.stream and is_sse and upstream.status == 200):
            return await self.whole(upstream, headers)
        try:
            first = await self.bounded(upstream.content.readany())
        except (ReplicaLost, *TRANSPORT_ERRORS) as exc:
            self.warn("upstream lost before the first byte", cause=str(exc))
            return unavailable(f"{exc}; retry shortly" if isinstance(exc, ReplicaLost) else
                               "the replica was lost before the first token; retry shortly")
        if not first:
            self.warn("upstream lost before the first byte", cause="closed")
            return unavailable("the replica was lost before the first token; retry shortly")
        return await self.streamed(upstream, headers, first)

    async def whole(self, upstream: aiohttp.ClientResponse,
                    headers: dict[str, str]) -> web.Response:
        """A whole reply, as the engine gave it: its 4xx and 5xx about this request too."""
        try:
            data = await self.bounded(upstream.read())
        except (ReplicaLost, *TRANSPORT_ERRORS) as exc:
            self.warn("upstream lost before the reply", cause=str(exc) or type(exc).__name__)
            return unavailable(f"{exc}; retry shortly" if isinstance(exc, ReplicaLost) else
                               "the replica was lost before the reply; retry shortly")
        if upstream.status == 503 and "Retry-After" not in headers:
            headers["Retry-After"] = str(RETRY_AFTER_S)  # the engine failed or is busy
        return web.Response(body=data, status=upstream.status, headers=headers)

    async def streamed(self, upstream: aiohttp.ClientResponse, headers: dict[str, str],
                       first: bytes) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers=headers)
        try:
            await response.prepare(self.request)
            await response.write(first)
            reason = await self.pump(upstream, response, first)
            if reason:
                self.warn("stream cut", cause=reason)
                await response.write(sse_error(reason + "; the reply is incomplete"))
            await response.write_eof()
        except TRANSPORT_ERRORS:  # only writes to the client are left to fail here
            self.log.info("client gone mid-stream")
        return response

    async def pump(self, upstream: aiohttp.ClientResponse, response: web.StreamResponse,
                   first: bytes) -> str:
        """Carry the rest of the stream; returns why it is incomplete, or "" when whole."""
        tail = last_event(first)
        silence = self.config.silence
        with self.watch.closing(upstream.close):
            while True:
                try:
                    chunk = await read_until_lost(upstream.content.readany, self.watch,
                                                  silence, self.alive)
                except ReplicaLost as exc:
                    return str(exc)
                except TRANSPORT_ERRORS as exc:
                    if self.watch.failed.is_set():  # the close that woke this read
                        return str(self.watch.lost(silence))
                    return f"the replica was lost mid-stream ({type(exc).__name__})"
                if not chunk:
                    break
                await response.write(chunk)
                tail = last_event(tail + chunk)
        if b"[DONE]" in tail or tail.startswith(b'data: {"error"'):
            return ""
        if self.watch.failed.is_set():
            return str(self.watch.lost(silence))
        return "the replica closed the stream before it was complete"


LAST_EVENT_BYTES = 64 * 1024  # of the stream's last event kept; past it, its head is lost


def last_event(data: bytes) -> bytes:
    """The stream's last SSE event (with any part of the next), whose head says whether the
    stream ended whole: `[DONE]`, or an error event of the engine's own. A fixed tail of
    bytes is not enough: an engine's error event naming a long reason pushes its own head
    out, and the front door then appended a second error after it."""
    cut = data.rfind(b"\n\n", 0, len(data.rstrip(b"\r\n")))
    return (data[cut + 2:] if cut >= 0 else data)[-LAST_EVENT_BYTES:]


async def answers_health(session: aiohttp.ClientSession, route: Route, timeout_s: float) -> bool:
    """Whether rank 0 answers /health at all (any status) within `timeout_s`."""
    headers = {"Authorization": f"Bearer {route.api_secret}"} if route.api_secret else {}
    try:
        async with session.get(route.url + "/health", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as reply:
            await reply.read()
            return True
    except TRANSPORT_ERRORS:
        return False


async def _session_ctx(app: web.Application):
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
    # No pool cap of its own: the listener's connection cap bounds what is relayed.
    connector = aiohttp.TCPConnector(limit=0)
    app[SESSION] = aiohttp.ClientSession(timeout=timeout, connector=connector,
                                         auto_decompress=False)
    yield
    await app[CONFIG].relays.close()
    await app[SESSION].close()


def make_front_door(config: FrontDoorConfig) -> web.Application:
    guard = ConnectionGuard(config.limits, RepeatedLog(emit=log.warning))
    app = web.Application(middlewares=[guard.middleware, count_requests, check_api_key],
                          client_max_size=config.limits.max_body_bytes)
    app[CONFIG], app[GUARD], app[LOGS] = config, guard, RepeatedLog(emit=log.warning)
    app[METRICS] = FrontDoorMetrics(lambda: config.relays.suspected_total)
    app.router.add_routes([
        web.get("/health", health),
        web.get("/metrics", metrics),
        web.get("/v1/models", models),
        web.post("/v1/chat/completions", proxy),
        web.post("/v1/completions", proxy),
    ])
    app.cleanup_ctx.append(_session_ctx)
    return app


async def open_front_door(config: FrontDoorConfig, host: str, port: int) -> web.AppRunner:
    """Serve the front door on host:port within its limits; `await runner.cleanup()` ends it.

    Handlers are cancelled when their client goes away, so a relay that waits for a whole
    reply ends (and closes its upstream request) with its client.
    """
    app = make_front_door(config)
    # auto_decompress off: bodies are decoded within their bound by engine.api.bodies.
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0, auto_decompress=False,
                           handler_cancellation=True, keepalive_timeout=config.limits.idle_s,
                           lingering_time=LINGERING_S)
    await runner.setup()
    try:
        await GuardedSite(runner, host, port, app[GUARD]).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner

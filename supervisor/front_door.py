"""The front door: a stable OpenAI-compatible endpoint that proxies to the serving replica's
rank 0, streaming included, with the fleet's client semantics.

- no serving replica for the model: 503, `Retry-After`, an OpenAI-style error body;
- the upstream lost before its first byte: the same 503;
- the upstream lost after tokens were sent: an SSE error event, and no `finish_reason`;
- a model the fleet does not serve: 404 `model_not_found`; with API keys configured, a
  request without one of them: 401.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog
from aiohttp import web

log = structlog.get_logger()

RETRY_AFTER_S = 5
CONNECT_TIMEOUT_S = 5.0
PROXIED_HEADERS = ("Content-Type", "Retry-After", "Cache-Control")


@dataclass(frozen=True)
class Route:
    """Where a model's requests go now, or why nowhere (`status`, `message`)."""

    url: str = ""  # rank 0's base URL, e.g. http://10.0.0.2:8000
    replica: str = ""
    status: int = 200
    message: str = ""


@dataclass(frozen=True)
class FrontDoorConfig:
    router: Callable[[str | None], Route]  # model id (None: not given) -> where to go
    models: Callable[[], list[dict[str, Any]]]  # /v1/models entries
    api_keys: frozenset[str] = frozenset()


CONFIG = web.AppKey("front_door_config", FrontDoorConfig)
SESSION = web.AppKey("front_door_session", aiohttp.ClientSession)


def error(status: int, message: str, *, kind: str = "server_error", code: str | None = None,
          param: str | None = None, retry: bool = False) -> web.Response:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if retry else None
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def unavailable(message: str) -> web.Response:
    return error(503, message, code="unavailable", retry=True)


def sse_error(message: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None,
                      "code": "unavailable"}}
    return f"data: {json.dumps(body)}\n\n".encode()


@web.middleware
async def check_api_key(request: web.Request, handler: Callable) -> web.StreamResponse:
    keys = request.app[CONFIG].api_keys
    if keys and request.path != "/health":
        auth = request.headers.get("Authorization", "")
        given = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        if not any(hmac.compare_digest(given, key) for key in keys):
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
    raw = await request.read()
    try:
        body = json.loads(raw)
    except ValueError:
        return error(400, "the body is not valid JSON", kind="invalid_request_error")
    if not isinstance(body, dict):
        return error(400, "expected a JSON object", kind="invalid_request_error")
    model = body.get("model")
    route = request.app[CONFIG].router(model if isinstance(model, str) else None)
    if route.status == 503:
        return unavailable(route.message)
    if route.status != 200:
        code = "model_not_found" if route.status == 404 else None
        return error(route.status, route.message, kind="invalid_request_error", code=code,
                     param="model")
    url = route.url + request.path
    bound = log.bind(replica=route.replica, path=request.path)
    session = request.app[SESSION]
    try:
        upstream_cm = session.post(url, data=raw, headers={"Content-Type": "application/json"})
        upstream = await upstream_cm.__aenter__()
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        bound.warning("upstream not reachable", error=str(exc) or type(exc).__name__)
        return unavailable(f"the replica serving {model!r} is not reachable; retry shortly")
    try:
        return await _relay(request, upstream, route, bound, bool(body.get("stream")))
    finally:
        await upstream_cm.__aexit__(None, None, None)


async def _relay(request: web.Request, upstream: aiohttp.ClientResponse, route: Route,
                 bound: Any, stream: bool) -> web.StreamResponse:
    headers = {k: upstream.headers[k] for k in PROXIED_HEADERS if k in upstream.headers}
    headers["X-Ringfleet-Replica"] = route.replica
    is_sse = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
    if not (stream and is_sse and upstream.status == 200):
        try:
            data = await upstream.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            bound.warning("upstream lost before the reply", error=str(exc) or type(exc).__name__)
            return unavailable("the replica was lost before the reply; retry shortly")
        if upstream.status >= 500 and "Retry-After" not in headers:
            headers["Retry-After"] = str(RETRY_AFTER_S)
        return web.Response(body=data, status=upstream.status, headers=headers)
    try:
        first = await upstream.content.readany()
    except (aiohttp.ClientError, OSError, TimeoutError):
        first = b""
    if not first:
        bound.warning("upstream lost before the first byte")
        return unavailable("the replica was lost before the first token; retry shortly")
    response = web.StreamResponse(status=200, headers=headers)
    await response.prepare(request)
    tail = first[-256:]
    await response.write(first)
    try:
        while chunk := await upstream.content.readany():
            await response.write(chunk)
            tail = (tail + chunk)[-256:]
        finished = b"[DONE]" in tail or b'data: {"error"' in tail
        reason = "the replica closed the stream before it was complete"
    except (aiohttp.ClientError, OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
        finished = False
        reason = f"the replica was lost mid-stream ({type(exc).__name__})"
    if not finished:
        bound.warning("stream cut", reason=reason)
        await response.write(sse_error(reason + "; the reply is incomplete"))
    await response.write_eof()
    return response


async def _session_ctx(app: web.Application):
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
    app[SESSION] = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
    yield
    await app[SESSION].close()


def make_front_door(config: FrontDoorConfig) -> web.Application:
    app = web.Application(middlewares=[check_api_key], client_max_size=16 << 20)
    app[CONFIG] = config
    app.router.add_routes([
        web.get("/health", health),
        web.get("/v1/models", models),
        web.post("/v1/chat/completions", proxy),
        web.post("/v1/completions", proxy),
    ])
    app.cleanup_ctx.append(_session_ctx)
    return app

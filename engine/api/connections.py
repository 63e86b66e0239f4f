"""Bounds on the connections of rank 0's API: how many, how long to send a request's
headers, how long to sit idle; beyond them a connection is closed, never waited on.

aiohttp alone waits for a request's headers for as long as its keep-alive timeout (an
hour by default) and accepts every connection until the process runs out of descriptors,
so a few thousand slowloris sockets held the API. Here:
- a new connection must complete its first request's headers within `header_s`;
- a connection idle after a response (or dripping its next headers) closes `idle_s` later
  (aiohttp's keep-alive timeout, set from the same limits);
- past `max_connections`, a new connection gets a short 503 and is closed as soon as its
  request is read (a second at most), so the event loop and the descriptors stay free for
  the connections it has.
"""

from __future__ import annotations

import asyncio
import json
import resource
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from aiohttp import web

from engine.addresses import format_host_port
from engine.api.errors import RETRY_AFTER_S, ApiError
from engine.api.repeated_errors import RepeatedLog

log = structlog.get_logger()


def default_max_connections() -> int:
    """Half the descriptors this process may open (the model, logs and the ring need some)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(8, min(4096, soft // 2))


@dataclass(frozen=True)
class HttpLimits:
    max_connections: int = 1024
    header_s: float = 5.0  # a new connection must have sent its first request's headers by then
    idle_s: float = 15.0  # a keep-alive connection closes this long after its last response
    body_s: float = 30.0  # a request's body must have arrived by then (the handler's bound)
    max_body_bytes: int = 1 << 20


_REFUSED_BODY = json.dumps(ApiError(503, "too many connections", kind="server_error",
                                    code="too_many_connections").body()).encode()
REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
           + f"Retry-After: {RETRY_AFTER_S}\r\nConnection: close\r\nContent-Length: ".encode()
           + str(len(_REFUSED_BODY)).encode() + b"\r\n\r\n" + _REFUSED_BODY)


# How long a refused connection stays open to swallow its request, and for how many
# connections at once: past that count a refusal closes at once, so a flood cannot hold
# descriptors through the refusals themselves.
REFUSAL_LINGER_S = 1.0
MAX_LINGERING = 64


class _Refused(asyncio.Protocol):
    """A connection over the cap: a 503 in one write, then closed once the client's request
    is read (or `REFUSAL_LINGER_S` has passed). Closing with the request unread would make
    the kernel answer with a reset, which can reach the client before the 503 does, so a
    client sending a request would see a dropped connection instead of the refusal."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self._guard = guard  # it counts the refused connections still open
        self._transport: asyncio.WriteTransport | None = None
        self._closer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(REFUSED)
        if self._guard.lingering >= MAX_LINGERING or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self._transport = transport
        self._guard.lingering += 1
        self._closer = asyncio.get_running_loop().call_later(REFUSAL_LINGER_S,
                                                             transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # the request, read only so that closing sends no reset

    def eof_received(self) -> bool:
        return False  # the client is done: close

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is not None:
            self._guard.lingering -= 1
            self._transport = None
        if self._closer is not None:
            self._closer.cancel()


class ConnectionGuard:
    """Makes the protocol for each accepted connection: aiohttp's, or a refusal."""

    def __init__(self, limits: HttpLimits, repeated: RepeatedLog | None = None) -> None:
        self.limits = limits
        self.repeated = repeated or RepeatedLog(emit=log.warning)
        self.refused = 0
        self.timed_out = 0
        self.lingering = 0  # refused connections still open, reading their requests
        # ids of handlers before their header deadline, and of those whose first request
        # arrived by then (a handler stays alive until its deadline runs, so ids are unique)
        self._watching: set[int] = set()
        self._started: set[int] = set()
        self._burst = 0  # handlers made on this turn of the loop, not yet connected

    def factory(self, server: web.Server) -> Callable[[], asyncio.Protocol]:
        loop = asyncio.get_running_loop()

        def make() -> asyncio.Protocol:
            # Handlers made in this accept burst are not in server.connections until their
            # connection_made runs, on the next turn of the loop, right after the reset
            # scheduled here (it was queued first): count them meanwhile.
            if len(server.connections) + self._burst >= self.limits.max_connections:
                self.refused += 1
                self.repeated.note("connection refused: the API is at its connection cap",
                                   max_connections=self.limits.max_connections,
                                   refused_total=self.refused)
                return _Refused(self)
            handler = server()
            if not self._burst:
                loop.call_soon(self._burst_connected)
            self._burst += 1
            self._watching.add(id(handler))
            loop.call_later(self.limits.header_s, self._header_deadline, handler)
            return handler

        return make

    def _burst_connected(self) -> None:
        self._burst = 0

    def _header_deadline(self, handler: web.RequestHandler) -> None:
        self._watching.discard(id(handler))
        if id(handler) in self._started:
            self._started.discard(id(handler))
            return
        if handler.transport is not None and not handler.transport.is_closing():
            self.timed_out += 1
            self.repeated.note("connection closed: no request headers in time",
                               header_s=self.limits.header_s, closed_total=self.timed_out)
            handler.force_close()

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable) -> web.StreamResponse:
        """Notes that this connection's request headers arrived (before any other work)."""
        if id(request.protocol) in self._watching:
            self._started.add(id(request.protocol))
        return await handler(request)


class GuardedSite(web.BaseSite):
    """A TCP site whose connections go through a `ConnectionGuard`."""

    __slots__ = ("_guard", "_host", "_port")

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard,
                 *, backlog: int = 128) -> None:
        super().__init__(runner, backlog=backlog)
        self._host, self._port, self._guard = host, port, guard

    @property
    def name(self) -> str:
        return f"http://{format_host_port(self._host, self._port)}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        self._server = await loop.create_server(self._guard.factory(server), self._host,
                                                self._port, backlog=self._backlog,
                                                reuse_address=True)

"""Limits for an HTTP listener that strangers reach: how long a request head and body may
take, how long a connection may idle, how many connections are held at once, and one log
line per repeated error instead of one per occurrence.

aiohttp closes a connection that has not sent a whole request head within its
`keepalive_timeout` of opening (or of its last reply), so that one setting bounds both the
slow head (slowloris) and the idle connection; the body is bounded by the handler that
reads it. Connections beyond the cap get a 503 and are closed before any handler runs, so
the process never reaches its file-descriptor limit (where accept() fails and logs).
"""

from __future__ import annotations

import asyncio
import json
import resource
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiohttp import web

log = structlog.get_logger()

FD_RESERVE = 64  # descriptors kept for the process's own files, logs and outgoing calls


def default_max_connections() -> int:
    """Half of what the descriptor limit leaves: a proxied connection holds two."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 16
    return max(8, min(4096, (soft - FD_RESERVE) // 2))


@dataclass(frozen=True)
class ListenerLimits:
    request_head_s: float = 5.0  # a whole request head within this; also the idle bound
    request_body_s: float = 15.0  # the whole body within this, once the head is in
    lingering_s: float = 2.0  # unread body drained after a reply, at most this long
    max_connections: int = field(default_factory=default_max_connections)
    retry_after_s: int = 5  # told to a connection refused at the cap

    def runner_kwargs(self) -> dict[str, float]:
        """What `web.AppRunner` takes to enforce the head and idle bounds."""
        return {"keepalive_timeout": self.request_head_s, "lingering_time": self.lingering_s}


class RepeatLimiter:
    """At most one log line per key per `interval_s`; the next one says how many were held."""

    def __init__(self, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last: dict[Hashable, float] = {}
        self._held: dict[Hashable, int] = {}

    def allow(self, key: Hashable) -> int | None:
        """None: hold this one back; else the number held back since the last line."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        if len(self._last) > 1024:  # keys are few (reasons x replicas); never let them grow
            self._last.clear()
            self._held.clear()
        self._last[key] = now
        return self._held.pop(key, 0)

    def warning(self, logger: Any, message: str, *, key: Hashable = None, **kw: Any) -> None:
        held = self.allow((message, key))
        if held is not None:
            logger.warning(message, **({"repeated": held} if held else {}), **kw)


def _refusal(retry_after_s: int) -> bytes:
    body = json.dumps({"error": {"message": "too many connections; retry shortly",
                                 "type": "server_error", "param": None,
                                 "code": "unavailable"}}).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Retry-After: {retry_after_s}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n")
    return head.encode() + body


class _Refused(asyncio.Protocol):
    def __init__(self, reply: bytes) -> None:
        self.reply = reply

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(self.reply)
        transport.close()


class CappedSite(web.BaseSite):
    """A TCP site that serves at most `limits.max_connections` connections at once."""

    __slots__ = ("_host", "_limits", "_logs", "_port", "refused")

    def __init__(self, runner: web.BaseRunner, host: str, port: int,
                 limits: ListenerLimits, logs: RepeatLimiter | None = None) -> None:
        super().__init__(runner)
        self._host, self._port, self._limits = host, port, limits
        self._logs = logs or RepeatLimiter()
        self.refused = 0

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    @property
    def port(self) -> int:
        if self._server is not None and self._server.sockets:
            return self._server.sockets[0].getsockname()[1]
        return self._port

    def _protocol(self) -> asyncio.Protocol:
        server = self._runner.server
        assert server is not None
        if len(server.connections) < self._limits.max_connections:
            return server()
        self.refused += 1
        self._logs.warning(log, "connection refused: at the connection cap",
                           cap=self._limits.max_connections, refused=self.refused)
        return _Refused(_refusal(self._limits.retry_after_s))

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._protocol, self._host, self._port,
                                                backlog=self._backlog)

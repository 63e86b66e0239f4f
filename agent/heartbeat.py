"""Heartbeats to the supervisor: alive every interval, facts when they change, engine state
changes at once, and a goodbye on a graceful stop.

The supervisor's side of this contract (all JSON over mutual TLS):
  POST /v1/nodes/{node}/heartbeat  {node, url, seq, sent_at, facts_digest, facts?, engines}
                                   → may answer {"want_facts": true} to get facts next beat
  POST /v1/nodes/{node}/events     {node, events: [{seq, engine_id, state, at, detail}]}
  POST /v1/nodes/{node}/goodbye    {node, reason}
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog

from agent.engines import EngineEvent, EngineView
from agent.facts import Facts

log = structlog.get_logger()

MAX_QUEUED_EVENTS = 1000
REQUEST_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class BeatMemory:
    """What the last accepted heartbeat told the supervisor."""

    facts_digest: str | None = None  # None: facts must go with the next beat
    seq: int = 0


def build_heartbeat(node: str, url: str, memory: BeatMemory, facts: Facts | None,
                    engines: tuple[EngineView, ...], now: float) -> tuple[dict[str, Any], str | None]:
    """The next heartbeat's body and the facts digest it carries. Pure."""
    digest = facts.digest() if facts else None
    body: dict[str, Any] = {"node": node, "url": url, "seq": memory.seq + 1, "sent_at": now,
                            "facts_digest": digest,
                            "engines": [view.to_dict() for view in engines]}
    if facts is not None:
        body["ram_available_bytes"] = facts.host.ram_available_bytes
        if digest != memory.facts_digest:
            body["facts"] = facts.to_dict()
    return body, digest


def after_reply(memory: BeatMemory, digest: str | None, reply: dict[str, Any] | None) -> BeatMemory:
    """Memory after a beat: a beat the supervisor did not take, or a `want_facts`, forgets."""
    if reply is None:
        return BeatMemory(None, memory.seq + 1)
    return BeatMemory(None if reply.get("want_facts") else digest, memory.seq + 1)


class Heartbeat:
    """The loop that beats, and the sender that reports engine events as they happen."""

    def __init__(self, node: str, url: str, supervisor_url: str, interval_s: float,
                 ssl_context: ssl.SSLContext | None, facts: Callable[[], Facts | None],
                 engines: Callable[[], tuple[EngineView, ...]]) -> None:
        self.node = node
        self.url = url
        self.base = supervisor_url.rstrip("/") + f"/v1/nodes/{node}"
        self.interval_s = interval_s
        self.ssl_context = ssl_context
        self.facts = facts
        self.engines = engines
        self.memory = BeatMemory()
        self.queue: asyncio.Queue[EngineEvent] = asyncio.Queue(MAX_QUEUED_EVENTS)
        self.session: aiohttp.ClientSession | None = None
        self.tasks: list[asyncio.Task] = []
        self.failures = 0
        self.log = log.bind(node=node)

    def push(self, event: EngineEvent) -> None:
        """Called by the engine manager on every state change (the heartbeat still carries the
        engines' state, so an event dropped from a full queue is not lost for good)."""
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.log.warning("event queue full; the next heartbeat carries the state",
                             engine=event.engine_id)

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        assert self.session is not None
        try:
            async with self.session.post(self.base + path, json=body, ssl=self.ssl_context) as r:
                if r.status >= 400:
                    raise aiohttp.ClientResponseError(r.request_info, r.history, status=r.status,
                                                      message=(await r.text())[:200])
                reply = await r.json(content_type=None) if r.content_length != 0 else {}
                if self.failures:
                    self.log.info("supervisor reachable again", after_failures=self.failures)
                self.failures = 0
                return reply if isinstance(reply, dict) else {}
        except (aiohttp.ClientError, TimeoutError, ValueError, ssl.SSLError) as exc:
            self.failures += 1
            if self.failures in (1, 10) or self.failures % 100 == 0:
                self.log.warning("supervisor not reachable", path=path, error=str(exc) or
                                 type(exc).__name__, failures=self.failures)
            return None

    async def beat_once(self) -> dict[str, Any] | None:
        body, digest = build_heartbeat(self.node, self.url, self.memory, self.facts(),
                                       self.engines(), time.time())
        reply = await self._post("/heartbeat", body)
        self.memory = after_reply(self.memory, digest, reply)
        return reply

    async def _beat_loop(self) -> None:
        while True:
            await self.beat_once()
            await asyncio.sleep(self.interval_s)

    async def _event_loop(self) -> None:
        while True:
            events = [await self.queue.get()]
            while not self.queue.empty() and len(events) < 100:
                events.append(self.queue.get_nowait())
            body = {"node": self.node, "events": [e.to_dict() for e in events]}
            backoff = 0.2
            while await self._post("/events", body) is None:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.interval_s)

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._beat_loop()), loop.create_task(self._event_loop())]

    async def stop(self, reason: str = "the agent is stopping") -> None:
        """Flush queued events, say goodbye (bounded), and close."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.session is None:
            return
        pending = []
        while not self.queue.empty():
            pending.append(self.queue.get_nowait().to_dict())
        if pending:
            await self._post("/events", {"node": self.node, "events": pending})
        if await self._post("/goodbye", {"node": self.node, "reason": reason}) is not None:
            self.log.info("said goodbye to the supervisor")
        await self.session.close()

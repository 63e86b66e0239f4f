"""How a front door of its own process (`fleet-front-door`) keeps its routes: it polls the
supervisor's `GET /v1/routes` over mutual TLS with its `front-door` certificate every
`poll_s`, keeps the last good table and serves from it while the supervisor is away (down,
restarting, upgraded), and keeps it on disk (0600: it holds the replicas' secrets and the
client keys), so a front door restarted while the supervisor is down still serves.

An answer that is not a route table (garbled, cut, another version, an error status) is
refused with one log line naming what was wrong, and the last good table stays.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from pathlib import Path

import aiohttp
import structlog

from agent.pki import write_private
from supervisor.front_door import TRANSPORT_ERRORS, Route
from supervisor.relays import Relays
from supervisor.route_table import RouteTable, RouteTableError

log = structlog.get_logger()

ROUTES_PATH = "/v1/routes"
MAX_TABLE_BYTES = 16 << 20
POLL_S = 0.5
POLL_TIMEOUT_S = 2.0


class RouteSync:
    """The last good route table, kept fresh from the supervisor and on disk."""

    def __init__(self, supervisor_url: str, ssl_context: ssl.SSLContext | None,
                 routes_file: Path, relays: Relays | None = None, *, poll_s: float = POLL_S,
                 timeout_s: float = POLL_TIMEOUT_S) -> None:
        self.url = supervisor_url.rstrip("/") + ROUTES_PATH
        self.ssl = ssl_context
        self.routes_file = routes_file
        self.relays = relays or Relays()
        self.poll_s, self.timeout_s = poll_s, timeout_s
        self.table = RouteTable()
        self.synced_at: float | None = None  # time.monotonic() of the last good answer
        self.problem = ""  # what is wrong now ("" while answers are good): logged on change
        self.turn = 0  # round-robin among replicas with as many free slots
        self._saved: RouteTable | None = None  # what the file holds, less the loads

    # --- what the front door reads ----------------------------------------------------------
    def route(self, model: str | None, conversation: str | None = None) -> Route:
        self.turn += 1
        return self.table.route(model, self.relays, self.turn, conversation)

    def models(self) -> list[dict]:
        return self.table.model_entries()

    def api_keys(self) -> frozenset[str]:
        return self.table.api_keys

    # --- keeping it -------------------------------------------------------------------------
    def load(self) -> bool:
        """The table kept by an earlier run, if the file holds one; else none (logged)."""
        try:
            raw = self.routes_file.read_bytes()
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("routes file not readable; no routes until the supervisor answers",
                        file=str(self.routes_file), error=str(exc))
            return False
        try:
            table = RouteTable.from_json(raw)
        except RouteTableError as exc:
            log.warning("routes file refused; no routes until the supervisor answers",
                        file=str(self.routes_file), error=str(exc))
            return False
        self._saved = table.without_loads()
        self.adopt(table)
        log.info("serving from the routes kept on disk until the supervisor answers",
                 file=str(self.routes_file), models=[m.id for m in table.models])
        return True

    def adopt(self, table: RouteTable) -> None:
        """Serve from `table` now: relays to replicas it names as failed end, and it is
        written to disk when it differs from what is there (the loads aside)."""
        for replica, reason in table.failed:
            if self.relays.failure(replica) is None:
                self.relays.replica_failed(replica, reason)
        self.table = table
        kept = table.without_loads()
        if kept != self._saved:
            try:
                write_private(self.routes_file, table.to_json())
                self._saved = kept
            except OSError as exc:  # serving goes on; only a restart would miss them
                log.warning("routes not written to disk", file=str(self.routes_file),
                            error=str(exc))

    def trouble(self, problem: str, message: str) -> None:
        """Log a problem once when it starts or changes, not at every poll."""
        if problem != self.problem:
            age = (f"{time.monotonic() - self.synced_at:.1f} s old" if self.synced_at
                   else "from disk" if self.table.models else "none yet")
            log.warning(message, problem=problem, url=self.url, routes=age)
        self.problem = problem

    async def poll_once(self, session: aiohttp.ClientSession) -> bool:
        """Ask the supervisor once; True when its answer is the table served from now."""
        try:
            async with session.get(self.url, ssl=self.ssl, timeout=aiohttp.ClientTimeout(
                    total=self.timeout_s)) as reply:
                raw = bytearray()
                async for chunk in reply.content.iter_chunked(1 << 16):
                    raw += chunk
                    if len(raw) > MAX_TABLE_BYTES:
                        break
                status = reply.status
        except (*TRANSPORT_ERRORS, ssl.SSLError) as exc:
            # A refused connection's own error, not aiohttp's text around it (which names
            # the SSL context object, different in every process).
            cause = getattr(exc, "os_error", None) or exc
            self.trouble(f"unreachable: {str(cause) or type(cause).__name__}",
                         "supervisor not reachable; serving from the last routes")
            return False
        if status != 200:
            self.trouble(f"HTTP {status}: {bytes(raw[:300]).decode(errors='replace')}",
                         "supervisor refused the route request; serving from the last routes")
            return False
        if len(raw) > MAX_TABLE_BYTES:
            self.trouble(f"an answer over {MAX_TABLE_BYTES} bytes",
                         "route answer refused; keeping the last routes")
            return False
        try:
            table = RouteTable.from_json(bytes(raw))
        except RouteTableError as exc:
            self.trouble(f"not a route table: {exc}",
                         "route answer refused; keeping the last routes")
            return False
        if self.problem or self.synced_at is None:
            log.info("routes synced from the supervisor", url=self.url,
                     models=[m.id for m in table.models], after=self.problem or None)
        self.problem = ""
        self.synced_at = time.monotonic()
        self.adopt(table)
        return True

    async def run(self) -> None:
        """Poll until cancelled."""
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    await self.poll_once(session)
                except Exception:  # a bug here must not end the polling: serving goes on
                    log.exception("route poll failed")
                await asyncio.sleep(self.poll_s)

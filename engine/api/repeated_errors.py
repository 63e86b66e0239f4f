"""Repeated error logs, rate-limited: one line per reason per interval, with a count.

A flood of one failure (accept() hitting EMFILE under 20k idle connections, a client
population sending the same broken request) must not turn into a flood of log lines:
the first occurrence is logged at once, later ones within `interval_s` are only counted,
and the next line for that reason says how many were left out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger()

MAX_REASONS = 256  # reasons are fixed strings and exception names; bound them anyway


@dataclass
class _Seen:
    logged_s: float
    left_out: int = 0


class RepeatedLog:
    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 emit: Callable[..., None] | None = None) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.emit = emit or log.error
        self._seen: dict[str, _Seen] = {}

    def note(self, reason: str, **fields: Any) -> bool:
        """Log `reason` unless it was logged less than `interval_s` ago; True if logged."""
        now = self.clock()
        if reason not in self._seen and len(self._seen) >= MAX_REASONS:
            self._seen = {r: s for r, s in self._seen.items()
                          if now - s.logged_s < self.interval_s}
            if len(self._seen) >= MAX_REASONS:
                reason = "(many distinct errors)"
        seen = self._seen.get(reason)
        if seen is not None and now - seen.logged_s < self.interval_s:
            seen.left_out += 1
            return False
        left_out = seen.left_out if seen is not None else 0
        self.emit(reason, repeats_left_out=left_out, interval_s=self.interval_s, **fields)
        self._seen[reason] = _Seen(now)
        return True


def install(loop: asyncio.AbstractEventLoop, repeated: RepeatedLog) -> None:
    """Route the event loop's and aiohttp's own error reports through `repeated`."""

    def on_loop_error(_loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        error = context.get("exception")
        reason = str(context.get("message", "event loop error"))
        if error is not None:
            reason += f" ({type(error).__name__})"
        repeated.note(reason, error=str(error) if error is not None else None)

    loop.set_exception_handler(on_loop_error)
    handler = _ToRepeatedLog(repeated)
    for name in ("asyncio", "aiohttp"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.propagate = False  # stdlib's last-resort handler would print raw tracebacks


class _ToRepeatedLog(logging.Handler):
    def __init__(self, repeated: RepeatedLog) -> None:
        super().__init__(logging.WARNING)
        self.repeated = repeated

    def emit(self, record: logging.LogRecord) -> None:
        reason = f"{record.name}: {record.msg}"  # the format string, not its arguments
        error = record.exc_info[1] if record.exc_info else None
        if error is not None:
            reason += f" ({type(error).__name__})"
        self.repeated.note(reason, error=str(error) if error is not None else record.getMessage())

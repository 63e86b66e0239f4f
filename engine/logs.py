"""Structured logs (structlog) with the same keys everywhere: node, replica, rank, round, stream."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(level: str = "info", **bound: object) -> None:
    """One JSON object a line on stderr (readable columns on a terminal), `bound` on every line."""
    renderer = (structlog.dev.ConsoleRenderer() if sys.stderr.isatty()
                else structlog.processors.JSONRenderer())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(**bound)

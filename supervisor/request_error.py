"""A request the supervisor refuses: raised by intake and commands, never by the loop.

The app (`supervisor.app.explain`) answers it with its status and the field or line named."""

from __future__ import annotations

from typing import Any


class RequestError(Exception):
    """A request the supervisor refuses: HTTP status, message, and the field/line."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra

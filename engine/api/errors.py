"""OpenAI-style API errors: 400 for a bad request, 500 for one request that failed, 503 +
Retry-After only when the engine (or its ring) cannot serve or is busy or draining.

Rank 0 and the front door build every error here, as a JSON response or as a server-sent
event for a stream already under way, so both say the same thing the same way."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

RETRY_AFTER_S = 1


class ApiError(Exception):
    """An error the client gets as an OpenAI-style JSON body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error",
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}

    def response(self) -> web.Response:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else None
        return web.json_response(self.body(), status=self.status, headers=headers)

    def event(self) -> bytes:
        """The error as a stream's last event: its status was sent with the first token."""
        return sse_event(self.body())


def sse_event(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: a JSON object, or a bare word such as [DONE]."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """400: the request itself is wrong; sending it again will not help."""
    return ApiError(400, message, param=param, code=code)


def unavailable(message: str) -> ApiError:
    """503 + Retry-After: busy, draining or failed engine; another try (or replica) may serve."""
    return ApiError(503, message, kind="server_error", code="unavailable",
                    retry_after_s=RETRY_AFTER_S)


def request_failed(message: str) -> ApiError:
    """500: this request failed while the engine serves on; resending it would fail again."""
    return ApiError(500, message, kind="server_error", code="request_failed")

"""OpenAI-style API errors: 400 for a bad request, 500 for one request that failed, 503 +
Retry-After only when the engine (or its ring) cannot serve or is busy or draining."""

from __future__ import annotations

from typing import Any

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

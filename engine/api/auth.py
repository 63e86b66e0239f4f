"""Rank 0's API behind the front door: every request but /health must bear the replica's
secret (`Authorization: Bearer SECRET`), which only the supervisor and its front door hold.

Rank 0 binds its node's address, which `fleetctl status` prints; without this, anyone who can
reach the node could skip the front door and its API keys. A standalone engine (no
FLEET_API_SECRET_FILE) installs nothing and stays open.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

OPEN_PATHS = frozenset({"/health"})  # the supervisor's health probe carries no secret

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def bearer_token(request: web.Request) -> bytes:
    """The token of an `Authorization: Bearer ...` header, as bytes ("" when none). The
    scheme's name is case-insensitive (RFC 9110 section 11.1): `bearer KEY` is the same.
    Rank 0 and the front door both read the header here."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return b""
    # Header values arrive as str decoded from latin-1 bytes; compare the bytes so that any
    # character (non-ASCII included) is a mismatch, never an exception.
    return token.strip().encode("utf-8", "surrogateescape")


def unauthorized() -> web.Response:
    body = {"error": {"message": "this replica's API is reached through the fleet's front door "
                                 "(a request here needs the replica's secret)",
                      "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    return web.json_response(body, status=401, headers={"WWW-Authenticate": "Bearer"})


def api_secret_middlewares(secret: str) -> tuple[Callable, ...]:
    """The middleware that checks the secret, or none when there is no secret (open API)."""
    if not secret:
        return ()
    expected = secret.encode()

    @web.middleware
    async def require_api_secret(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS or hmac.compare_digest(bearer_token(request), expected):
            return await handler(request)
        return unauthorized()

    return (require_api_secret,)

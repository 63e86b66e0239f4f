"""What the fleet's two mutual-TLS APIs (an agent's, the supervisor's) share: JSON error
bodies, routes marked with the certificate roles that may call them, and the middleware that
checks the caller's certificate and turns each app's typed errors into those bodies."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from agent.pki import Identity
from agent.tls import peer_identity

PEER = web.RequestKey("peer", Identity)  # the caller's certificate, once checked
OPEN = frozenset({"open"})  # no certificate asked (a joining node has none yet)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# An app's typed errors as bodies; None: not one of its errors (it propagates).
Explain = Callable[[Exception], web.Response | None]
# A further refusal once the role is allowed (the supervisor's pinned certificates).
PeerCheck = Callable[[web.Request, Identity, frozenset[str]], str | None]


def error_body(message: str, status: int, **extra: Any) -> web.Response:
    return web.json_response({"error": {"message": message, "status": status, **extra}},
                             status=status)


def roles(*allowed: str) -> Callable[[Handler], Handler]:
    """Mark a handler with the certificate roles (their OU) that may call it."""
    def mark(handler: Handler) -> Handler:
        handler.allowed_roles = frozenset(allowed)  # type: ignore[attr-defined]
        return handler
    return mark


def authorize_and_explain(default_roles: frozenset[str], explain: Explain,
                          check_peer: PeerCheck | None = None) -> Callable:
    """The middleware: every caller of a route not marked OPEN has passed the TLS handshake
    with a fleet certificate, and the role in it must allow the route (`default_roles` for an
    unmarked one). Errors come back as JSON that names the problem."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        allowed = getattr(handler, "allowed_roles", default_roles)
        if allowed != OPEN:
            who = peer_identity(request.transport)
            if who is None:
                return error_body("a fleet client certificate is required", 401)
            if who.role not in allowed:
                return error_body(f"certificate {who.node!r} has role {who.role!r}; this "
                                  f"needs one of {', '.join(sorted(allowed))}", 403)
            refusal = check_peer(request, who, allowed) if check_peer else None
            if refusal:
                return error_body(refusal, 403)
            request[PEER] = who
        try:
            return await handler(request)
        except json.JSONDecodeError as exc:
            return error_body(f"the body is not valid JSON: {exc}", 400)
        except Exception as exc:
            reply = explain(exc)
            if reply is None:
                raise
            return reply

    return middleware

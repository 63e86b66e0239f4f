"""The supervisor's client for agent APIs (mutual TLS, the supervisor's certificate)."""

from __future__ import annotations

import ssl
from typing import Any

import aiohttp

REQUEST_TIMEOUT_S = 30.0


class AgentError(Exception):
    """An agent refused a request or could not be reached; `field` names what to fix."""

    def __init__(self, node: str, message: str, status: int = 0, field: str = "") -> None:
        where = f"agent {node}"
        super().__init__(f"{where}: {message}" + (f" (field {field})" if field else ""))
        self.node, self.message, self.status, self.field = node, message, status, field


class AgentClient:
    """One session for every agent; each call names the agent's URL."""

    def __init__(self, ssl_context: ssl.SSLContext) -> None:
        self.ssl_context = ssl_context
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=self.ssl_context),
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def call(self, node: str, method: str, url: str,
                    body: dict[str, Any] | None = None) -> dict[str, Any]:
        assert self.session is not None
        try:
            async with self.session.request(method, url, json=body) as reply:
                data = await reply.json(content_type=None)
                if reply.status >= 400:
                    error = data.get("error", {}) if isinstance(data, dict) else {}
                    raise AgentError(node, error.get("message") or str(data), reply.status,
                                     error.get("field", ""))
                return data if isinstance(data, dict) else {}
        except (aiohttp.ClientError, TimeoutError, ssl.SSLError, ValueError) as exc:
            raise AgentError(node, f"unreachable at {url}: {exc or type(exc).__name__}") from exc

    async def spawn(self, node: str, agent_url: str, request: dict[str, Any]) -> dict[str, Any]:
        """POST a spawn request (agent.spawn.SpawnRequest's dict) to the agent."""
        return await self.call(node, "POST", f"{agent_url}/v1/engines", request)

    async def drain(self, node: str, agent_url: str, engine_id: str, drain_s: float,
                    reason: str) -> dict[str, Any]:
        return await self.call(node, "POST", f"{agent_url}/v1/engines/{engine_id}/drain",
                                {"drain_s": drain_s, "reason": reason})

    async def forget(self, node: str, agent_url: str, engine_id: str) -> dict[str, Any]:
        return await self.call(node, "DELETE", f"{agent_url}/v1/engines/{engine_id}")

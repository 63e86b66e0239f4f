"""Mutual TLS: the agent refuses every caller without a fleet certificate before any handler
runs, roles limit what a fleet member may do, and `join` refuses bad tokens."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time

import aiohttp
import pytest
from aiohttp import web

import agent.app
from agent.join import join
from agent.pki import (
    FleetCA,
    JoinRequest,
    JoinToken,
    NodeCredentials,
    PkiError,
    TokenError,
    cert_pem,
    handle_join,
    make_token,
)
from tests.agent.conftest import agent_config, client, free_port, serving

REFUSED = (aiohttp.ClientError, ssl.SSLError, ConnectionError)


def test_unauthenticated_callers_are_refused_before_any_handler(fleet, tmp_path, monkeypatch):
    calls = []
    original = agent.app.authorize

    @web.middleware
    async def counting(request, handler):
        calls.append(request.path)
        return await original(request, handler)

    monkeypatch.setattr(agent.app, "authorize", counting)
    config = agent_config(fleet, tmp_path)

    async def scenario():
        async with serving(config) as url:
            for who in (None, "stranger", "expired"):
                async with client(fleet, who, timeout_s=10) as session:
                    with pytest.raises(REFUSED):
                        async with session.get(url + "/v1/health") as r:
                            await r.read()
            # Plain HTTP on the TLS port is refused too.
            async with aiohttp.ClientSession() as session:
                with pytest.raises(REFUSED):
                    async with session.get(url.replace("https", "http") + "/v1/health") as r:
                        await r.read()
            assert calls == []
            async with client(fleet, "admin") as session, session.get(
                    url + "/v1/health") as r:
                assert r.status == 200
                assert (await r.json())["peer"] == "admin"
            assert calls == ["/v1/health"]

    asyncio.run(scenario())


def test_roles_limit_what_a_fleet_member_may_do(fleet, tmp_path, tiny_model):
    config = agent_config(fleet, tmp_path)

    async def scenario():
        async with serving(config) as url, client(fleet, "node-b") as session:
            async with session.get(url + "/v1/engines") as r:
                assert r.status == 200
            async with session.post(url + "/v1/engines", json={
                    "engine_id": "e1", "env": {"FLEET_MODEL": str(tiny_model)}}) as r:
                assert r.status == 403
                assert "role 'agent'" in (await r.json())["error"]["message"]

    asyncio.run(scenario())


@contextlib.asynccontextmanager
async def fake_supervisor(fleet, records):
    """The supervisor's issuing endpoint, as agent.join expects it (the real one comes later)."""
    async def ca_route(_request):
        return web.json_response({"ca": cert_pem(fleet.ca.cert).decode()})

    async def join_route(request):
        try:
            body, _used = handle_join(fleet.ca, records, JoinRequest.from_dict(
                await request.json()), time.time())
        except PkiError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=403)
        return web.json_response(body)

    app = web.Application()
    app.router.add_get("/v1/pki/ca", ca_route)
    app.router.add_post("/v1/pki/join", join_route)
    creds = fleet.creds("super")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(creds.cert_path), str(creds.key_path))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=ctx).start()
    try:
        yield f"https://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def test_join_pins_the_ca_and_refuses_bad_tokens(fleet, tmp_path):
    token, record = make_token(fleet.ca, ttl_s=300, node="mac")
    foreign, _ = make_token(FleetCA.create("elsewhere"), node="mac")
    unknown = JoinToken(fleet.ca.fingerprint, b"x" * 32)
    creds = NodeCredentials(tmp_path / "pki")

    async def scenario():
        async with fake_supervisor(fleet, [record]) as url:
            with pytest.raises(TokenError, match="looks like"):
                await join(url, "not-a-token", creds, "mac")
            with pytest.raises(TokenError, match="the token pins"):
                await join(url, str(foreign), creds, "mac")
            with pytest.raises(TokenError, match="refused the join.*not known"):
                await join(url, str(unknown), creds, "mac")
            assert not creds.exist()
            who = await join(url, str(token), creds, "mac", hosts=("127.0.0.1",))
            assert (who.node, who.role) == ("mac", "agent")
        assert creds.check().node == "mac"
        # The agent now serves with what it was given, and fleet members can reach it.
        config = agent_config(fleet, tmp_path / "state", node="node-a")
        for path in (creds.ca_path, creds.cert_path, creds.key_path):
            (config.pki_dir / path.name).write_bytes(path.read_bytes())
        async with serving(config) as url, client(fleet, "admin") as session, session.get(
                url + "/v1/health") as r:
            assert (await r.json())["node"] == "node-a"

    asyncio.run(scenario())


def test_agent_will_not_start_without_credentials(tmp_path):
    from agent.config import AgentConfig
    from agent.pki import MissingCredentials

    with pytest.raises(MissingCredentials, match="fleet-agent join"):
        agent.app.make_app(AgentConfig(node="x", state_dir=tmp_path))

"""The supervisor's API served in-process with mutual TLS: who may call what, joining, the
certificate pinned at a join, revocation, and tokens bound to a node with a sane lifetime."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import aiohttp
from aiohttp import web

from agent.pki import FleetCA, NodeCredentials, cert_pem, key_pem, make_csr, new_key
from engine.harness.launch import free_port
from supervisor.app import make_app
from supervisor.issuing import init_pki
from supervisor.main import server_context
from supervisor.settings import SupervisorSettings


def client_ssl(creds: NodeCredentials | None, ca_path: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca_path))
    ctx.check_hostname = False
    if creds is not None:
        ctx.load_cert_chain(str(creds.cert_path), str(creds.key_path))
    return ctx


def test_roles_names_and_joining(tmp_path: Path):
    state_dir, ctl = tmp_path / "sup", tmp_path / "ctl"
    port = free_port()
    init_pki(state_dir, f"127.0.0.1:{port}", ctl)
    ca = FleetCA.load(state_dir / "pki")
    settings = SupervisorSettings(state_dir=state_dir, listen=f"127.0.0.1:{port}",
                                  front_door=f"127.0.0.1:{free_port()}",
                                  calibration_budget_s=0)
    ca_path = state_dir / "pki" / "ca.pem"
    base = f"https://127.0.0.1:{port}"

    async def call(creds, method, path, body=None) -> tuple[int, dict]:
        connector = aiohttp.TCPConnector(ssl=client_ssl(creds, ca_path))
        async with aiohttp.ClientSession(connector=connector) as session, \
                session.request(method, base + path, json=body) as reply:
            return reply.status, await reply.json(content_type=None)

    async def join_as(admin: NodeCredentials, node: str, where: str) -> NodeCredentials:
        _, token = await call(admin, "POST", "/v1/tokens", {"node": node})
        key = new_key()
        status, body = await call(None, "POST", "/v1/pki/join", {
            "node": node, "token_secret": token["token"].split(".")[2],
            "csr": make_csr(key, node).decode()})
        assert status == 200, body
        creds = NodeCredentials(tmp_path / where)
        creds.store(cert_pem(ca.cert), body["certificate"].encode(), key_pem(key))
        return creds

    async def tokens_name_a_node_and_live_a_sane_time(admin: NodeCredentials) -> None:
        status, body = await call(admin, "POST", "/v1/tokens", {})
        assert status == 400 and body["error"]["field"] == "node"
        assert "names the one node" in body["error"]["message"]
        status, body = await call(admin, "POST", "/v1/tokens", {"node": "a/b"})
        assert status == 400 and body["error"]["field"] == "node"
        for ttl in (float("nan"), float("inf"), -5, 0, "nan", None):
            status, body = await call(admin, "POST", "/v1/tokens", {"node": "n", "ttl_s": ttl})
            assert status == 400 and body["error"]["field"] == "ttl_s", (ttl, body)
        assert (await call(admin, "POST", "/v1/tokens", {"node": "n", "ttl_s": 60}))[0] == 200

    async def a_member_is_pinned_and_joins_again_only_once_revoked(
            admin: NodeCredentials, agent: NodeCredentials) -> None:
        beat = {"url": "https://127.0.0.1:1", "engines": []}
        # Another certificate with the member's name (what a token for any name gave before):
        # signed by the fleet CA, refused because it is not the one pinned at the join.
        key, cert = ca.issue_credentials("node-a", "agent")
        twin = NodeCredentials(tmp_path / "twin")
        twin.store(cert_pem(ca.cert), cert, key)
        for path in ("heartbeat", "events", "goodbye"):
            status, body = await call(twin, "POST", f"/v1/nodes/node-a/{path}", beat)
            assert status == 403 and "not the one pinned" in body["error"]["message"], body
        # A name nobody joined as: refused even with a fleet certificate.
        key, cert = ca.issue_credentials("node-z", "agent")
        stranger = NodeCredentials(tmp_path / "stranger")
        stranger.store(cert_pem(ca.cert), cert, key)
        status, body = await call(stranger, "POST", "/v1/nodes/node-z/heartbeat", beat)
        assert status == 403 and "has not joined" in body["error"]["message"]
        # A second join as a member is refused, and the token survives for after the revoke.
        _, token = await call(admin, "POST", "/v1/tokens", {"node": "node-a"})
        again = {"node": "node-a", "token_secret": token["token"].split(".")[2],
                 "csr": make_csr(new_key(), "node-a").decode()}
        status, body = await call(None, "POST", "/v1/pki/join", again)
        assert status == 409 and "fleetctl revoke node-a" in body["error"]["message"]
        assert (await call(agent, "POST", "/v1/nodes/node-a/heartbeat", beat))[0] == 200
        assert (await call(agent, "POST", "/v1/nodes/node-a/revoke", {}))[0] == 403
        status, body = await call(admin, "POST", "/v1/nodes/nope/revoke", {})
        assert status == 404
        status, body = await call(admin, "POST", "/v1/nodes/node-a/revoke", {})
        assert status == 200 and body["revoked_certificate"]
        status, body = await call(agent, "POST", "/v1/nodes/node-a/heartbeat", beat)
        assert status == 403 and "revoked" in body["error"]["message"]
        status, body = await call(admin, "GET", "/v1/status")
        assert "node-a" not in [m["node"] for m in body["members"]]
        status, body = await call(None, "POST", "/v1/pki/join", again)
        assert status == 200, body
        status, body = await call(agent, "POST", "/v1/nodes/node-a/heartbeat", beat)
        assert status == 403  # the old certificate stays refused after the new join

    async def check() -> None:
        runner = web.AppRunner(make_app(settings))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, ssl_context=server_context(settings)).start()
        admin = NodeCredentials(ctl)
        beat = {"url": "https://127.0.0.1:1", "engines": []}
        try:
            agent = await join_as(admin, "node-a", "node-a")
            status, body = await call(agent, "POST", "/v1/nodes/node-a/heartbeat", beat)
            assert status == 200 and body == {"want_facts": True}
            status, body = await call(agent, "POST", "/v1/nodes/node-b/heartbeat", beat)
            assert status == 403 and "may not report for node 'node-b'" in body["error"]["message"]
            status, body = await call(agent, "POST", "/v1/nodes/node-a/heartbeat", {})
            assert status == 400 and body["error"]["field"] == "url"
            assert (await call(agent, "GET", "/v1/status"))[0] == 403
            assert (await call(None, "GET", "/v1/status"))[0] == 401
            status, body = await call(admin, "GET", "/v1/status")
            assert status == 200 and [m["node"] for m in body["members"]] == ["node-a"]
            status, body = await call(admin, "POST", "/v1/nodes/nope/drain", {})
            assert status == 404 and "unknown node 'nope'" in body["error"]["message"]
            status, body = await call(admin, "POST", "/v1/apply",
                                      {"text": "version: 2\n", "source": "f.yaml"})
            assert status == 422 and body["error"]["message"].startswith("f.yaml:1: supervisor")
            assert body["error"]["line"] == 1 and body["error"]["field"] == "supervisor"
            # Joining: no certificate needed, a token is; a token is good once.
            status, body = await call(None, "GET", "/v1/pki/ca")
            assert status == 200 and body["fingerprint"] == ca.fingerprint
            _, token = await call(admin, "POST", "/v1/tokens", {"node": "node-c"})
            secret = token["token"].split(".")[2]
            join = {"node": "node-c", "token_secret": secret,
                    "csr": make_csr(new_key(), "node-c").decode()}
            status, body = await call(None, "POST", "/v1/pki/join", join)
            assert status == 200 and "BEGIN CERTIFICATE" in body["certificate"]
            status, body = await call(None, "POST", "/v1/pki/join", join)
            assert status == 403 and "not known" in body["error"]["message"]
            await tokens_name_a_node_and_live_a_sane_time(admin)
            await a_member_is_pinned_and_joins_again_only_once_revoked(admin, agent)
        finally:
            await runner.cleanup()

    asyncio.run(check())

"""The supervisor's API served in-process with mutual TLS: who may call what, and joining."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import aiohttp
from aiohttp import web

from agent.pki import FleetCA, NodeCredentials, cert_pem, make_csr, new_key
from engine.launch import free_port
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
    key, cert = ca.issue_credentials("node-a", "agent")
    agent = NodeCredentials(tmp_path / "node-a")
    agent.store(cert_pem(ca.cert), cert, key)
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

    async def check() -> None:
        runner = web.AppRunner(make_app(settings))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, ssl_context=server_context(settings)).start()
        admin = NodeCredentials(ctl)
        beat = {"url": "https://127.0.0.1:1", "engines": []}
        try:
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
        finally:
            await runner.cleanup()

    asyncio.run(check())

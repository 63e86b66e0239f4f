"""Heartbeats: alive every interval, facts when they change, engine events at once, goodbye
on a graceful stop; an unreachable supervisor does not stop the agent."""

from __future__ import annotations

import asyncio
import contextlib
import ssl

from aiohttp import web

from agent.app import HEARTBEAT
from agent.facts import collect_facts
from agent.heartbeat import BeatMemory, after_reply, build_heartbeat
from tests.agent.conftest import (
    agent_config,
    client,
    fake_engine_command,
    free_port,
    serving,
    serving_app,
    wait_state,
)
from tests.waiting import wait_until_async


def test_build_heartbeat_sends_facts_only_when_they_change():
    facts = collect_facts("n", 1 << 30, 1 << 30, probed=[])
    body, digest = build_heartbeat("n", "https://n:7700", BeatMemory(), facts, (), 1.0)
    assert body["facts"]["host"]["node"] == "n" and body["seq"] == 1
    memory = after_reply(BeatMemory(), digest, {})
    body, _ = build_heartbeat("n", "https://n:7700", memory, facts, (), 2.0)
    assert "facts" not in body and body["facts_digest"] == digest and body["seq"] == 2
    assert after_reply(memory, digest, {"want_facts": True}).facts_digest is None
    assert after_reply(memory, digest, None).facts_digest is None  # not delivered: send again


@contextlib.asynccontextmanager
async def fake_supervisor(fleet, want_facts_once: bool = True):
    got: dict[str, list] = {"heartbeat": [], "events": [], "goodbye": []}
    asked = []

    async def record(request):
        kind = request.match_info["kind"]
        assert request.match_info["node"] == "node-a"
        got[kind].append(await request.json())
        if kind == "heartbeat" and want_facts_once and len(got["heartbeat"]) == 3:
            asked.append(True)
            return web.json_response({"want_facts": True})
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/nodes/{node}/{kind}", record)
    creds = fleet.creds("super")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(creds.ca_path))
    ctx.load_cert_chain(str(creds.cert_path), str(creds.key_path))
    ctx.verify_mode = ssl.CERT_REQUIRED  # the agent must prove itself to the supervisor too
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=ctx).start()
    try:
        yield f"https://127.0.0.1:{port}", got
    finally:
        await runner.cleanup()


def test_heartbeats_events_and_goodbye(fleet, tmp_path, tiny_model):
    async def scenario():
        async with fake_supervisor(fleet) as (sup_url, got):
            config = agent_config(fleet, tmp_path, supervisor_url=sup_url,
                                  engine_command=fake_engine_command())
            async with serving(config) as url, client(fleet) as session:
                await wait_until_async(lambda: len(got["heartbeat"]) >= 6, within_s=30,
                                       what="six heartbeats")
                beats = got["heartbeat"]
                assert [b["seq"] for b in beats[:6]] == [1, 2, 3, 4, 5, 6]
                assert "facts" in beats[0] and beats[0]["url"] == url
                assert any("facts" not in b for b in beats[1:3])  # unchanged: not resent
                assert "facts" in beats[3]  # the supervisor asked for them
                async with session.post(url + "/v1/engines", json={
                        "engine_id": "hb", "env": {"FLEET_MODEL": str(tiny_model),
                                                   "FLEET_HTTP": f"127.0.0.1:{free_port()}"}}) as r:
                    assert r.status == 201
                await wait_state(session, url, "hb", {"ready"}, 30)
                await wait_until_async(lambda: len(got["events"]) >= 2, within_s=5,
                                       what="the engine's events sent")
                states = [e["state"] for batch in got["events"] for e in batch["events"]]
                assert states[:2] == ["starting", "ready"]
            # A graceful stop: the engine drains (reported), then the goodbye.
            states = [e["state"] for batch in got["events"] for e in batch["events"]]
            assert states == ["starting", "ready", "draining", "exited"]
            assert got["goodbye"] == [{"node": "node-a", "reason": "the agent is stopping"}]
            last = got["heartbeat"][-1]
            assert last["engines"] and last["engines"][0]["engine_id"] == "hb"

    asyncio.run(scenario())


def test_an_unreachable_supervisor_does_not_stop_the_agent(fleet, tmp_path):
    config = agent_config(fleet, tmp_path, supervisor_url=f"https://127.0.0.1:{free_port()}")

    async def scenario():
        async with serving_app(config) as (url, app), client(fleet) as session:
            heartbeat = app[HEARTBEAT]
            await wait_until_async(lambda: heartbeat.failures >= 3, within_s=30,
                                   what="three heartbeats tried and failed")
            async with session.get(url + "/v1/health") as r:
                assert r.status == 200

    asyncio.run(scenario())

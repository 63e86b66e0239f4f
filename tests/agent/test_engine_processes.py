"""Real `fleet-engine` processes under the agent: spawn, ready, drain with a stream in flight
(the stream completes; new requests get 503), death at start, and after an agent restart,
adoption of the engines it started, then a graceful stop that drains them: no orphans."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import time
from pathlib import Path

import aiohttp

from tests.agent.conftest import (
    AgentProcess,
    agent_config,
    client,
    free_port,
    pid_alive,
    read_records,
    serving,
    wait_state,
)
from tests.waiting import log_has_event, wait_until_async

STREAM_TOKENS = 1000  # long enough to be in flight through the drain


async def stream_completion(http: str, started: asyncio.Event,
                            tokens_wanted: int = STREAM_TOKENS) -> dict:
    """A streamed completion; sets `started` at its first token; returns what it saw."""
    body = {"model": "tiny", "prompt": "hello", "max_tokens": tokens_wanted, "stream": True,
            "ignore_eos": True, "stop": [], "stream_options": {"include_usage": True}}
    tokens, finish, done = None, None, False
    async with (aiohttp.ClientSession() as session,
                session.post(f"http://{http}/v1/completions", json=body) as r):
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event["choices"]:
                finish = event["choices"][0].get("finish_reason") or finish
            started.set()
            await asyncio.sleep(0.01)  # a slow reader: the stream stays in flight
    return {"tokens": tokens, "finish_reason": finish, "done": done}


def test_spawn_ready_and_drain_with_a_stream_in_flight(fleet, tmp_path, tiny_model):
    config = agent_config(fleet, tmp_path)
    http = f"127.0.0.1:{free_port()}"

    async def scenario():
        async with serving(config) as url, client(fleet) as session:
            async with session.post(url + "/v1/engines", json={
                    "engine_id": "r0", "env": {
                        "FLEET_MODEL": str(tiny_model), "FLEET_HTTP": http,
                        "FLEET_MODEL_ID": "tiny", "FLEET_DRAIN_S": "60"}}) as r:
                assert r.status == 201, await r.text()
            view = await wait_state(session, url, "r0", {"ready", "exited"}, 120)
            assert view["state"] == "ready", view
            async with aiohttp.ClientSession() as plain, plain.get(f"http://{http}/health") as r:
                assert r.status == 200
            started = asyncio.Event()
            stream = asyncio.create_task(stream_completion(http, started))
            await asyncio.wait_for(started.wait(), 60)
            async with session.post(url + "/v1/engines/r0/drain", json={}) as r:
                assert r.status == 202
            # The engine has taken the SIGTERM: it logs "draining" as it stops admitting.
            engine_log = Path(view["log_path"])
            await wait_until_async(lambda: asyncio.to_thread(log_has_event, engine_log,
                                                             "draining"),
                                   within_s=30, what="the engine logging that it drains")
            async with aiohttp.ClientSession() as plain, plain.post(
                    f"http://{http}/v1/completions",
                    json={"model": "tiny", "prompt": "late", "max_tokens": 2, "stop": []}) as r:
                assert r.status == 503  # draining: no new requests
                assert r.headers.get("Retry-After")
            # /health says so: draining (not failed), the stream in flight, the time left.
            async with aiohttp.ClientSession() as plain, plain.get(f"http://{http}/health") as r:
                health = await r.json()
                assert r.status == 503 and r.headers.get("Retry-After"), health
            assert health["status"] == "draining" and health["in_flight"] == 1, health
            assert 0 < health["drain_seconds_left"] <= 60, health
            seen = await asyncio.wait_for(stream, 120)
            assert seen == {"tokens": STREAM_TOKENS, "finish_reason": "length", "done": True}
            view = await wait_state(session, url, "r0", {"exited"}, 60)
            assert (view["exit"]["code"], view["exit"]["reason"]) == (0, "drained"), view
            assert not pid_alive(view["pid"])
            assert read_records(config) == []

    asyncio.run(scenario())


def test_an_engine_that_dies_at_start_is_reported_and_the_agent_carries_on(fleet, tmp_path,
                                                                          tiny_model):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a truncated download
    config = agent_config(fleet, tmp_path / "state")

    async def scenario():
        async with serving(config) as url, client(fleet) as session:
            async with session.post(url + "/v1/engines", json={
                    "engine_id": "bad", "env": {"FLEET_MODEL": str(broken),
                                                "FLEET_HTTP": f"127.0.0.1:{free_port()}"}}) as r:
                assert r.status == 201
            view = await wait_state(session, url, "bad", {"exited", "ready"}, 60)
            assert view["state"] == "exited"
            assert view["exit"]["code"] not in (0, None)
            assert "header" in view["exit"]["reason"]  # the engine's own words on why
            async with session.get(url + "/v1/health") as r:
                assert r.status == 200

    asyncio.run(scenario())


def test_a_restarted_agent_adopts_its_engines_and_drains_them_on_stop(fleet, tmp_path,
                                                                     tiny_model):
    config = agent_config(fleet, tmp_path / "state", drain_s=30.0)
    http = f"127.0.0.1:{free_port()}"

    async def scenario():
        first = AgentProcess(config, tmp_path / "agent1.log")
        try:
            await first.wait_up(fleet)
            async with client(fleet) as session:
                async with session.post(first.url + "/v1/engines", json={
                        "engine_id": "kept", "env": {"FLEET_MODEL": str(tiny_model),
                                                     "FLEET_HTTP": http,
                                                     "FLEET_MODEL_ID": "tiny"}}) as r:
                    assert r.status == 201, await r.text()
                view = await wait_state(session, first.url, "kept", {"ready", "exited"}, 120)
                assert view["state"] == "ready", view
            first.signal(signal.SIGKILL)  # a crash: no drain, no goodbye
            first.wait(10)
        finally:
            first.stop()
        engine_pid = view["pid"]
        assert pid_alive(engine_pid)  # its own process group: the crash did not take it
        assert [r["spec"]["engine_id"] for r in read_records(config)] == ["kept"]

        second = AgentProcess(config, tmp_path / "agent2.log")
        try:
            await second.wait_up(fleet)
            async with client(fleet) as session:
                view = await wait_state(session, second.url, "kept", {"ready"}, 30)
                assert view["adopted"] and view["pid"] == engine_pid
                async with aiohttp.ClientSession() as plain, plain.post(
                        f"http://{http}/v1/completions", json={
                            "model": "tiny", "prompt": "still here", "max_tokens": 3,
                            "stop": []}) as r:
                    assert r.status == 200  # it kept serving through the restart
            # A second agent on the same state directory, or on a port in use, refuses to
            # start and touches nothing.
            from dataclasses import replace

            for other, words in ((replace(config, listen_port=free_port()), "another agent"),
                                 (replace(config, state_dir=tmp_path / "other"), "cannot serve")):
                (other.state_dir / "pki").mkdir(parents=True, exist_ok=True)
                for name in ("ca.pem", "node.pem", "node.key"):
                    (other.pki_dir / name).write_bytes((config.pki_dir / name).read_bytes())
                intruder = AgentProcess(other, tmp_path / f"intruder-{words[:5]}.log")
                try:
                    assert intruder.wait(60) == 1
                finally:
                    intruder.stop()
                assert words in (tmp_path / f"intruder-{words[:5]}.log").read_text()
            assert pid_alive(engine_pid)
            started = time.monotonic()
            second.signal(signal.SIGTERM)  # a graceful stop drains the engines it runs
            assert second.wait(60) == 0
            assert time.monotonic() - started < 30
        finally:
            second.stop()
        assert not pid_alive(engine_pid)
        assert read_records(config) == []
        log = (tmp_path / "agent2.log").read_text()
        assert '"engine adopted"' in log or "child adopted" in log
        assert '"reason": "drained"' in log

    asyncio.run(scenario())

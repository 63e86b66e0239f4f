"""The issue's bar, end to end: an agent in each of two processes on this machine reports
true facts and calibration, probes the other, runs and drains engines (one PyTorch, one
MLX) without losing a request or leaving an orphan, and refuses every unauthenticated caller."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import pytest

from agent.calibrate import Calibration
from tests.agent.conftest import (
    AgentProcess,
    agent_config,
    client,
    free_port,
    pid_alive,
    read_records,
    wait_state,
)
from tests.agent.test_calibrate import LONG, SHAPE, SHORT, B, check_ordered, finished_job
from tests.agent.test_engine_processes import stream_completion
from tests.agent.test_facts import check_against_this_machine

REFUSED = (aiohttp.ClientError, ConnectionError)
STREAM_TOKENS = 300


async def calibrated(session, url: str, backend: str) -> Calibration:
    body = dict(config=SHAPE, backend=backend, contexts=[SHORT, LONG], batch_rows=B,
                chunk_rows=128, runs=3, warmup=1, budget_s=8.0, threads=1)
    async with session.post(url + "/v1/calibrations", json=body) as r:
        job = await r.json()
    job = await finished_job(session, url, job)
    assert job["state"] == "done", job
    return Calibration.from_dict(job["result"])


async def requests_then_drain(session, url: str, engine_id: str, http: str) -> list[dict]:
    """Short requests and one long stream in flight, then a drain: every one must finish."""
    started = asyncio.Event()
    stream = asyncio.create_task(stream_completion(http, started, STREAM_TOKENS))
    await asyncio.wait_for(started.wait(), 60)

    async def short(i: int) -> int:
        async with aiohttp.ClientSession() as plain, plain.post(
                f"http://{http}/v1/completions", json={"model": "tiny", "prompt": f"n{i}",
                                                       "max_tokens": 4, "stop": []}) as r:
            await r.read()
            return r.status

    assert await asyncio.gather(*(short(i) for i in range(4))) == [200] * 4
    async with session.post(f"{url}/v1/engines/{engine_id}/drain", json={}) as r:
        assert r.status == 202
    return [await asyncio.wait_for(stream, 120)]


def test_two_agents_on_one_machine(fleet, tmp_path, tiny_model):
    a = agent_config(fleet, tmp_path / "a", node="node-a", drain_s=60.0)
    b = agent_config(fleet, tmp_path / "b", node="node-b", drain_s=60.0)

    async def scenario():
        agents = [AgentProcess(a, tmp_path / "a.log"), AgentProcess(b, tmp_path / "b.log")]
        try:
            for agent in agents:
                await agent.wait_up(fleet)
            url_a, url_b = (agent.url for agent in agents)
            for url in (url_a, url_b):
                for who in (None, "stranger", "expired"):
                    async with client(fleet, who, timeout_s=10) as session:
                        with pytest.raises(REFUSED):
                            async with session.get(url + "/v1/engines") as r:
                                await r.read()
            async with client(fleet) as session:
                for url, node in ((url_a, "node-a"), (url_b, "node-b")):
                    async with session.get(url + "/v1/facts?refresh=backends") as r:
                        facts = (await r.json())["facts"]
                    check_against_this_machine(facts)
                    assert facts["host"]["node"] == node
                check_ordered(await calibrated(session, url_a, "torch-cpu"))
                check_ordered(await calibrated(session, url_b, "mlx-cpu"))
                async with session.post(url_a + "/v1/probe", json={
                        "peer": url_b, "bytes": 2 << 20, "pings": 5}) as r:
                    link = await r.json()
                assert link["rtt_ms"] > 0 and link["bandwidth_bytes_per_s"] > 0
                engines = {}
                for url, backend in ((url_a, "torch-cpu"), (url_b, "mlx-cpu")):
                    http = f"127.0.0.1:{free_port()}"
                    async with session.post(url + "/v1/engines", json={
                            "engine_id": f"tiny-{backend}", "env": {
                                "FLEET_MODEL": str(tiny_model), "FLEET_BACKEND": backend,
                                "FLEET_HTTP": http, "FLEET_MODEL_ID": "tiny"}}) as r:
                        assert r.status == 201, await r.text()
                    engines[url] = (f"tiny-{backend}", http)
                pids = []
                for url, (engine_id, _http) in engines.items():
                    view = await wait_state(session, url, engine_id, {"ready", "exited"}, 120)
                    assert view["state"] == "ready", view
                    pids.append(view["pid"])
                streams = await asyncio.gather(*(requests_then_drain(session, url, eid, http)
                                                 for url, (eid, http) in engines.items()))
                for seen in streams:
                    assert seen == [{"tokens": STREAM_TOKENS, "finish_reason": "length",
                                     "done": True}]
                for url, (engine_id, _http) in engines.items():
                    view = await wait_state(session, url, engine_id, {"exited"}, 60)
                    assert (view["exit"]["code"], view["exit"]["reason"]) == (0, "drained")
            for agent in agents:
                agent.signal(signal.SIGTERM)
            assert [agent.wait(30) for agent in agents] == [0, 0]
        finally:
            for agent in agents:
                agent.stop()
        assert not any(pid_alive(pid) for pid in pids)
        assert read_records(a) == read_records(b) == []

    asyncio.run(scenario())

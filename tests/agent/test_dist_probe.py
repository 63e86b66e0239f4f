"""The link probe over torch.distributed between two agents (gloo on loopback, as CI runs
it; NCCL between CUDA nodes takes the same steps): measured beside the TCP probe, a path
that cannot form reported beside it too, and every child process bounded in time."""

from __future__ import annotations

import asyncio
import time

import pytest

from agent import dist_probe
from agent.probe import ProbeError
from supervisor.agents import AgentClient
from supervisor.measurements import probe
from tests.agent.conftest import agent_config, client, serving

pytestmark = pytest.mark.timeout(120)


def test_one_agent_probes_another_over_gloo_beside_tcp(fleet, tmp_path):
    a = agent_config(fleet, tmp_path / "a", node="node-a", probe_max_s=60.0)
    b = agent_config(fleet, tmp_path / "b", node="node-b", probe_max_s=60.0)

    async def scenario():
        async with serving(a) as url_a, serving(b) as url_b, client(fleet) as session:
            async with session.post(url_a + "/v1/probe", json={
                    "peer": url_b, "bytes": 4 << 20, "pings": 5, "dist": "gloo"}) as r:
                assert r.status == 200, await r.text()
                result = await r.json()
            assert result["transport"] == "tcp" and result["bytes"] == 4 << 20
            dist = result["dist"]
            assert "error" not in dist, dist
            assert dist["transport"] == "gloo" and dist["pings"] == 5
            assert dist["row_bytes"] == dist_probe.ROW_BYTES and dist["bytes"] == 4 << 20
            assert 0 < dist["rtt_min_ms"] <= dist["rtt_ms"] < 1000
            assert dist["bandwidth_bytes_per_s"] > 1e6
            # A path that cannot form (no NCCL without CUDA) is said beside the TCP numbers.
            async with session.post(url_a + "/v1/probe", json={
                    "peer": url_b, "bytes": 1 << 20, "pings": 2, "dist": "nccl"}) as r:
                assert r.status == 200, await r.text()
                failed = await r.json()
            assert failed["bandwidth_bytes_per_s"] > 0
            assert failed["dist"]["transport"] == "nccl" and failed["dist"]["error"]
            async with session.post(url_a + "/v1/probe", json={
                    "peer": url_b, "dist": "mpi"}) as r:
                assert r.status == 422
                assert "expected one of gloo, nccl" in (await r.json())["error"]["message"]
        # The supervisor's own call reads the path into the link placement costs hops by.
        async with serving(a) as url_a, serving(b) as url_b:
            agents = AgentClient(fleet.client_ssl("super"))
            await agents.start()
            try:
                link, why = await probe(agents, "node-a", url_a, "node-b", url_b, "gloo")
            finally:
                await agents.close()
            assert why == "" and link.peer == "node-b" and link.dist_transport == "gloo"
            assert link.dist_rtt_ms > 0 and link.dist_bandwidth_bytes_per_s > 1e6
            assert link.path("gloo") == (link.dist_rtt_ms, link.dist_bandwidth_bytes_per_s)

    asyncio.run(scenario())


def test_a_listening_child_nobody_joins_ends_at_its_deadline():
    async def scenario():
        child, offer = await dist_probe.serve(dist_probe.request(
            "serve", "gloo", host="127.0.0.1", pings=2, row_bytes=64, bytes_=1024, max_s=4.0))
        assert offer["backend"] == "gloo" and len(offer["token"]) == 32 and offer["port"] > 0
        started = time.monotonic()
        await child.reap()
        assert child.proc.returncode is not None and time.monotonic() - started < 10

    asyncio.run(scenario())


def test_a_wrong_token_does_not_join_the_group():
    async def scenario():
        child, offer = await dist_probe.serve(dist_probe.request(
            "serve", "gloo", host="127.0.0.1", pings=2, row_bytes=64, bytes_=1024, max_s=6.0))
        try:
            with pytest.raises(ProbeError, match="torch.distributed probe"):
                await dist_probe.measure(dict(offer, token="0" * 32), max_s=5.0)
        finally:
            await child.stop()

    asyncio.run(scenario())

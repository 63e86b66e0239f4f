"""Link probe between two agents: RTT and bandwidth over TCP on a stage port, authenticated
with a one-time ticket, bounded in bytes and time."""

from __future__ import annotations

import asyncio
import socket

import pytest

from agent.probe import ProbeError, ProbeTicket, open_listener, run_probe
from tests.agent.conftest import agent_config, client, serving


def test_one_agent_probes_another(fleet, tmp_path):
    a = agent_config(fleet, tmp_path / "a", node="node-a")
    b = agent_config(fleet, tmp_path / "b", node="node-b")

    async def scenario():
        busy = socket.socket()
        busy.bind(("127.0.0.1", b.stage_port_first))  # the first stage port is taken
        busy.listen()
        async with serving(a) as url_a, serving(b) as url_b, client(fleet) as session:
            async with session.post(url_a + "/v1/probe", json={
                    "peer": url_b, "bytes": 4 << 20, "pings": 5}) as r:
                assert r.status == 200, await r.text()
                result = await r.json()
            assert result["peer"] == url_b and result["pings"] == 5
            assert result["bytes"] == 4 << 20
            assert 0 < result["rtt_min_ms"] <= result["rtt_ms"] < 1000
            assert result["bandwidth_bytes_per_s"] > 1e6
            assert b.stage_port_first < result["port"] <= b.stage_port_last
            # Asking for more than the peer allows gets the peer's cap.
            async with session.post(url_a + "/v1/probe", json={
                    "peer": url_b, "bytes": 1 << 40, "pings": 1}) as r:
                assert (await r.json())["bytes"] == b.probe_max_bytes
            async with session.post(url_a + "/v1/probe", json={"peer": "http://x"}) as r:
                assert r.status == 422
            async with session.post(url_a + "/v1/probe", json={
                    "peer": "https://127.0.0.1:9"}) as r:
                assert r.status == 422
                assert "cannot reach peer agent" in (await r.json())["error"]["message"]
        async with serving(a) as url_a, serving(b) as url_b, client(fleet, "node-b") as session:
            async with session.post(url_b + "/v1/probe/listen", json={"bytes": 1024}) as r:
                assert r.status == 200  # a fleet member may ask for a ticket
            async with session.post(url_a + "/v1/probe", json={"peer": url_b}) as r:
                assert r.status == 403  # but only the supervisor may make an agent probe
        busy.close()

    asyncio.run(scenario())


def test_a_ticket_is_needed_and_good_once():
    async def scenario():
        listener, ticket = await open_listener("127.0.0.1", range(29750, 29790), 1 << 20, 5.0)
        forged = ProbeTicket(ticket.host, ticket.port, "00" * 32, ticket.max_bytes, 5.0)
        with pytest.raises(ProbeError, match="refused the probe's proof"):
            await run_probe(forged, bytes_=1024, max_s=5)
        with pytest.raises(ProbeError):  # one session per ticket, even a failed one
            await run_probe(ticket, bytes_=1024, max_s=2)
        await listener.close()
        listener, ticket = await open_listener("127.0.0.1", range(29750, 29790), 1 << 20, 5.0)
        result = await run_probe(ticket, bytes_=1 << 30, pings=3, max_s=5)
        assert result.bytes == 1 << 20  # capped by the ticket
        await listener.close()
        with pytest.raises(ProbeError, match="wildcard"):
            await open_listener("0.0.0.0", range(29750, 29790), 1024, 1.0)

    asyncio.run(scenario())


def test_a_listener_closes_at_its_deadline():
    async def scenario():
        listener, ticket = await open_listener("127.0.0.1", range(29750, 29790), 1024, 0.3)
        await asyncio.wait_for(listener.done.wait(), 5)
        with pytest.raises(ProbeError):
            await run_probe(ticket, max_s=2)

    asyncio.run(scenario())

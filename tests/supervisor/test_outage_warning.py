"""Where there is no room to make before break, the supervisor's replies to drain, apply
(and its dry run, plan) and rebalance carry the outage the change would cause, and fleetctl
prints it as a warning with the reason and the longest it can last; with room, nothing."""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import replace

from supervisor import lifecycle as lc
from supervisor import operator_commands as commands
from supervisor.agents import AgentClient
from supervisor.control_loop import Supervisor
from supervisor.fleetctl import warn_outages
from supervisor.settings import SupervisorSettings
from tests.supervisor.test_lifecycle import (
    FLEET,
    RANK0_BYTES,
    RANK1_BYTES,
    SHAPE,
    both,
    member,
    started,
)


def supervisor_with(tmp_path, memory_bytes: int) -> Supervisor:
    settings = SupervisorSettings(state_dir=tmp_path, calibration_budget_s=0,
                                  policy=lc.Policy(drain_s=30.0))
    supervisor = Supervisor(settings, AgentClient(ssl.create_default_context()))
    # parses; changes nothing
    commands.apply_desired(supervisor, FLEET % 2, "fleet.yaml", dry_run=True)
    supervisor.desired = commands.parse(FLEET % 2, "fleet.yaml")
    supervisor.shapes = {"demo": SHAPE}
    engines = both(("ready", "ready"))
    supervisor.members = {n: replace(member(n, memory_bytes=memory_bytes),
                                     engines=m.engines, url="https://127.0.0.1:9",
                                     last_heartbeat_at=time.time())
                          for n, m in engines.items()}
    serving = replace(started(lc.SERVING), load_s=12.0)
    supervisor.replicas = {serving.id: serving}
    return supervisor


def test_a_drain_with_no_room_is_announced_with_its_reason_and_bound(tmp_path, capsys):
    async def check() -> None:
        supervisor = supervisor_with(tmp_path, memory_bytes=RANK0_BYTES + RANK1_BYTES + 10)
        try:
            plan = commands.apply_desired(supervisor, FLEET % 3, "fleet.yaml", dry_run=True)
            [outage] = plan["outages"]
            assert outage["model_id"] == "demo" and outage["max_s"] == 30.0 + 600.0
            reply = commands.drain_node(supervisor, "b")
            [outage] = reply["outages"]
            assert "node b is being drained" in outage["reason"]
            assert "no room for its successor beside it" in outage["reason"]
            warn_outages(reply)
        finally:
            await supervisor.close()

    asyncio.run(check())
    printed = " ".join(capsys.readouterr().err.split())
    assert "warning: serving of demo will stop: demo-g1 drains before its successor" in printed
    assert "for at most 630 s (drain up to 30 s, then start up to 600 s)" in printed
    assert "the last start took 12 s" in printed


def test_with_room_nothing_is_announced(tmp_path):
    async def check() -> None:
        supervisor = supervisor_with(tmp_path, memory_bytes=8 << 30)
        try:
            assert commands.apply_desired(supervisor, FLEET % 3, "fleet.yaml", dry_run=True)[
                "outages"] == []
            assert commands.drain_node(supervisor, "b")["outages"] == []
            # the successor was made, and the serving replica still serves
            states = sorted((r.id, r.state) for r in supervisor.replicas.values())
            assert states == [("demo-g1", lc.SERVING), ("demo-g2", lc.PLACING)]
        finally:
            await supervisor.close()

    asyncio.run(check())

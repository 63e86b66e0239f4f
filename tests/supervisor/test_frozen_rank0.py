"""A frozen rank 0 of a one-stage replica, with real processes on loopback: a supervisor and
one agent serving a generated checkpoint as the model's only replica. Its rank 0 SIGSTOPped
keeps its sockets open and has no follower to leave the ring, so only the supervisor's own
probes of its /health can end it: the replica fails once the ring's dead-ring time has
passed without an answer, the agent kills the stopped process (it cannot act on SIGTERM),
and a replacement serves a 200 through the front door.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from supervisor.local import LocalFleet
from supervisor.relays import UpstreamSilence
from tests.supervisor.test_end_to_end import engine_records
from tests.supervisor.test_replicas_end_to_end import ask
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(240)
MODEL = "demo"
FLEET = """version: 1
supervisor: {{address: "{address}", state_dir: "{state_dir}"}}
nodes:
  - {{name: node-a, labels: {{backend: torch-cpu}}}}
models:
  - id: demo
    checkpoint: {checkpoint}
    backends: [torch-cpu]
    context: 512
    parallel: 2
    chunk: 64
"""
# The supervisor's tick and the health loop's round (1 s sleep, 2 s probe timeout) come on
# top of the dead-ring time; a busy machine of 2 cores adds its share to each.
MARGIN_S = 4.0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, checkpoint):
    root = tmp_path_factory.mktemp("fleet")
    with LocalFleet(root, nodes=("node-a",), supervisor_flags=(
        "--backoff-first-s", "0.5", "--tick-s", "0.2", "--calibration-budget-s", "0"),
        agent_settings=dict(heartbeat_interval_s=0.3)) as fleet:
        path = root / "fleet.yaml"
        path.write_text(FLEET.format(address=fleet.address, state_dir=fleet.state_dir,
                                     checkpoint=checkpoint))
        fleet.fleetctl("apply", str(path))
        yield fleet


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_frozen_one_stage_rank0_is_failed_killed_and_replaced(fleet):
    old = fleet.wait_replica(MODEL)
    assert len(old["stages"]) == 1
    assert ask(fleet) == (200, old["id"])
    engine = old["stages"][0]["engine_id"]
    pid = engine_records(fleet)[engine]
    os.kill(pid, signal.SIGSTOP)
    stopped_at, stopped_mono = time.time(), time.monotonic()
    try:
        # Sent to it while it is frozen, before anything saw it silent: the front door ends
        # the wait at the dead-ring time with a 503 (docs/supervisor.md), never a hang.
        asked_mono = time.monotonic()
        status, _ = ask(fleet)
        refused_s = time.monotonic() - asked_mono
        assert status == 503
        failed = wait_until(
            lambda: next((e for e in fleet.status()["events"]
                          if e["message"].startswith(f"{old['id']} is failed")), None),
            within_s=60, what=f"{old['id']} failed", poll_s=0.3)
        # The agent's stop: SIGTERM, which a stopped process cannot act on, then SIGKILL.
        wait_until(lambda: gone(pid), within_s=60, what="the frozen engine killed")
        first_200 = wait_until(lambda: (answer := ask(fleet))[0] == 200 and answer,
                               within_s=120, what="a 200 from a replacement", poll_s=0.2)
        first_200_s = time.monotonic() - stopped_mono
    finally:
        if not gone(pid):
            os.kill(pid, signal.SIGCONT)  # whatever failed above: let the fleet stop it
    limit_s = UpstreamSilence().limit_s
    failed_after_s = failed["at"] - stopped_at
    new = fleet.wait_replica(MODEL, where=lambda r: r["id"] != old["id"])
    print(f"SIGSTOP of the only replica's rank 0: failed {failed_after_s:.1f} s after it "
          f"(dead-ring time {limit_s:g} s), first 200 from {new['id']} "
          f"{first_200_s:.1f} s after it (a request sent to it: 503 in {refused_s:.1f} s); "
          f"{failed['message']}")
    assert "rank 0 has not answered /health" in failed["message"]
    # Counted from its last answer, which came at most a health round before the freeze.
    assert limit_s - 2.0 <= failed_after_s <= limit_s + MARGIN_S
    assert refused_s <= limit_s + MARGIN_S
    assert first_200 == (200, new["id"]) and new["generation"] > old["generation"]
    log = (fleet.logs / "agent-node-a.log").read_text(errors="replace")
    assert any("sending SIGKILL" in line and engine in line for line in log.splitlines())

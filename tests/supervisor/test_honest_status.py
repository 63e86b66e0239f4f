"""Status that tells the truth, with a real supervisor and two agents on loopback: a second
supervisor on the same state directory is refused; an outside SIGTERM to rank 0 shows as a
drain (in-flight requests, seconds left) and ends the replica cleanly, not as a failure;
engines the supervisor's state no longer owns are drained by their agents; a node whose agent
died shows its engines unknown within the heartbeat window and gets no placement. The tests
share one fleet and run in file order, each step on the last.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import replace

import pytest

from engine.harness.launch import free_port
from supervisor.local import LocalFleet
from tests.supervisor.test_end_to_end import StreamReader, chat, engine_records, fleet_file
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(300)
MODEL = "demo"
SUSPECT_AFTER_S = 30.0  # far above the heartbeat window: lateness alone must be seen
HEARTBEAT_S = 0.3
DRAIN_S = 60
# In flight for several of the supervisor's health probes (1 s apart; 250 tokens took 18 s
# on two busy cores), done well within the drain.
STREAM_TOKENS = 150


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, checkpoint):
    root = tmp_path_factory.mktemp("fleet")
    fleet = LocalFleet(root, supervisor_flags=(
        "--suspect-after-s", str(SUSPECT_AFTER_S), "--dead-after-s", "90", "--drain-s", str(DRAIN_S),
        "--backoff-first-s", "0.5", "--tick-s", "0.2", "--calibration-budget-s", "0"),
        agent_settings=dict(heartbeat_interval_s=HEARTBEAT_S))
    try:
        fleet.start()
        fleet.fleetctl("apply", str(fleet_file(fleet, checkpoint, "fleet.yaml")))
        fleet.wait_replica(MODEL, timeout_s=120)
        yield fleet
    finally:
        leftovers = engine_records(fleet)  # a dead agent's engines are ours to end here
        fleet.stop(timeout_s=30)
        for pid in leftovers.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def replica_of(fleet: LocalFleet, replica_id: str) -> dict | None:
    return next((r for r in fleet.status()["replicas"] if r["id"] == replica_id), None)


def serving(fleet: LocalFleet) -> dict:
    return fleet.wait_replica(MODEL, timeout_s=120)


def test_a_second_supervisor_on_the_same_state_dir_is_refused(fleet):
    before = {m["node"]: m["state"] for m in fleet.status()["members"]}
    second = subprocess.run(
        [sys.executable, "-m", "supervisor.main", "--state-dir", str(fleet.state_dir),
         "--listen", f"127.0.0.1:{free_port()}", "--front-door", f"127.0.0.1:{free_port()}"],
        env=fleet.env, capture_output=True, text=True, timeout=60, check=False)
    assert second.returncode == 2, second.stderr
    [line] = second.stderr.strip().splitlines()  # one line, naming the holder
    assert f"in use by another supervisor (pid {fleet.supervisor.pid})" in line, line
    assert {m["node"]: m["state"] for m in fleet.status()["members"]} == before
    assert fleet.supervisor.poll() is None


def test_an_outside_sigterm_to_rank0_shows_a_drain_and_ends_cleanly(fleet):
    old = serving(fleet)
    stream = StreamReader(fleet, max_tokens=STREAM_TOKENS)
    stream.start()
    assert stream.started_tokens.wait(60)
    t0 = time.monotonic()
    os.kill(engine_records(fleet)[old["stages"][0]["engine_id"]], signal.SIGTERM)

    def draining() -> dict | None:
        r = replica_of(fleet, old["id"])
        return r if r and r["state"] == "draining" and r.get("drain") else None

    seen = wait_until(draining, within_s=20, what="status showing the replica draining")
    assert seen["drain"]["in_flight"] == 1 and 0 < seen["drain"]["seconds_left"] <= DRAIN_S, seen
    table = fleet.fleetctl("status").stdout
    assert "in flight" in table and "s left" in table, table
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    request = urllib.request.Request(fleet.front_door_url + "/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 503 and int(refused.value.headers["Retry-After"]) > 0
    stream.join(60)
    print(f"the stream in flight finished {time.monotonic() - t0:.1f} s into the drain")
    assert stream.done and stream.finish_reasons() == ["length"], (  # the drain let it finish
        stream.events[-1:], stream.status)
    stopped = fleet.wait_replica(MODEL, "stopped", timeout_s=60,
                                 where=lambda r: r["id"] == old["id"])
    # Whichever stage's clean exit the supervisor heard first (rank 0 "drained", or its
    # follower "rank 0 ended the replica"): stopped, not failed, no failure counted.
    assert "ended cleanly" in stopped["reason"], stopped
    rank0 = old["stages"][0]["engine_id"]

    def rank0_exit_logged() -> bool:  # the follower's exit may reach the supervisor first
        log = (fleet.logs / "agent-node-a.log").read_text()
        return any('"child exited"' in line and '"reason": "drained"' in line and rank0 in line
                   for line in log.splitlines())

    wait_until(rank0_exit_logged, within_s=30, what="node-a's agent logging rank 0 drained")
    assert stopped["failures"] == old["failures"]
    new = fleet.wait_replica(MODEL, timeout_s=120, where=lambda r: r["id"] != old["id"])
    assert new["generation"] == old["generation"] + 1
    assert chat(fleet, max_tokens=4).choices[0].finish_reason in ("stop", "length")


def test_engines_of_a_superseded_generation_are_drained_by_their_agents(fleet):
    """What a second supervisor used to leave: the state says the running generation has
    ended (it failed there), so the supervisor runs a newer one, and the old engines, which
    nothing owns now, are drained by their agents instead of holding memory for good."""
    from supervisor.lifecycle import FAILED
    from supervisor.state import State

    old = serving(fleet)
    pids = {s["engine_id"]: engine_records(fleet)[s["engine_id"]] for s in old["stages"]}
    assert fleet.stop_supervisor(signal.SIGKILL) == -signal.SIGKILL
    state = State(fleet.state_dir / "supervisor.sqlite")
    try:
        record = state.replicas()[old["id"]]
        state.put_replica(replace(record, state=FAILED, reason="superseded"))
    finally:
        state.close()
    fleet.start_supervisor()
    wait_until(lambda: not any(_alive(pid) for pid in pids.values()), within_s=60,
               what="the orphaned engines gone")
    messages = [e["message"] for e in fleet.status()["events"]]
    for engine_id in pids:
        assert any(f"orphaned engine {engine_id}" in m for m in messages), messages
    new = fleet.wait_replica(MODEL, timeout_s=120, where=lambda r: r["id"] != old["id"])
    assert new["generation"] > old["generation"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of a dead agent is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def test_a_node_whose_agent_died_shows_unknown_engines_and_gets_no_placement(fleet):
    old = serving(fleet)
    on_b = [s["engine_id"] for s in old["stages"] if s["node"] == "node-b"]
    assert on_b, old
    os.kill(fleet.agents["node-b"].pid, signal.SIGKILL)  # its engines keep running
    t0 = time.monotonic()

    def unknown() -> dict | None:
        [b] = [m for m in fleet.status()["members"] if m["node"] == "node-b"]
        return b if b["state"] == "suspect" and all(
            b["engines"].get(e) == "unknown" for e in on_b) else None

    b = wait_until(unknown, within_s=SUSPECT_AFTER_S / 3, what="node-b's engines unknown")
    took = time.monotonic() - t0
    print(f"node-b suspect, its engines unknown, {took:.1f} s after its agent died")
    assert "heartbeats late" in b["reason"], b
    # A re-placement now (rank 0 killed from outside) must not pick node-b.
    os.kill(engine_records(fleet)[old["stages"][0]["engine_id"]], signal.SIGKILL)
    failed = fleet.wait_replica(MODEL, "failed", timeout_s=30,
                                where=lambda r: r["id"] == old["id"])
    assert "killed by SIGKILL from outside the agent" in failed["reason"], failed
    new = fleet.wait_replica(MODEL, timeout_s=120, where=lambda r: r["id"] != old["id"])
    assert {s["node"] for s in new["stages"]} == {"node-a"}
    assert "needs node-b" in new["note"]
    messages = [e["message"] for e in fleet.status()["events"]]
    assert not any("spawn refused" in m for m in messages), messages
    fleet.agents["node-b"].wait(5)

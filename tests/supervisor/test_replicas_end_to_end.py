"""Two replicas of one model, and make before break, with real processes on loopback: a
supervisor and two agents serving a generated checkpoint, one replica a node. Both replicas
serve and share the requests; `kill -9` of one replica's engine under a client load loses no
request (the front door hands a refused request to the other) and the replica is placed
again; a rank 0 frozen with SIGSTOP under a client load costs each request at most the
dead-ring time, once the front door has seen it silent it routes it nothing new, and once
its /health has gone unanswered for the dead-ring time the supervisor fails it and places
it again; with
one replica left, `fleetctl drain` of its node under load starts the successor on
the other node first and drains the old one only once the successor serves: no request
fails, and no outage is announced. The tests share one fleet and run in file order.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from supervisor.local import LocalFleet
from supervisor.relays import UpstreamSilence
from tests.supervisor.test_end_to_end import engine_records
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(300)
MODEL = "demo"
FLEET = """version: 1
supervisor: {{address: "{address}", state_dir: "{state_dir}"}}
nodes:
  - {{name: node-a, labels: {{backend: torch-cpu}}}}
  - {{name: node-b, labels: {{backend: torch-cpu}}}}
models:
  - id: demo
    checkpoint: {checkpoint}
    backends: [torch-cpu]
    context: 512
    parallel: 2
    chunk: 64
    replicas: {replicas}
"""
LOAD_MAX_REQUESTS = 400  # every load loop stops at this count or its time, whichever first
LOAD_MAX_S = 150.0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, checkpoint):
    root = tmp_path_factory.mktemp("fleet")
    with LocalFleet(root, supervisor_flags=(
        "--suspect-after-s", "1.5", "--dead-after-s", "4", "--drain-s", "20",
        # Nominal timings (no calibration): the two nodes tie, so the replicas spread
        # whatever a busy machine's calibration would say.
        "--backoff-first-s", "0.5", "--tick-s", "0.2", "--calibration-budget-s", "0"),
        agent_settings=dict(heartbeat_interval_s=0.3)) as fleet:
        yield fleet


def apply(fleet: LocalFleet, checkpoint: Path, replicas: int):
    path = fleet.root / f"fleet-{replicas}.yaml"
    path.write_text(FLEET.format(address=fleet.address, state_dir=fleet.state_dir,
                                 checkpoint=checkpoint, replicas=replicas))
    return fleet.fleetctl("apply", str(path))


def serving(fleet: LocalFleet) -> list[dict]:
    return [r for r in fleet.status()["replicas"] if r["state"] == "serving"]


def wait_serving(fleet: LocalFleet, count: int, where=lambda r: True,
                 timeout_s: float = 120.0) -> list[dict]:
    found: list[dict] = []

    def ready() -> bool:
        nonlocal found
        found = [r for r in serving(fleet) if where(r)]
        return len(found) == count
    wait_until(ready, within_s=timeout_s, what=f"{count} serving replica(s) of {MODEL}",
               poll_s=0.3)
    return found


def ask(fleet: LocalFleet, text: str = "Hi") -> tuple[int, str]:
    """One whole chat through the front door: (status, the replica that answered)."""
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
    request = urllib.request.Request(fleet.front_door_url + "/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            json.loads(reply.read())
            return reply.status, reply.headers.get("X-Ringfleet-Replica", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")[:300]
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc)


class Load(threading.Thread):
    """Requests one after another until stopped, LOAD_MAX_REQUESTS or LOAD_MAX_S."""

    def __init__(self, fleet: LocalFleet) -> None:
        super().__init__(daemon=True)
        self.fleet = fleet
        self.stop_asked = threading.Event()
        self.ok: list[str] = []
        self.failed: list[tuple[int, str]] = []

    def run(self) -> None:
        deadline = time.monotonic() + LOAD_MAX_S
        for _ in range(LOAD_MAX_REQUESTS):
            if self.stop_asked.is_set() or time.monotonic() > deadline:
                return
            status, detail = ask(self.fleet)
            (self.ok.append(detail) if status == 200 else self.failed.append((status, detail)))

    def finish(self) -> None:
        self.stop_asked.set()
        self.join(90)
        assert not self.is_alive()


def test_two_replicas_serve_side_by_side_and_share_the_requests(fleet, checkpoint):
    applied = apply(fleet, checkpoint, replicas=2)
    assert "replica 2 of 2" in applied.stdout and "warning" not in applied.stderr
    planned = json.loads(fleet.fleetctl("--json", "plan", str(fleet.root / "fleet-2.yaml")
                                        ).stdout)
    rings = [p["stages"][0]["node"] for p in planned["plans"][0]["replicas"]]
    assert sorted(rings) == ["node-a", "node-b"]  # placed together, one replica a node
    pair = wait_serving(fleet, 2)
    assert sorted(r["stages"][0]["node"] for r in pair) == ["node-a", "node-b"]
    # Conversations spread over the replicas; each one's turns stay with the replica that
    # holds it (supervisor.affinity), one after another as a client sends them.
    answered = [ask(fleet, f"Hi {i}") for i in range(8)]
    assert all(status == 200 for status, _ in answered), answered
    assert {replica for _, replica in answered} == {r["id"] for r in pair}
    again = [ask(fleet, f"Hi {i}") for i in range(8)]
    assert [replica for _, replica in again] == [replica for _, replica in answered]


@dataclass(frozen=True)
class Answer:
    started: float  # time.monotonic()
    ended: float
    status: int
    replica: str  # X-Ringfleet-Replica, or the error's text
    tried: str  # X-Ringfleet-Tried: the replicas that did not take it first
    retry_after: str | None


def ask_timed(fleet: LocalFleet, text: str) -> Answer:
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
    request = urllib.request.Request(fleet.front_door_url + "/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            json.loads(reply.read())
            return Answer(started, time.monotonic(), reply.status,
                          reply.headers.get("X-Ringfleet-Replica", ""),
                          reply.headers.get("X-Ringfleet-Tried", ""), None)
    except urllib.error.HTTPError as exc:
        return Answer(started, time.monotonic(), exc.code,
                      exc.read().decode(errors="replace")[:300], "",
                      exc.headers.get("Retry-After"))
    except (urllib.error.URLError, OSError) as exc:
        return Answer(started, time.monotonic(), 0, str(exc), "", None)


class TimedLoad(threading.Thread):
    """Distinct conversations one after another (so they spread over the replicas) until
    stopped, LOAD_MAX_REQUESTS or LOAD_MAX_S."""

    def __init__(self, fleet: LocalFleet, name: str) -> None:
        super().__init__(daemon=True)
        self.fleet, self.name = fleet, name
        self.stop_asked = threading.Event()
        self.answers: list[Answer] = []

    def run(self) -> None:
        deadline = time.monotonic() + LOAD_MAX_S
        for i in range(LOAD_MAX_REQUESTS):
            if self.stop_asked.is_set() or time.monotonic() > deadline:
                return
            self.answers.append(ask_timed(self.fleet, f"Hi from {self.name}, #{i}"))


def test_a_frozen_rank0_costs_at_most_the_dead_ring_time_gets_nothing_new_and_is_replaced(
        fleet):
    pair = wait_serving(fleet, 2)
    victim = next(r for r in pair if r["stages"][0]["node"] == "node-b")["id"]
    other = next(r["id"] for r in pair if r["id"] != victim)
    engine = next(r for r in pair if r["id"] == victim)["stages"][0]["engine_id"]
    pid = engine_records(fleet)[engine]
    loads = [TimedLoad(fleet, f"client {i}") for i in range(3)]

    def answers() -> list[Answer]:
        return sorted((a for load in loads for a in load.answers), key=lambda a: a.started)

    def handed_on() -> list[Answer]:
        return [a for a in answers() if victim in a.tried]

    for load in loads:
        load.start()
    try:
        wait_until(lambda: {a.replica for a in answers()} >= {victim, other}, within_s=60,
                   what="both replicas answering before the freeze")
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        wait_until(handed_on, within_s=60, what="a request handed on from the frozen replica")
        seen_at = min(a.ended for a in handed_on())
        wait_until(lambda: sum(a.started > seen_at for a in answers()) >= 12, within_s=60,
                   what="answers after the front door saw the frozen replica")
        failed_event = wait_until(lambda: next((e for e in fleet.status()["events"] if e[
            "message"].startswith(f"{victim} is failed")), None), within_s=60,
            what=f"{victim} failed by the supervisor", poll_s=0.3)
    finally:
        for load in loads:
            load.stop_asked.set()
        try:
            os.kill(pid, signal.SIGCONT)  # its agent has killed it, unless a wait above failed
        except ProcessLookupError:
            pass
        for load in loads:
            load.join(90)
    assert not any(load.is_alive() for load in loads)
    everything = answers()
    during = [a for a in everything if a.ended > stopped_at]
    failed = [a for a in everything if a.status != 200]
    # A reply whose head the frozen rank 0 had sent already may end as the documented 503;
    # nothing else may fail, and no request that began after the freeze.
    assert all(a.status == 503 and a.retry_after and a.started < stopped_at for a in failed), \
        failed
    after = [a for a in everything if a.started > seen_at]
    assert after and all(a.replica == other and victim not in a.tried for a in after), [
        a for a in after if a.replica != other or victim in a.tried]
    assert not [a for a in everything if a.started > stopped_at and a.replica == victim]
    worst_s = max(a.ended - a.started for a in during)
    first_200_s = min(a.ended for a in during if a.status == 200) - stopped_at
    limit_s = UpstreamSilence().limit_s
    print(f"SIGSTOP of {victim}'s rank 0 under 3 clients: {len(everything)} answered, "
          f"{len(failed)} 503, {len(handed_on())} handed on from it, "
          f"{len(after)} after it was seen silent (all by {other}); slowest request "
          f"{worst_s:.2f} s (dead-ring time {limit_s:g} s), first 200 {first_200_s:.2f} s "
          "after the freeze")
    # Each request waits at most the dead-ring time for the frozen one, plus a whole reply
    # of the other on a busy machine.
    assert worst_s < limit_s + 10.0, worst_s
    # Its /health unanswered for the dead-ring time: the supervisor failed it (its agent
    # killed the stopped process), and its successor serves beside the other replica.
    assert "rank 0 has not answered /health" in failed_event["message"]
    wait_serving(fleet, 2, where=lambda r: r["id"] != victim)


def test_kill_9_of_one_replicas_engine_loses_no_request(fleet):
    before = {r["id"]: r for r in serving(fleet)}
    # The newest: the frozen one's successor (on whichever node placement chose for it).
    victim = max(before.values(), key=lambda r: r["generation"])
    load = Load(fleet)
    load.start()
    try:
        wait_until(lambda: len(load.ok) >= 5, within_s=60, what="answers before the kill")
        os.kill(engine_records(fleet)[victim["stages"][0]["engine_id"]], signal.SIGKILL)
        wait_serving(fleet, 2, where=lambda r: r["id"] != victim["id"])
        served_after = len(load.ok)
        wait_until(lambda: len(load.ok) >= served_after + 5, within_s=60,
                   what="answers after the re-place")
    finally:
        load.finish()
    print(f"kill -9 under load: {len(load.ok)} answered, {len(load.failed)} failed")
    assert load.failed == [] and len(load.ok) >= 10
    messages = [e["message"] for e in fleet.status()["events"]]
    assert any(f"{victim['id']} is failed" in m for m in messages)


def test_a_drain_with_room_starts_the_successor_first_and_loses_no_request(fleet, checkpoint):
    apply(fleet, checkpoint, replicas=1)
    [old] = wait_serving(fleet, 1, where=lambda r: r["slot"] == 0)
    wait_until(lambda: len(serving(fleet)) == 1, within_s=60, what="the second replica retired",
               poll_s=0.3)
    node = old["stages"][0]["node"]
    other = "node-b" if node == "node-a" else "node-a"
    load = Load(fleet)
    load.start()
    try:
        wait_until(lambda: len(load.ok) >= 5, within_s=60, what="answers before the drain")
        drained = fleet.fleetctl("drain", node)
        assert "warning" not in drained.stderr  # room on the other node: nothing stops
        [new] = wait_serving(fleet, 1, where=lambda r: r["id"] != old["id"])
        wait_until(lambda: old["id"] not in {r["id"] for r in fleet.status()["replicas"]
                                             if r["state"] in ("serving", "draining")},
                   within_s=60, what="the old replica drained", poll_s=0.3)
        served_after = len(load.ok)
        wait_until(lambda: len(load.ok) >= served_after + 3, within_s=60,
                   what="answers after the drain")
    finally:
        load.finish()
    print(f"drain under load: {len(load.ok)} answered, {len(load.failed)} failed")
    assert load.failed == [] and len(load.ok) >= 8
    assert [s["node"] for s in new["stages"]] == [other] and new["replaces"] == old["id"]
    messages = [e["message"] for e in fleet.status()["events"]]  # oldest first
    new_serving = next(i for i, m in enumerate(messages) if f"{new['id']} is serving" in m)
    old_draining = next(i for i, m in enumerate(messages) if f"{old['id']} is draining" in m)
    assert new_serving < old_draining  # made before the old one broke
    fleet.fleetctl("drain", node, "--undo")

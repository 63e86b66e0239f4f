"""A supervisor and two agents as real processes on loopback, serving a generated checkpoint
with one torch-cpu stage and one mlx-cpu stage: apply → serving → a request through the front
door; bad input refused without disturbing it; a change starts the new replica beside the
old one, which then drains its stream in flight; a
supervisor restart leaves the replica alone; a frozen rank 0 (SIGSTOP) ends its stream and
new requests within the dead-ring time and is re-placed; `kill -9` of an agent and its engine
fails the replica fast (the stream ends with an SSE error, a whole request gets 503) and it is
re-placed on what remains. The tests share one fleet and run in file order, each step on the last.
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from supervisor.fleetctl import Client
from supervisor.lifecycle import LIVE_STATES
from supervisor.local import LocalFleet
from tests.waiting import stays_true, wait_until

pytestmark = pytest.mark.timeout(240)
FIXTURES = Path(__file__).parent / "fixtures"
MODEL = "demo"
FLEET = """version: 1
supervisor: {{address: "{address}", state_dir: "{state_dir}"}}
nodes:
  - {{name: node-a, labels: {{backend: torch-cpu}}}}
  - {{name: node-b, labels: {{backend: mlx-cpu}}}}
models:
  - id: demo
    checkpoint: {checkpoint}
    backends: [torch-cpu, mlx-cpu]
    context: {context}
    parallel: {parallel}
    chunk: 64
    placement:
      - {{node: node-a, layers: "0:4"}}
      - {{node: node-b, layers: "4:8"}}
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, checkpoint):
    root = tmp_path_factory.mktemp("fleet")
    with LocalFleet(root, supervisor_flags=(
        "--suspect-after-s", "1.5", "--dead-after-s", "4", "--drain-s", "30",
        "--backoff-first-s", "0.5", "--tick-s", "0.2", "--calibration-budget-s", "2"),
        agent_settings=dict(heartbeat_interval_s=0.3)) as fleet:
        yield fleet


def fleet_file(fleet: LocalFleet, checkpoint: Path, name: str, **values) -> Path:
    values = dict(address=fleet.address, state_dir=fleet.state_dir, checkpoint=checkpoint,
                  context=1024, parallel=2) | values
    path = fleet.root / name
    path.write_text(FLEET.format(**values))
    return path


def serving(fleet: LocalFleet) -> dict:
    [replica] = [r for r in fleet.status()["replicas"] if r["state"] == "serving"]
    return replica


def live_replicas(fleet: LocalFleet) -> dict[str, str]:
    """id -> state of every replica that is not stopped or failed."""
    return {r["id"]: r["state"] for r in fleet.status()["replicas"] if r["state"] in LIVE_STATES}


def member(status: dict, node: str) -> dict:
    [found] = [m for m in status["members"] if m["node"] == node]
    return found


def chat(fleet: LocalFleet, **kw):
    from openai import OpenAI

    client = OpenAI(base_url=fleet.front_door_url, api_key="none", max_retries=0)
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], **kw)


class StreamReader(threading.Thread):
    """A streamed chat through the front door, read raw so the events can be checked."""

    def __init__(self, fleet: LocalFleet, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url = fleet.front_door_url + "/chat/completions"
        self.body = {"model": MODEL, "stream": True, "max_tokens": max_tokens,
                     "ignore_eos": True, "messages": [{"role": "user", "content": "Count."}]}
        self.events: list[dict] = []
        self.done = False
        self.status = 0
        self.started_tokens = threading.Event()

    def run(self) -> None:
        request = urllib.request.Request(self.url, data=json.dumps(self.body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as reply:
            self.status = reply.status
            for raw in reply:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    self.events.append(json.loads(line[6:]))
                    if len(self.events) >= 5:
                        self.started_tokens.set()
        self.started_tokens.set()

    def finish_reasons(self) -> list:
        return [c.get("finish_reason") for e in self.events for c in e.get("choices", [])
                if c.get("finish_reason")]


def test_apply_serves_and_answers_through_the_front_door(fleet, checkpoint):
    applied = fleet.fleetctl("apply", str(fleet_file(fleet, checkpoint, "fleet.yaml")))
    assert "first apply" in applied.stdout and "node-a -> node-b" in applied.stdout
    planned = fleet.fleetctl("--json", "plan", str(fleet.root / "fleet.yaml"))
    [plan] = json.loads(planned.stdout)["plans"]
    assert plan["ring"] == ["node-a", "node-b"]
    assert [h["transport"] for h in plan["placement"]["hops"]] == ["tcp", "tcp"]
    replica = fleet.wait_replica(MODEL, timeout_s=90)
    assert [(s["node"], s["backend"], s["layer_range"]) for s in replica["stages"]] == [
        ("node-a", "torch-cpu", [0, 4]), ("node-b", "mlx-cpu", [4, 8])]
    reply = chat(fleet, max_tokens=8)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.system_fingerprint == "0-4@torch-cpu,4-8@mlx-cpu"
    # Rank 0's /health names each hop's transport; the health loop keeps it for status.
    fleet.wait(lambda: serving(fleet)["hops"] == ["tcp", "tcp"], 30, "the hops in status")
    table = fleet.fleetctl("status").stdout
    assert "serving, healthy" in table and "node-b" in table and replica["url"] in table
    assert "hops tcp,tcp" in table
    # No prompt_cache_* in fleet.yaml: each stage's default budget (a share of its node's
    # memory) bought the kept slots, every stage was spawned with them, and rank 0 reports
    # what each stage's slot takes, as placement charged it.
    shown = serving(fleet)
    assert shown["prompt_cache_slots"] >= 1
    stages = plan["placement"]["stages"]
    assert all(s["prompt_cache_budget_bytes"] > 0 for s in shown["stages"])
    fleet.wait(lambda: serving(fleet)["prompt_cache"], 30, "the cache's figures in status")
    figures = serving(fleet)["prompt_cache"]
    assert figures["slots"] == shown["prompt_cache_slots"]
    assert [s["slot_bytes"] for s in figures["stages"]] == [
        s["prompt_cache_slot_bytes"] for s in stages]
    assert f"prompt cache: {shown['prompt_cache_slots']} kept slot(s)" in table


def test_bad_input_is_refused_and_serving_is_not_disturbed(fleet, checkpoint):
    before = serving(fleet)
    for name in ("bad-context-negative.yaml", "bad-unknown-model-key.yaml", "bad-not-yaml.yaml",
                 "bad-placement-unknown-node.yaml"):
        path = FIXTURES / name
        expect = path.read_text().splitlines()[0].removeprefix("# expect: ")
        line, _, message = expect.partition(" | ")
        done = fleet.fleetctl("apply", str(path), check=False)
        assert done.returncode == 2, done.stderr
        assert f"{path}:{line.split()[0]}:" in done.stderr and message in done.stderr
    huge = fleet.fleetctl("apply", str(fleet_file(fleet, checkpoint, "huge.yaml",
                                                  context=10**9)), check=False)
    assert huge.returncode == 1 and "demo" in huge.stderr and "nothing was changed" in huge.stderr
    missing = fleet.fleetctl("apply", str(fleet_file(fleet, Path("/nonexistent/x"), "missing.yaml"
                                                     )), check=False)
    assert missing.returncode == 1 and "config.json" in missing.stderr
    unknown = fleet.fleetctl("drain", "nope", check=False)
    assert unknown.returncode == 1 and "unknown node 'nope'" in unknown.stderr
    from openai import NotFoundError, OpenAI

    with pytest.raises(NotFoundError, match="not served by this fleet"):
        OpenAI(base_url=fleet.front_door_url, api_key="x", max_retries=0).chat.completions.create(
            model="other", messages=[{"role": "user", "content": "hi"}])
    # An agent whose certificate is from another CA fails the handshake; nothing joins.
    from agent.pki import FleetCA, NodeCredentials, cert_pem

    other = FleetCA.create("other")
    key, cert = other.issue_credentials("node-x", "agent")
    NodeCredentials(fleet.root / "stranger").store(cert_pem(other.cert), cert, key)
    ctx = ssl.create_default_context(cafile=str(fleet.state_dir / "pki" / "ca.pem"))
    ctx.check_hostname = False
    ctx.load_cert_chain(str(fleet.root / "stranger/node.pem"), str(fleet.root / "stranger/node.key"))
    request = urllib.request.Request(f"https://{fleet.address}/v1/nodes/node-x/heartbeat",
                                     data=b'{"url": "https://127.0.0.1:1"}', method="POST")
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(request, context=ctx, timeout=10)
    after = fleet.status()
    assert "node-x" not in {m["node"] for m in after["members"]}
    assert serving(fleet)["id"] == before["id"] and serving(fleet)["since"] == before["since"]


def test_apply_with_a_change_drains_a_stream_then_replaces(fleet, checkpoint):
    old = serving(fleet)
    stream = StreamReader(fleet, max_tokens=150)
    stream.start()
    assert stream.started_tokens.wait(60)
    changed = fleet.fleetctl("apply", str(fleet_file(fleet, checkpoint, "fleet.yaml",
                                                     parallel=3)))
    assert "model demo: parallel 2 -> 3" in changed.stdout
    stream.join(60)
    assert stream.status == 200 and stream.done and stream.finish_reasons() == ["length"]
    assert not any("error" in e for e in stream.events)
    new = fleet.wait_replica(MODEL, timeout_s=90, where=lambda r: r["id"] != old["id"])
    assert new["generation"] > old["generation"]  # a start that failed is retried
    # Make before break: the new replica served first, then the old one drained its stream.
    fleet.wait(lambda: any(f"{old['id']} is stopped" in e["message"]
                           for e in fleet.status()["events"]), 60, f"{old['id']} stopped")
    messages = [e["message"] for e in fleet.status()["events"]]
    draining = next(i for i, m in enumerate(messages)
                    if f"{old['id']} is draining: fleet.yaml changed" in m)
    assert new["replaces"] == old["id"]
    assert any(f"{new['id']} is serving" in m for m in messages[:draining])
    assert chat(fleet, max_tokens=4).choices[0].finish_reason in ("stop", "length")


def test_drain_node_moves_the_replica_and_rebalance_brings_it_back(fleet):
    old = serving(fleet)
    assert "cordoned" in fleet.fleetctl("drain", "node-b").stdout
    # The JSON says what the table says: draining while a replica holds a stage there.
    assert member(fleet.status(), "node-b")["state"] == "draining"
    moved = fleet.wait_replica(MODEL, timeout_s=90, where=lambda r: r["id"] != old["id"])
    fleet.wait(lambda: member(fleet.status(), "node-b")["state"] == "cordoned", 90,
               "node-b shown cordoned once nothing runs there")
    assert member(fleet.status(), "node-b")["membership_state"] == "alive"
    assert [s["node"] for s in moved["stages"]] == ["node-a"] and "needs node-b" in moved["note"]
    fleet.fleetctl("drain", "node-b", "--undo")
    # A node back changes nothing by itself. The supervisor decided on the uncordoned node
    # within the undo request; its ticks (0.2 s) decide again on each heartbeat (0.3 s). No
    # event says "nothing was re-placed", so the replicas are watched over several of both.
    assert not member(fleet.status(), "node-b")["cordoned"]
    stays_true(lambda: {i: s for i, s in live_replicas(fleet).items() if i != old["id"]}
               == {moved["id"]: "serving"}, for_s=1.5,
               what="the moved replica serving, and no other placed, after node-b is back")
    assert serving(fleet)["id"] == moved["id"]
    fleet.fleetctl("rebalance")
    back = fleet.wait_replica(MODEL, timeout_s=90, where=lambda r: r["id"] != moved["id"])
    assert [s["node"] for s in back["stages"]] == ["node-a", "node-b"]
    # Make before break: the moved replica drains once its successor serves, on a later
    # step of the supervisor than the one a fast status may show.
    events = Client(fleet.credentials, None)
    wait_until(lambda: any(f"{moved['id']} is draining: rebalance" in e["message"]
                           for e in events.call("GET", "/v1/events")["events"]),
               within_s=30, what=f"{moved['id']} draining for the rebalance")


def test_supervisor_killed_and_restarted_leaves_the_replica_serving(fleet):
    before = serving(fleet)
    # The serving replica's engines only: an earlier test's replaced replica may still be
    # draining away, and its record goes whenever its engine exits.
    ours = {stage["engine_id"] for stage in before["stages"]}
    engine_pids = {k: v for k, v in engine_records(fleet).items() if k in ours}
    assert len(engine_pids) == len(ours)
    assert fleet.stop_supervisor(signal.SIGKILL) == -signal.SIGKILL  # no goodbye of its own
    fleet.start_supervisor()
    after = serving(fleet)
    assert (after["id"], after["since"]) == (before["id"], before["since"])
    assert {k: v for k, v in engine_records(fleet).items() if k in ours} == engine_pids
    assert chat(fleet, max_tokens=4).choices[0].finish_reason in ("stop", "length")
    assert any("re-adopting" in e["message"] for e in fleet.status()["events"])


def engine_records(fleet: LocalFleet) -> dict[str, int]:
    out = {}
    for node in fleet.nodes:
        for path in (fleet.agent_state_dir(node) / "run").glob("*.json"):
            record = json.loads(path.read_text())
            out[record["spec"]["engine_id"]] = record["pid"]
    return out


def test_a_frozen_rank0_ends_its_streams_within_the_dead_ring_time_and_is_replaced(fleet):
    """SIGSTOP of rank 0: its sockets stay open, so only the front door's bounds (silence past
    the ring's dead-ring time; the replica failed when its follower leaves) end the wait."""
    old = serving(fleet)
    stream = StreamReader(fleet, max_tokens=900)
    stream.start()
    assert stream.started_tokens.wait(60)
    rank0_pid = engine_records(fleet)[old["stages"][0]["engine_id"]]
    os.kill(rank0_pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        stream.join(30)
        stream_took = time.monotonic() - t0
        t1 = time.monotonic()
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
        request = urllib.request.Request(fleet.front_door_url + "/chat/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        whole_took = time.monotonic() - t1
        # Frozen until its follower has left and the supervisor placed a new replica: the
        # front door's 503 now comes at once (the replica is suspect there), and a rank 0
        # thawed before the follower's own dead-ring time would simply serve on.
        new = fleet.wait_replica(MODEL, timeout_s=90, where=lambda r: r["id"] != old["id"])
    finally:
        try:
            os.kill(rank0_pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    print(f"stream ended {stream_took:.1f} s after SIGSTOP; a new request got "
          f"{refused.value.code} in {whole_took:.1f} s")
    assert not stream.is_alive() and stream.status == 200 and not stream.done
    assert "error" in stream.events[-1] and stream.finish_reasons() == []
    assert stream_took < 6.0 + 3.0  # the ring's dead-ring time, and a margin
    assert refused.value.code == 503 and int(refused.value.headers["Retry-After"]) > 0
    assert whole_took < 6.0 + 3.0
    assert [s["node"] for s in new["stages"]] == ["node-a", "node-b"]
    assert chat(fleet, max_tokens=4).choices[0].finish_reason in ("stop", "length")


def test_killing_an_agent_fails_fast_and_replaces(fleet):
    old = serving(fleet)
    whole: dict = {}

    def ask_whole() -> None:
        body = {"model": MODEL, "max_tokens": 900, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Go on."}]}
        request = urllib.request.Request(fleet.front_door_url + "/chat/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as reply:
                whole.update(status=reply.status, body=json.loads(reply.read()))
        except urllib.error.HTTPError as exc:
            whole.update(status=exc.code, retry_after=exc.headers.get("Retry-After"),
                         body=json.loads(exc.read()))

    asker = threading.Thread(target=ask_whole, daemon=True)
    asker.start()
    stream = StreamReader(fleet, max_tokens=900)
    stream.start()
    assert stream.started_tokens.wait(60)
    victim = next(s for s in old["stages"] if s["node"] == "node-b")
    engine_pid = engine_records(fleet)[victim["engine_id"]]
    os.kill(fleet.agents["node-b"].pid, signal.SIGKILL)
    os.kill(engine_pid, signal.SIGKILL)
    t0 = time.monotonic()
    stream.join(60)
    asker.join(60)
    assert stream.status == 200 and not stream.done
    assert "error" in stream.events[-1] and stream.finish_reasons() == []
    assert whole["status"] == 503 and int(whole["retry_after"]) > 0
    assert whole["body"]["error"]["message"]
    failed = fleet.wait_replica(MODEL, "failed", timeout_s=30,
                                where=lambda r: r["id"] == old["id"])
    assert "node-b" in failed["reason"] or "exited" in failed["reason"]
    new = fleet.wait_replica(MODEL, timeout_s=90,
                             where=lambda r: all(s["node"] == "node-a" for s in r["stages"]))
    print(f"re-placed and serving {time.monotonic() - t0:.1f} s after the kill")
    assert "needs node-b" in new["note"]
    assert chat(fleet, max_tokens=4).choices[0].finish_reason in ("stop", "length")
    status = fleet.status()
    assert {m["node"]: m["state"] for m in status["members"]}["node-b"] in ("suspect", "dead")
    messages = [e["message"] for e in status["events"]]
    assert any(f"{old['id']} is failed" in m for m in messages)
    table = fleet.fleetctl("status").stdout
    assert "earlier replicas" in table and old["id"] in table and "failed" in table
    fleet.agents["node-b"].wait(5)

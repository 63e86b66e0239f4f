"""Status that tells the truth about placement and speed, with a supervisor and two agents
as real processes: `apply` marks a placement on nominal numbers provisional and shows the
one that runs once the nodes are measured; `status` shows the serving replica's predicted
decode ms/token beside rank 0's measured one, and its predicted time to first token; a restarted supervisor reuses the
calibrations and probes kept in its state (no agent is asked again), and measures them
again once they are older than its `--measurement-max-age-s` or when `fleetctl remeasure` asks
(the agents then calibrate, not answer from their caches). The tests share one fleet
and run in file order.
"""

from __future__ import annotations

import json
import signal

import pytest

from supervisor.fleetctl import Client
from supervisor.local import LocalFleet
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(240)
FLAGS = ("--tick-s", "0.2", "--calibration-budget-s", "2", "--drain-s", "10")
FLEET = """version: 1
supervisor: {{address: "{address}", state_dir: "{state_dir}"}}
nodes:
  - {{name: node-a, labels: {{backend: torch-cpu}}}}
  - {{name: node-b, labels: {{backend: mlx-cpu}}}}
models:
  - {{id: demo, checkpoint: {checkpoint}, backends: [torch-cpu, mlx-cpu], context: 512,
     parallel: 2, chunk: 64, rank0: node-a}}
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, checkpoint):
    with LocalFleet(tmp_path_factory.mktemp("fleet"), supervisor_flags=FLAGS,
                    agent_settings=dict(heartbeat_interval_s=0.3)) as fleet:
        (fleet.root / "fleet.yaml").write_text(FLEET.format(
            address=fleet.address, state_dir=fleet.state_dir, checkpoint=checkpoint))
        yield fleet


def events(fleet: LocalFleet, after: int = 0) -> list[dict]:
    return Client(fleet.credentials, None).call("GET", f"/v1/events?after={after}")["events"]


def layout(stages: list[dict]) -> list[tuple]:
    return [(s["node"], s["backend"], tuple(s["layer_range"])) for s in stages]


def test_apply_marks_a_nominal_placement_provisional_and_shows_the_one_that_runs(fleet):
    applied = json.loads(fleet.fleetctl("apply", str(fleet.root / "fleet.yaml"), "--json").stdout)
    [first] = applied["plans"]
    assert any(w.startswith("not calibrated") for w in first["placement"]["why"]), first
    assert applied["measured"] is True
    [final] = applied["final_plans"]
    assert not any("nominal" in w for w in final["placement"]["why"]), final
    replica = fleet.wait_replica("demo")
    assert layout(replica["stages"]) == layout(final["placement"]["stages"])
    measured = fleet.status()["measured"]
    assert {k.split("|")[1] for k in measured["calibrations"]} == {"node-a", "node-b"}
    for calibration in measured["calibrations"].values():
        assert calibration["age_s"] >= 0 and "engine" in calibration["versions"]
        assert "?" not in calibration["versions"], calibration  # read from the agent's facts

    # Applied again unchanged: nothing to place, nothing provisional, no wait.
    again = fleet.fleetctl("apply", str(fleet.root / "fleet.yaml"))
    assert "provisional" not in again.stdout and "no change" in again.stdout


def test_status_shows_predicted_beside_measured_decode_ms_per_token(fleet):
    from openai import OpenAI

    client = OpenAI(base_url=fleet.front_door_url, api_key="none", max_retries=0)
    for _ in range(3):
        client.chat.completions.create(model="demo", max_tokens=12,
                                       messages=[{"role": "user", "content": "Count."}],
                                       extra_body={"ignore_eos": True})

    def speed() -> dict | None:
        [replica] = [r for r in fleet.status()["replicas"] if r["state"] == "serving"]
        alone = (replica["speed"] or {}).get("measured", {}).get("1", {})
        return replica["speed"] if alone.get("rounds", 0) >= 20 else None

    shown = wait_until(speed, within_s=30, what="rank 0's decode rounds in status")
    assert shown["predicted_ms_per_token"] > 0 and shown["parallel"] == 2
    alone = shown["measured"]["1"]
    assert alone["ms_per_token"] > 0 and alone["predicted_ms_per_token"] == \
        shown["predicted_ms_per_token"]
    assert alone["error_pct"] == round((alone["predicted_ms_per_token"] - alone["ms_per_token"])
                                       / alone["ms_per_token"] * 100, 1)
    # The time to first token it predicts for the model's prompt length (here the context).
    assert shown["predicted_ttft_ms"] > 0 and shown["prompt_tokens"] == 512
    table = fleet.fleetctl("status").stdout
    assert "decode ms/token: predicted" in table and "measured" in table and "% off" in table
    assert "time to first token: predicted" in table and "prompt of 512 tokens" in table


def measured_again(fleet: LocalFleet, after: int) -> list[str]:
    return [e["message"] for e in events(fleet, after)
            if e["kind"] == "measure" and e["message"].startswith(("calibrated", "probed"))]


def test_a_restarted_supervisor_reuses_its_measurements(fleet):
    before = events(fleet)[-1]["seq"]
    assert fleet.stop_supervisor(signal.SIGTERM) == 0
    fleet.start_supervisor()
    reused = wait_until(lambda: [e["message"] for e in events(fleet, before)
                                 if e["message"].startswith("reusing")],
                        within_s=30, what="the restarted supervisor's reuse event")
    assert reused[0].startswith("reusing 2 calibration(s) and 1 link probe(s)"), reused
    replica = fleet.wait_replica("demo")
    status = fleet.status()
    # The loop has stepped with every member's facts (kept in the state) since it started:
    # a measurement it lacked would be running or done by now.
    assert status["measured"]["running"] == []
    assert measured_again(fleet, before) == []
    assert replica["speed"]["predicted_ms_per_token"] > 0


def calibrations_started(fleet: LocalFleet, node: str) -> int:
    """Calibration children the node's agent has started (one per measurement it took,
    none for an answer from its cache)."""
    log = (fleet.logs / f"agent-{node}.log").read_text(errors="replace").splitlines()
    return sum('"child started"' in line and '"calibration ' in line for line in log)


def test_remeasure_takes_every_measurement_again_past_the_agents_cache(fleet):
    before = events(fleet)[-1]["seq"]
    started = {n: calibrations_started(fleet, n) for n in ("node-a", "node-b")}
    figures = {k: c["decode_ms_per_layer"]
               for k, c in fleet.status()["measured"]["calibrations"].items()}
    done = fleet.fleetctl("--json", "remeasure")
    data = json.loads(done.stdout)
    assert data["nodes"] == ["node-a", "node-b"] and data["done"] is True
    assert {k.split("|")[1] for k in data["measuring"] if "|" in k} == {"node-a", "node-b"}
    assert "node-a -> node-b" in data["measuring"] or "node-b -> node-a" in data["measuring"]
    again = measured_again(fleet, before)
    assert len(again) == 3 and all(m.endswith("(measured again: asked by the operator)")
                                   for m in again), again
    # Each agent ran a calibration: its cache of calibrations did not answer for it.
    assert all(calibrations_started(fleet, n) == started[n] + 1 for n in started), started
    now = data["measured"]["calibrations"]  # timed again: no figure is the same to the bit
    assert all(now[k]["decode_ms_per_layer"] != ms for k, ms in figures.items()), (figures, now)
    assert fleet.wait_replica("demo")["id"]  # replicas keep serving where they were

    one = fleet.fleetctl("remeasure", "node-b")
    assert "|node-a|" not in one.stdout and "node-b|mlx-cpu" in one.stdout  # node-b's only
    assert "ms per layer for one row" in one.stdout and "rtt" in one.stdout
    unknown = fleet.fleetctl("remeasure", "node-z", check=False)
    assert unknown.returncode == 1 and "unknown node 'node-z'" in unknown.stderr


def test_measurements_older_than_the_max_age_are_taken_again(fleet):
    before = events(fleet)[-1]["seq"]
    started = calibrations_started(fleet, "node-a")
    assert fleet.stop_supervisor(signal.SIGTERM) == 0
    fleet.supervisor_flags = (*FLAGS, "--measurement-max-age-s", "0.01")
    fleet.start_supervisor()
    again = wait_until(lambda: (found := measured_again(fleet, before)) and len(found) >= 3
                       and found, within_s=60, what="every measurement taken again")
    assert all("(measured again: " in message and "s old (more than 0.01 s)" in message
               for message in again), again
    assert calibrations_started(fleet, "node-a") > started  # measured, not read from a cache

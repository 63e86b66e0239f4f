"""A model's `hop_transport: dist` through a real fleet (a supervisor and two agents as
processes on loopback, two torch-cpu stages): `plan` predicts gloo for both hops, the
engines set them up (the agents pass FLEET_HOP_TRANSPORT on), a request is answered, and
`status` shows the hops rank 0 reports; the link between the nodes was probed over gloo too."""

from __future__ import annotations

import json

import pytest

from supervisor.local import LocalFleet

pytestmark = pytest.mark.timeout(240)
FLEET = """version: 1
supervisor: {{address: "{address}", state_dir: "{state_dir}"}}
nodes:
  - {{name: node-a, labels: {{backend: torch-cpu}}}}
  - {{name: node-b, labels: {{backend: torch-cpu}}}}
models:
  - id: demo
    checkpoint: {checkpoint}
    backends: [torch-cpu]
    context: 256
    chunk: 64
    hop_transport: dist
    placement:
      - {{node: node-a, layers: "0:4"}}
      - {{node: node-b, layers: "4:8"}}
"""


def test_dist_between_two_torch_cpu_stages_runs_on_gloo_and_status_says_so(tmp_path, checkpoint):
    with LocalFleet(tmp_path, supervisor_flags=("--tick-s", "0.2", "--calibration-budget-s",
                                                "2", "--drain-s", "5"),
                    agent_settings=dict(heartbeat_interval_s=0.3)) as fleet:
        path = fleet.root / "fleet.yaml"
        path.write_text(FLEET.format(address=fleet.address, state_dir=fleet.state_dir,
                                     checkpoint=checkpoint))
        [plan] = json.loads(fleet.fleetctl("--json", "plan", str(path)).stdout)["plans"]
        assert [h["transport"] for h in plan["placement"]["hops"]] == ["gloo", "gloo"]
        assert "hops gloo,gloo" in fleet.fleetctl("plan", str(path)).stdout
        fleet.fleetctl("apply", str(path))
        fleet.wait_replica("demo", timeout_s=120)

        from openai import OpenAI

        client = OpenAI(base_url=fleet.front_door_url, api_key="none", max_retries=0)
        reply = client.chat.completions.create(
            model="demo", max_tokens=6, messages=[{"role": "user", "content": "Count."}])
        assert reply.choices[0].finish_reason in ("stop", "length")

        def hops() -> list | None:
            return next((r["hops"] for r in fleet.status()["replicas"]
                         if r["state"] == "serving"), None)

        fleet.wait(lambda: hops() == ["gloo", "gloo"], 30, "rank 0's gloo hops in status")
        assert "hops gloo,gloo" in fleet.fleetctl("status").stdout
        # The agents' probe measured the gloo path too, for placement to cost these hops by.
        def links() -> list[dict]:
            return list(fleet.status()["measured"]["links"].values())

        fleet.wait(lambda: any(isinstance(link, dict) for link in links()), 60, "the probe")
        [link] = links()
        assert link["dist_transport"] == "gloo" and link["dist_bandwidth_bytes_per_s"] > 0, link

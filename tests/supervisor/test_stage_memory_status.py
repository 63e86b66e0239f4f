"""Each stage's resident set against its weights in `fleetctl status`, from real processes.

A supervisor and two agents on loopback serve the demo checkpoint (a torch-cpu stage 0:4 with
the embeddings and head, an mlx-cpu stage 4:8). Each engine says its weights' bytes on its
`loaded` line, its agent samples its resident set at every heartbeat, and status shows both
per stage. The weights are checked against the checkpoint's own headers; the resident set,
once a request has touched every weight, is at least the weights.

node-b's agent is pinned to one CPU (`LocalFleet`'s `node_cpus`, which `bench/placement.py
--pin` uses to keep two nodes of one machine off each other's cores): its engine runs there
too, since a process inherits its parent's CPUs.
"""

from __future__ import annotations

import os

import psutil
import pytest

from engine.checkpoint.reader import open_checkpoint
from supervisor.local import LocalFleet
from supervisor.memory import format_bytes
from tests.supervisor.test_end_to_end import MODEL, chat, fleet_file
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(240)
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4}
NODE_B_CPUS = {max(os.sched_getaffinity(0))}  # one CPU, the last this process may use


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, checkpoint):
    with LocalFleet(tmp_path_factory.mktemp("fleet"), supervisor_flags=(
            "--tick-s", "0.2", "--calibration-budget-s", "0", "--drain-s", "10"),
            agent_settings=dict(heartbeat_interval_s=0.3),
            node_cpus={"node-b": NODE_B_CPUS}) as fleet:
        fleet.fleetctl("apply", str(fleet_file(fleet, checkpoint, "fleet.yaml")))
        fleet.wait_replica(MODEL)
        yield fleet


def stored_bytes(model_dir, layer_range: tuple[int, int]) -> int:
    """What the range's tensors take in the checkpoint (the first stage: with the embeddings,
    final norm and head), from the safetensors headers alone."""
    checkpoint = open_checkpoint(model_dir)
    layers = {f"model.layers.{i}." for i in range(*layer_range)}
    total = 0
    for name in checkpoint.tensor_names():
        in_layers = name.startswith("model.layers.")
        if (in_layers and any(name.startswith(p) for p in layers)) \
                or (not in_layers and layer_range[0] == 0):
            count = 1
            for size in checkpoint.tensor_shape(name):
                count *= size
            total += count * DTYPE_BYTES[checkpoint.tensor_dtype(name)]
    return total


def serving_stages(fleet: LocalFleet) -> list[dict]:
    [replica] = [r for r in fleet.status()["replicas"] if r["state"] == "serving"]
    return replica["stages"]


def test_status_shows_each_stage_resident_against_its_weights(fleet, checkpoint):
    chat(fleet, max_tokens=4)  # every weight read at least once: a dense stage's mmap paged in
    stages = wait_until(lambda: (s := serving_stages(fleet))
                        and all(st["resident_bytes"] and st["weights_bytes"] for st in s) and s,
                        within_s=30, what="every stage's memory reported")
    for stage in stages:
        layer_range = tuple(stage["layer_range"])
        assert stage["weights_bytes"] == stored_bytes(checkpoint, layer_range), stage
        assert stage["resident_bytes"] >= stage["weights_bytes"], stage
    shown = fleet.fleetctl("status").stdout
    assert "resident / weights" in shown
    for stage in stages:
        assert f"/ {format_bytes(stage['weights_bytes'])}" in shown, shown


def test_a_pinned_node_runs_its_engine_on_its_own_cpus(fleet):
    agent = psutil.Process(fleet.agents["node-b"].pid)
    engines = [p for p in agent.children(recursive=True) if "engine.main" in p.cmdline()]
    assert engines, "node-b's agent runs no engine"
    for process in (agent, *engines):
        assert set(process.cpu_affinity()) == NODE_B_CPUS
    other = psutil.Process(fleet.agents["node-a"].pid)
    assert set(other.cpu_affinity()) == os.sched_getaffinity(0)  # not pinned

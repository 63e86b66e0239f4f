"""An explicit stage's `backend:` wins over the node's `backend` label (and over the order of
the model's backends), and a refusal names the model once."""

from __future__ import annotations

import argparse

from engine.checkpoint.maker import PRESETS, config_json
from supervisor.fleet_config import parse_fleet_config
from supervisor.fleetctl import show_apply
from supervisor.membership import ALIVE, Member
from supervisor.memory import model_shape_from_config
from supervisor.planning import candidates, plan_model

SHAPE = model_shape_from_config(config_json(PRESETS["demo"]), 2)
FLEET = parse_fleet_config("""
version: 1
supervisor: {address: "127.0.0.1:7400", state_dir: /tmp/x}
nodes:
  - {name: a, labels: {backend: torch-cpu}}
  - {name: b, labels: {backend: torch-cpu}}
models:
  - id: m
    checkpoint: /m
    backends: [torch-cpu, mlx-cpu]
    context: 256
    placement:
      - {node: a, layers: "0:4"}
      - {node: b, layers: "4:8", backend: mlx-cpu}
""")


def member(name: str, *backends: str) -> Member:
    facts = {"backends": [{"backend": b, "present": True,
                           "devices": [{"memory_usable_bytes": 8 << 30}]} for b in backends]}
    return Member(name, "https://127.0.0.1:1", ALIVE, 0.0, 0.0, facts, "d")


def test_an_explicit_backend_wins_over_the_nodes_label():
    members = {"a": member("a", "torch-cpu", "mlx-cpu"), "b": member("b", "torch-cpu", "mlx-cpu")}
    spec = FLEET.model("m")
    assert [(m.node, backend) for m, backend in candidates(spec, FLEET, members)] == \
        [("a", "torch-cpu"), ("b", "mlx-cpu")]
    plan = plan_model(spec, SHAPE, FLEET, members)
    assert plan.error == ""
    assert [(s.node, s.backend, s.layer_range) for s in plan.placement.stages] == \
        [("a", "torch-cpu", (0, 4)), ("b", "mlx-cpu", (4, 8))]


def test_a_backend_the_node_lacks_is_refused_naming_the_model_once(capsys):
    members = {"a": member("a", "torch-cpu"), "b": member("b", "torch-cpu")}
    plan = plan_model(FLEET.model("m"), SHAPE, FLEET, members)
    assert plan.placement is None and "explicit stage on b asks backend mlx-cpu" in plan.error
    args = argparse.Namespace(json=False, command="plan")
    assert show_apply(args, {"plans": [{"model": "m", "error": plan.error}]}) == 1
    shown = capsys.readouterr().err
    assert shown.startswith("m: explicit stage on b") and shown.count("m: ") == 1, shown

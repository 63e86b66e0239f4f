"""A model's hop transport from fleet.yaml to the engine's environment, and the hops the
supervisor shows: predicted in a plan (the engine's own choice), reported by rank 0 in status."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from agent.spawn import SpawnRefused, SpawnRequest
from engine.env import EngineEnv
from supervisor.fleet_config import FleetConfigError, diff, parse_fleet_config
from supervisor.fleetctl import render_plan
from supervisor.hops import planned_hops, predicted_hops, reported_hops
from supervisor.placement import place
from supervisor.planning import spec_digest
from tests.supervisor.test_fleet_config import ONE_MODEL
from tests.supervisor.test_placement import SHAPE, mesh, node, spec


def test_fleet_yaml_sets_a_models_hop_transport_and_auto_keeps_the_digest():
    unset, auto, dist = (parse_fleet_config(ONE_MODEL % extra).model("m")
                         for extra in ("", "    hop_transport: auto\n",
                                       "    hop_transport: dist\n"))
    assert (unset.hop_transport, auto.hop_transport, dist.hop_transport) == ("auto", "auto",
                                                                              "dist")
    # Specs written before the field existed keep their digest (no replica is replaced).
    assert spec_digest(unset) == spec_digest(auto) != spec_digest(dist)
    assert diff(parse_fleet_config(ONE_MODEL % ""), parse_fleet_config(
        ONE_MODEL % "    hop_transport: dist\n")) == ["model m: hop_transport auto -> dist"]
    with pytest.raises(FleetConfigError, match=r":8: models\[0\]\.hop_transport: unknown hop "
                                               r"transport 'nccl' \(expected one of auto, tcp, "
                                               r"dist\)"):
        parse_fleet_config(ONE_MODEL % "    hop_transport: nccl\n")


def test_a_spawn_request_carries_the_hop_transport_into_the_engines_environment():
    def engine_env(**variables: str) -> EngineEnv:
        env = {"FLEET_MODEL": "/m", "FLEET_PLACEMENT": "0-4@torch-cpu,4-8@torch-cpu"}
        return SpawnRequest.from_dict({"engine_id": "e", "env": env | variables}).spec(5.0).engine

    dist = engine_env(FLEET_HOP_TRANSPORT="dist")
    assert dist.hop_transport == "dist"
    assert dist.to_environ()["FLEET_HOP_TRANSPORT"] == "dist"
    assert engine_env().hop_transport == "auto"
    with pytest.raises(SpawnRefused) as refused:
        engine_env(FLEET_HOP_TRANSPORT="nccl")
    assert refused.value.field == "FLEET_HOP_TRANSPORT"


def test_predicted_hops_follow_the_engines_choice():
    assert [h["transport"] for h in predicted_hops("dist", ["torch-cpu", "torch-cpu"])] == [
        "gloo", "gloo"]
    assert [h["transport"] for h in predicted_hops("dist", ["torch-cpu", "mlx-cpu"])] == [
        "tcp", "tcp"]
    assert [h["transport"] for h in predicted_hops("dist", ["torch-cuda"] * 3)] == ["nccl"] * 3
    held = predicted_hops("auto", ["torch-cuda", "torch-cuda"])
    assert [h["transport"] for h in held] == ["tcp", "tcp"] and "opt-in" in held[0]["why"]
    assert [h["transport"] for h in predicted_hops("tcp", ["torch-cuda"] * 2)] == ["tcp"] * 2
    assert predicted_hops("dist", ["torch-cpu"]) == []  # one stage: no hop


def test_plan_renders_each_hops_predicted_transport():
    nodes = mesh([node("a", 500, decode=1.0), node("b", 500, decode=0.2)], rtt_ms=0.5)
    p = place(spec(rank0="a"), SHAPE, nodes)
    assert [s.backend for s in p.stages] == ["torch-cpu", "torch-cpu"]
    sent = json.loads(json.dumps(planned_hops(p.to_dict(), "dist")))
    assert [h["transport"] for h in sent["hops"]] == ["gloo", "gloo"]
    console = Console(record=True, width=250)
    console.print(render_plan(sent))
    assert "hops gloo,gloo (FLEET_HOP_TRANSPORT=dist between CPU stages)" in console.export_text()


def test_reported_hops_are_rank0s_or_none():
    assert reported_hops({"status": "ok", "hops": ["tcp", "gloo"]}) == ["tcp", "gloo"]
    for body in (None, {}, {"hops": []}, {"hops": "tcp"}, {"hops": [1]}):
        assert reported_hops(body) is None

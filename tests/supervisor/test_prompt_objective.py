"""The prompt objective: the prompt length placement costs comes from fleet.yaml (else the
context); the predicted time to first token shows in `fleetctl plan` and `fleetctl status`."""

from __future__ import annotations

from dataclasses import replace

import pytest
from rich.console import Console

from supervisor.fleet_config import parse_fleet_config
from supervisor.fleetctl import render_plan, speed_line
from supervisor.placement import place
from supervisor.planning import plan_model
from supervisor.speed import predict, speed_report
from tests.supervisor.test_measurements import FLEET, SHAPE, SPEC
from tests.supervisor.test_placement import brute_force, mesh, node
from tests.supervisor.test_speed import MEASURED, MEMBERS, layout_of

YAML = """version: 1
supervisor: {address: "10.0.0.1:7400", state_dir: /tmp/state}
nodes: [{name: a}, {name: b}]
models:
  - {id: m, checkpoint: /m, context: 8000, chunk: 500, objective: prompt%s}
"""


def test_the_prompt_length_comes_from_fleet_yaml_else_the_context():
    [configured] = parse_fleet_config(YAML % ", prompt_tokens: 2000").models
    [default] = parse_fleet_config(YAML % "").models
    assert (configured.prompt_length, default.prompt_length) == (2000, 8000)
    nodes = mesh([node("a", 500, prefill=10.0), node("b", 500, prefill=4.0)], rtt_ms=0.5)
    for spec, chunks in ((configured, 4), (default, 16)):
        p = place(spec, SHAPE, nodes)
        assert p.prompt_tokens == spec.prompt_length and p.objective == "prompt"
        assert p.prompt_ms == pytest.approx(brute_force(spec, SHAPE, nodes, spec.prompt_length))
        # (chunks - 1) x the slowest stage or hop on top of one pass through the ring.
        stages = [s.prefill_chunk_ms for s in p.stages]
        hops = [s.hop_chunk_ms for s in p.stages]
        assert p.prompt_ms == pytest.approx(sum(stages) + sum(hops)
                                            + (chunks - 1) * max(stages + hops))


def test_plan_and_status_show_the_predicted_time_to_first_token():
    spec = replace(SPEC, objective="prompt", prompt_tokens=SPEC.chunk * 3)
    placement = plan_model(spec, SHAPE, FLEET, MEMBERS, MEASURED).placement
    console = Console(record=True, width=250)
    console.print(render_plan(placement.to_dict()))
    assert (f"time to first token of a {spec.chunk * 3}-token prompt: "
            f"{placement.prompt_ms:.0f} ms; objective: prompt") in console.export_text()

    predicted = predict(spec, SHAPE, FLEET, MEMBERS, MEASURED, layout_of(placement))
    assert predicted.prompt_ms == placement.prompt_ms  # the same model, the same layout
    speed = speed_report(predicted, {1: (0.5, 100)})
    assert speed["predicted_ttft_ms"] == round(placement.prompt_ms, 3)
    assert speed["prompt_tokens"] == spec.chunk * 3
    line = speed_line(speed)
    assert f"time to first token: predicted {placement.prompt_ms:.0f} ms for a prompt of " \
           f"{spec.chunk * 3} tokens" in line and "decode ms/token: predicted" in line

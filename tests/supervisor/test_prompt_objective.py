"""The prompt objective: the prompt length placement costs comes from fleet.yaml (else the
context); the predicted time to first token shows in `fleetctl plan` and `fleetctl status`;
a hybrid's search over rings and gaps of caps (supervisor/prompt_search.py) finds what a
brute force over every ring and boundary finds, and what searching every ring to its end
reports (runner-up, nodes left out); a Qwen3.5-27B-shaped 64-layer fleet places."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from rich.console import Console

from engine.checkpoint.maker import CheckpointSpec, config_json
from supervisor.fleet_config import BACKENDS, parse_fleet_config
from supervisor.fleetctl import render_plan, speed_line
from supervisor.memory import model_shape_from_config
from supervisor.placement import DoesNotFit, LayerTypeMs, _rings, place
from supervisor.planning import plan_model
from supervisor.prompt_search import search_prompt_rings
from supervisor.ring_cost import RingCosts
from supervisor.speed import predict, speed_report
from tests.supervisor.test_measurements import FLEET, SHAPE, SPEC
from tests.supervisor.test_placement import brute_force, check_valid, mesh, node, spec
from tests.supervisor.test_placement_by_layer_type import hybrid, random_hybrid_case, typed
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
    for model, chunks in ((configured, 4), (default, 16)):
        p = place(model, SHAPE, nodes)
        assert p.prompt_tokens == model.prompt_length and p.objective == "prompt"
        assert p.prompt_ms == pytest.approx(brute_force(model, SHAPE, nodes, model.prompt_length))
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


def answers(results) -> tuple:
    """What `place` reports from ring results: the best's cost, the runner-up's (another node
    set or rank 0), and per node the best leaves out, the best ring with it."""
    results = sorted(results, key=lambda r: r.rank)
    best = results[0]
    same = (best.nodes[0], frozenset(best.nodes))
    runner = next((r.objective_ms for r in results
                   if (r.nodes[0], frozenset(r.nodes)) != same), None)
    names = {n for r in results for n in r.nodes} - set(best.nodes)
    return (best.objective_ms, runner,
            {n: next(r.objective_ms for r in results if n in r.nodes) for n in sorted(names)})


@pytest.mark.parametrize("seed", range(6))
def test_the_hybrid_prompt_search_equals_a_brute_force_on_random_fleets(seed: int):
    rng = random.Random(5000 + seed)
    placed = 0
    for _ in range(40):
        s, shape, nodes = random_hybrid_case(rng)
        # 1 to 40 chunks: one chunk is the least sum; few make the bounds loose; many make
        # the slowest stage all that counts.
        s = replace(s, objective="prompt", prompt_tokens=s.chunk * rng.choice([1, 2, 3, 8, 40]))
        expected = brute_force(s, shape, nodes, s.prompt_length)
        try:
            p = place(s, shape, nodes)
        except DoesNotFit:
            assert expected is None, (s, shape, nodes)
            continue
        placed += 1
        assert p.prompt_ms == pytest.approx(expected, rel=1e-9, abs=1e-9), (s, shape, nodes)
        check_valid(p, s, shape, nodes)
        # What it reports beside the best is what searching every ring to its end reports.
        names = [n.name for n in nodes if n.backend in s.backends]
        rings = list(_rings([s.rank0] if s.rank0 else names, names))
        problem = RingCosts(s, shape, nodes, s.prompt_length)
        every = [r for ring in rings if (r := problem.ring_result(ring)) is not None]
        searched, fitting = search_prompt_rings(problem, rings)
        assert fitting == len(every)
        got = answers([problem.result_for(ring, counts) for ring, counts in searched])
        best, runner, left_out = answers(every)
        assert got[0] == pytest.approx(best) and got[2] == pytest.approx(left_out)
        assert got[1] == (None if runner is None else pytest.approx(runner))
    assert placed >= 10


@pytest.mark.parametrize("seed", range(3))
def test_the_hybrid_prompt_search_equals_a_brute_force_on_longer_models(seed: int):
    # 6 to 16 layers give each ring hundreds of caps to search, where few layers give few.
    rng = random.Random(7000 + seed)
    placed = 0
    for _ in range(50):
        shape = hybrid(rng.randint(6, 16), interval=rng.choice([2, 3, 4]))
        names = [f"n{i}" for i in range(rng.randint(2, 3))]
        nodes = [typed(node(name, rng.uniform(40, 300), prefill=rng.uniform(1.0, 40.0),
                            peers={p: (rng.uniform(0.0, 2.0), rng.uniform(1e7, 1e9))
                                   for p in names if p != name}), rng) for name in names]
        s = spec(objective="prompt", backends=BACKENDS,
                 prompt_tokens=100 * rng.choice([2, 3, 4, 8, 10]))
        expected = brute_force(s, shape, nodes, s.prompt_length)
        try:
            got = place(s, shape, nodes).prompt_ms
        except DoesNotFit:
            assert expected is None
            continue
        placed += 1
        assert got == pytest.approx(expected, rel=1e-9, abs=1e-9), (s, shape, nodes)
    assert placed >= 20


def test_a_qwen3_5_27b_shaped_model_places_on_four_and_six_nodes():
    # Qwen3.5-27B's text model: 64 layers, every 4th full attention, bfloat16.
    checkpoint = CheckpointSpec(family="qwen3_5", hidden_size=5120, intermediate_size=17408,
                                num_hidden_layers=64, num_attention_heads=24,
                                num_key_value_heads=4, head_dim=256, vocab_size=248320,
                                linear_num_key_heads=16, linear_num_value_heads=48,
                                linear_key_head_dim=128, linear_value_head_dim=128,
                                dtype="bfloat16")
    shape = model_shape_from_config(config_json(checkpoint), 2)
    assert shape.n_layers == 64 and not shape.is_uniform
    rng = random.Random(27)
    nodes = mesh([replace(node(f"n{i}", rng.uniform(16_000, 40_000),
                               prefill=rng.uniform(40.0, 200.0)),
                          layer_type_ms=(LayerTypeMs("full_attention", rng.uniform(1.0, 3.0),
                                                     rng.uniform(1.5, 4.0),
                                                     rng.uniform(60.0, 300.0)),))
                  for i in range(6)], rtt_ms=0.3, bandwidth=1.2e9)
    for count, chunks in ((4, 3), (4, 16), (6, 16)):
        s = replace(SPEC, objective="prompt", context=32768, parallel=1, chunk=2048,
                    prompt_tokens=2048 * chunks, backends=("torch-cpu",))
        p = place(s, shape, nodes[:count])
        check_valid(p, s, shape, nodes[:count])
        assert len(p.stages) >= 2  # no one node holds the model's ~54 GB
        assert f"ring orders over {count} node(s)" in p.why[0]
        stages = [st.prefill_chunk_ms for st in p.stages]
        hops = [st.hop_chunk_ms for st in p.stages]
        assert p.prompt_ms == pytest.approx(sum(stages) + sum(hops)
                                            + (chunks - 1) * max(stages + hops))
        if count == 4:  # every ring searched to its end finds nothing better
            problem = RingCosts(s, shape, nodes[:count], s.prompt_length)
            names = [n.name for n in nodes[:count]]
            every = [r for ring in _rings(names, names)
                     if (r := problem.ring_result(ring)) is not None]
            assert min(r.objective_ms for r in every) == pytest.approx(p.prompt_ms)


def test_place_keeps_its_answers_for_the_same_inputs_only():
    from supervisor.placement import forget_placements

    nodes = mesh([node("a", 500, prefill=10.0), node("b", 500, prefill=4.0)], rtt_ms=0.5)
    spec_ = replace(SPEC, objective="prompt")
    first = place(spec_, SHAPE, nodes)
    assert place(spec_, SHAPE, list(nodes)) is first  # equal inputs: the answer kept
    longer = place(replace(spec_, prompt_tokens=spec_.chunk * 7), SHAPE, nodes)
    assert longer is not first and longer.prompt_tokens == spec_.chunk * 7
    slower = [replace(nodes[1], prefill_ms_per_layer=40.0), nodes[0]]
    assert place(spec_, SHAPE, slower).prompt_ms != first.prompt_ms
    forget_placements()
    again = place(spec_, SHAPE, nodes)
    assert again is not first and again == first
    with pytest.raises(DoesNotFit) as one:  # a refusal is kept too, and raised afresh
        place(spec_, SHAPE, [replace(n, usable_memory_bytes=1000) for n in nodes])
    with pytest.raises(DoesNotFit) as two:
        place(spec_, SHAPE, [replace(n, usable_memory_bytes=1000) for n in nodes])
    assert str(one.value) == str(two.value) and two.value.shortfall_bytes > 0

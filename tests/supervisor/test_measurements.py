"""From an agent's calibration and probes to placement inputs: timings per spec, links used
both ways, and every nominal input named in the plan."""

from __future__ import annotations

import pytest

from engine.checkpoint.maker import PRESETS, CheckpointSpec, config_json
from supervisor.fleet_config import parse_fleet_config
from supervisor.measurements import Measured, NodeTiming, timing_from_result, timing_key
from supervisor.membership import ALIVE, Member
from supervisor.memory import model_shape_from_config
from supervisor.placement import LayerTypeMs, LinkSnapshot, NodeSnapshot
from supervisor.planning import plan_model

FLEET = parse_fleet_config("""
version: 1
supervisor: {address: "127.0.0.1:7400", state_dir: /tmp/x}
nodes: [{name: a}, {name: b}]
models:
  - {id: m, checkpoint: /m, backends: [torch-cpu, mlx-cpu], context: 1024, parallel: 4,
     chunk: 64}
""")
SPEC = FLEET.model("m")
SHAPE = model_shape_from_config(config_json(PRESETS["demo"]), 2)


def point(kind: str, context: int, rows: int, ms: float) -> dict:
    return {"kind": kind, "context": context, "rows": rows, "ms_per_layer": ms, "runs": 3,
            "spread_ms": 0.1}


def member(name: str, backend: str) -> Member:
    facts = {"backends": [{"backend": backend, "present": True,
                           "devices": [{"memory_usable_bytes": 8 << 30}]}]}
    return Member(name, "https://127.0.0.1:1", ALIVE, 0.0, 0.0, facts, "d")


def test_timing_picks_the_spec_points():
    result = {"timings": [point("decode", 512, 1, 9.0), point("decode", 1024, 1, 2.0),
                          point("decode", 1024, 4, 3.0), point("prefill", 1024, 64, 40.0)]}
    assert timing_from_result(result, SPEC) == NodeTiming(2.0, 3.0, 40.0)
    with pytest.raises(ValueError, match="4 row"):
        timing_from_result({"timings": [point("decode", 1024, 1, 2.0),
                                        point("prefill", 1024, 64, 1.0)]}, SPEC)


def test_a_link_measured_one_way_serves_both():
    measured = Measured(links={("a", "b"): LinkSnapshot("b", 0.3, 1e9)})
    assert measured.link("b", "a") == LinkSnapshot("a", 0.3, 1e9)
    assert measured.link("a", "c") is None


def test_measured_numbers_drive_the_placement_and_guesses_are_named():
    members = {"a": member("a", "torch-cpu"), "b": member("b", "mlx-cpu")}
    nominal = plan_model(SPEC, SHAPE, FLEET, members)
    assert any("not calibrated, nominal ms per layer: a, b" in w for w in nominal.placement.why)
    assert any("not probed" in w for w in nominal.placement.why)
    fast_b = Measured(timings={timing_key(SPEC, "a", "torch-cpu"): NodeTiming(9.0, 9.0, 90.0),
                               timing_key(SPEC, "b", "mlx-cpu"): NodeTiming(1.0, 1.0, 10.0)},
                      links={("a", "b"): LinkSnapshot("b", 0.2, 1e9)})
    plan = plan_model(SPEC, SHAPE, FLEET, members, fast_b)
    assert plan.placement.ring == ("b",)  # b alone is fastest: no hop, fewer ms per layer
    assert not any("nominal" in w for w in plan.placement.why)
    failed = Measured(timings={timing_key(SPEC, "a", "torch-cpu"): "calibration failed: x"})
    assert any("a (calibration failed: x)" in w
               for w in plan_model(SPEC, SHAPE, FLEET, members, failed).placement.why)


def test_a_hybrid_calibration_is_planned_per_layer_type():
    def typed(layer_type: str, scale: float) -> list[dict]:
        return [dict(point(kind, 1024, rows, ms * scale), layer_type=layer_type)
                for kind, rows, ms in (("decode", 1, 1.0), ("decode", 4, 2.0),
                                       ("prefill", 64, 10.0))]

    result = {"timings": typed("linear_attention", 1.0) + typed("full_attention", 3.0)}
    timing = timing_from_result(result, SPEC)
    assert timing.by_type == (LayerTypeMs("linear_attention", 1.0, 2.0, 10.0),
                              LayerTypeMs("full_attention", 3.0, 6.0, 30.0))
    assert (timing.decode_ms_per_layer, timing.prefill_ms_per_layer) == (3.0, 30.0)
    with pytest.raises(ValueError, match="full_attention decode point at 4 row"):
        timing_from_result({"timings": typed("linear_attention", 1.0)
                            + [t for t in typed("full_attention", 1.0) if t["rows"] != 4]}, SPEC)
    cs = CheckpointSpec(family="qwen3_5", hidden_size=64, intermediate_size=96,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        num_hidden_layers=8, vocab_size=300)
    shape = model_shape_from_config(config_json(cs), 2)
    members = {"a": member("a", "torch-cpu")}
    plan = plan_model(SPEC, shape, FLEET, members,
                      Measured(timings={timing_key(SPEC, "a", "torch-cpu"): timing}))
    (stage,) = plan.placement.stages
    assert dict(stage.layer_type_counts) == {"linear_attention": 6, "full_attention": 2}
    assert stage.decode_ms == pytest.approx(6 * 2.0 + 2 * 6.0)  # 4 streams: the batch times
    assert stage.prefill_chunk_ms == pytest.approx(6 * 10.0 + 2 * 30.0)
    assert stage.memory.state_bytes > 0


def test_the_mean_chunk_is_the_mean_of_the_chunks_a_prompt_runs():
    """Against the chunks themselves: for any cost linear in a chunk's start, the chunk that
    ends at mean_chunk_end costs the mean of ceil(prompt / chunk) chunks (within half a row
    where chunk x (chunks - 1) is odd)."""
    import math

    from supervisor.measurements import mean_chunk_end

    for prompt in (1, 63, 64, 65, 1000, 1792, 2048, 4097):
        for chunk in (1, 7, 64, 256, 512):
            chunks = math.ceil(prompt / chunk)
            starts = [i * chunk for i in range(chunks)]
            end = mean_chunk_end(prompt, chunk)
            assert abs((end - chunk) - sum(starts) / chunks) <= 0.5
            assert chunk <= end <= chunks * chunk


def test_the_calibration_times_the_prompt_placement_costs():
    """The body asks for the prompt's mean chunk, and a new prompt length is a new key (its
    chunk is timed elsewhere), where the rest of the spec is the same."""
    from dataclasses import replace

    from supervisor.measurements import calibration_body, mean_chunk_end

    body = calibration_body({}, SPEC, "torch-cpu", 10.0)
    assert (body["chunk_rows"], body["prefill_end"]) == (64, mean_chunk_end(1024, 64)) == \
        (64, 544)
    shorter = replace(SPEC, prompt_tokens=256)
    assert calibration_body({}, shorter, "torch-cpu", 10.0)["prefill_end"] == 160
    assert timing_key(shorter, "a", "torch-cpu") != timing_key(SPEC, "a", "torch-cpu")


def test_host_work_is_read_from_the_calibration_and_kept_in_the_state():
    """The round's and the hop's points become the node's round and hop ms; a calibration
    from before they were timed, or a state record from before they were kept, reads 0."""
    from dataclasses import asdict, replace

    from supervisor.measuring import stored_timing

    layers = [point("decode", 1024, 1, 2.0), point("decode", 1024, 4, 3.0),
              point("prefill", 1024, 64, 20.0)]
    host = [point("round", 1024, 1, 0.4), dict(point("hop", 0, 1, 0.1), layer_type="hop")]
    timing = timing_from_result({"timings": layers + host}, SPEC)
    assert (timing.decode_ms_per_layer, timing.round_ms, timing.hop_ms) == (2.0, 0.4, 0.1)
    assert timing.by_type == ()  # neither is a layer type, nor a decode point
    old = timing_from_result({"timings": layers}, SPEC)
    assert (old.round_ms, old.hop_ms) == (0.0, 0.0)
    kept = replace(timing, head_ms=7.0, head_batch_ms=11.0)
    assert stored_timing(asdict(kept)) == kept
    older = {k: v for k, v in asdict(kept).items()
             if k not in ("head_ms", "head_batch_ms", "round_ms", "hop_ms")}
    assert stored_timing(older) == NodeTiming(2.0, 3.0, 20.0)


def test_rank0s_head_is_read_from_the_calibration_and_costed_once_a_round():
    """The head's points become the node's head ms at 1 and `parallel` rows (0 where a
    calibration predates them); a ring's decode round is its stages, its hops and its rank
    0's head, whoever else is in the ring."""
    from dataclasses import replace

    from supervisor.ring_cost import RingCosts

    layers = [point("decode", 1024, 1, 2.0), point("decode", 1024, 4, 3.0),
              point("prefill", 1024, 64, 20.0)]
    heads = [dict(point("head", 0, 1, 7.0), layer_type="head"),
             dict(point("head", 0, 4, 11.0), layer_type="head")]
    timing = timing_from_result({"timings": layers + heads}, SPEC)
    assert (timing.decode_ms_per_layer, timing.head_ms, timing.head_batch_ms) == (2.0, 7.0, 11.0)
    assert timing.by_type == ()  # the head is no layer type
    old = timing_from_result({"timings": layers}, SPEC)
    assert (old.head_ms, old.head_batch_ms) == (0.0, 0.0)

    a = NodeSnapshot("a", 8 << 30, "torch-cpu", 2.0, 3.0, 20.0,
                     (LinkSnapshot("b", 1.0, 1e9),), head_ms=7.0, head_batch_ms=11.0)
    b = replace(a, name="b", links=(LinkSnapshot("a", 1.0, 1e9),), head_ms=1.0,
                head_batch_ms=2.0)
    costs = RingCosts(SPEC, SHAPE, [a, b], SPEC.prompt_length)
    hops = sum(costs.hops_ms(("a", "b"), 1))
    n = SHAPE.n_layers
    # One stream: one round goes round, paying rank 0's head once, whichever node that is.
    assert costs.decode_ms(("a", "b"), (2, n - 2), 1) == pytest.approx(2.0 * n + hops + 7.0)
    assert costs.decode_ms(("b", "a"), (2, n - 2), 1) == pytest.approx(2.0 * n + hops + 1.0)
    assert costs.decode_ms(("a",), (n,), 1) == pytest.approx(2.0 * n + 7.0)
    # One stage and 4 streams: one round of 4 rows, the head at 4 rows. (Several stages
    # keep several rounds in flight: tests/supervisor/test_decode_groups.py.)
    assert costs.decode_ms(("a",), (n,), 4) == pytest.approx(3.0 * n + 11.0)

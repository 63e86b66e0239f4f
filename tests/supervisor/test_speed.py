"""A replica's decode speed: the prediction for the layout it runs is the placement's own
number for that layout, and rank 0's decode-round histogram reads back as measured ms per
token, beside the prediction with its error."""

from __future__ import annotations

from engine.api.metrics import EngineMetrics
from supervisor.measurements import Measured, NodeTiming, timing_key
from supervisor.placement import LinkSnapshot
from supervisor.planning import plan_model
from supervisor.speed import Predicted, decode_rounds, predict, speed_report
from tests.supervisor.test_measurements import FLEET, SHAPE, SPEC, member

MEMBERS = {"a": member("a", "torch-cpu"), "b": member("b", "mlx-cpu")}
MEASURED = Measured(timings={timing_key(SPEC, "a", "torch-cpu"): NodeTiming(2.0, 3.0, 40.0),
                             timing_key(SPEC, "b", "mlx-cpu"): NodeTiming(1.5, 2.5, 30.0)},
                    links={("a", "b"): LinkSnapshot("b", 0.4, 1e8)})


def layout_of(placement) -> tuple:
    return tuple((s.node, s.backend, s.layer_range) for s in placement.stages)


def test_the_prediction_for_a_placed_layout_is_the_placements_own():
    placement = plan_model(SPEC, SHAPE, FLEET, MEMBERS, MEASURED).placement
    got = predict(SPEC, SHAPE, FLEET, MEMBERS, MEASURED, layout_of(placement))
    assert isinstance(got, Predicted)
    assert got.single_ms == placement.decode_ms_per_token_single
    assert got.parallel_ms == placement.decode_ms_per_token
    assert got.parallel == 4 and got.nominal == ()


def test_any_layout_is_costed_stage_by_stage_and_hop_by_hop():
    layout = (("b", "mlx-cpu", (0, 3)), ("a", "torch-cpu", (3, 8)))
    got = predict(SPEC, SHAPE, FLEET, MEMBERS, MEASURED, layout)
    hop_ms = 0.4 / 2 + SHAPE.row_bytes / 1e8 * 1000  # one row each way, rtt/2 + transfer
    assert abs(got.single_ms - (3 * 1.5 + 5 * 2.0 + 2 * hop_ms)) < 1e-9
    nominal = predict(SPEC, SHAPE, FLEET, MEMBERS, Measured(), layout)
    assert any("not calibrated" in line for line in nominal.nominal)


def test_no_prediction_names_why():
    assert "c" in predict(SPEC, SHAPE, FLEET, MEMBERS, MEASURED, (("c", "torch-cpu", (0, 8)),))
    wrong_backend = predict(SPEC, SHAPE, FLEET, MEMBERS, MEASURED, (("a", "mlx-cpu", (0, 8)),))
    assert "another backend" in wrong_backend
    gap = predict(SPEC, SHAPE, FLEET, MEMBERS, MEASURED,
                  (("a", "torch-cpu", (0, 3)), ("b", "mlx-cpu", (4, 8))))
    assert "contiguous" in gap


def test_rank0_decode_rounds_read_back_from_its_metrics_text():
    metrics = EngineMetrics(lambda: 0, lambda: 0)
    for seconds in (0.010, 0.012, 0.014):
        metrics.round_done(decode_rows=1, seconds=seconds)
    metrics.round_done(decode_rows=4, seconds=0.040)
    metrics.round_done(decode_rows=0, seconds=9.0)  # a prompt round: not decode
    rounds = decode_rounds(metrics.render().decode())
    assert set(rounds) == {1, 4}
    assert rounds[1][1] == 3 and abs(rounds[1][0] - 0.036) < 1e-9
    report = speed_report(Predicted(11.0, 44.0, 4), rounds)
    assert report["measured"]["1"] == {"ms_per_token": 12.0, "rounds": 3,
                                       "predicted_ms_per_token": 11.0, "error_pct": -8.3}
    assert report["measured"]["4"]["error_pct"] == 10.0
    assert speed_report("no snapshot of c", {})["no_prediction"] == "no snapshot of c"

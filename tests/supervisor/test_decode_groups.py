"""Decode pricing with rounds in flight: the groups are the lane host's, a period is the
slowest of trip, stage work and link work, and the search of caps finds brute force's best
cut on random problems."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from engine.pipeline.round_builder import decode_groups
from supervisor.boundaries import min_total_ms
from supervisor.decode_groups import groups_for, period_ms, rows_ms, search_cap
from supervisor.ring_cost import PlacementError, RingCosts
from tests.supervisor.test_placement import SHAPE, mesh, node, spec


def test_groups_are_the_round_builders_one_round_per_stage():
    assert groups_for(1, 3) == (1,)
    assert groups_for(2, 1) == (2,)
    assert groups_for(2, 2) == (1, 1)
    assert groups_for(3, 2) == (2, 1)
    assert groups_for(5, 4) == decode_groups(5, 4) == (2, 2, 1)


def test_rows_between_the_calibrated_ones_are_on_their_line():
    assert rows_ms(2.0, 5.0, 4, 1) == 2.0
    assert rows_ms(2.0, 5.0, 4, 4) == 5.0
    assert rows_ms(2.0, 5.0, 4, 2) == pytest.approx(3.0)
    assert rows_ms(2.0, 5.0, 1, 1) == 2.0


def test_period_is_the_slowest_of_trip_stage_and_link():
    assert period_ms(10.0, [4.0, 6.0], [1.0, 1.0]) == 10.0
    assert period_ms(10.0, [4.0, 12.0], [1.0, 1.0]) == 12.0
    assert period_ms(3.0, [2.0, 2.0], [5.0, 1.0]) == 5.0


def test_three_streams_on_two_stages_by_hand():
    # Groups of 2 and 1 rows. Node a (rank 0): 1 ms a layer at 1 row, 1.6 at 2 rows; b: 2
    # and 2.4. a holds 5 layers, b 3; the head 0.5 / 0.9 ms; links free.
    a = dataclasses.replace(node("a", 500, decode=1.0, batch=1.6), head_ms=0.5,
                            head_batch_ms=0.9)
    b = node("b", 500, decode=2.0, batch=2.4)
    nodes = mesh([a, b], rtt_ms=0.0, bandwidth=1e15)
    s = spec(parallel=3)
    problem = RingCosts(s, SHAPE, nodes, 100)
    at2 = {"a": 1.0 + 0.6 / 2, "b": 2.0 + 0.4 / 2}  # 2 rows: on the line from 1 to 3 rows
    head2 = 0.5 + 0.4 / 2
    trip = 5 * at2["a"] + 3 * at2["b"] + head2
    work_a = 5 * (at2["a"] + 1.0) + head2 + 0.5
    work_b = 3 * (at2["b"] + 2.0)
    assert problem.decode_ms(("a", "b"), (5, 3), 3) == pytest.approx(max(trip, work_a, work_b))
    # One stream: the plain trip at one row.
    assert problem.decode_ms(("a", "b"), (5, 3), 1) == pytest.approx(5 * 1.0 + 3 * 2.0 + 0.5)


def test_host_work_is_paid_by_every_stage_each_round_and_at_every_boundary():
    # As above, with host work beyond the layers: a round costs a 0.3 ms on a and 0.7 on b,
    # a hop's end 0.2 ms on a and 0.6 on b (a hop between them: half of each, 0.4); the
    # links' wire time free. A split ring crosses two boundaries, a -> b and b -> a.
    a = dataclasses.replace(node("a", 500, decode=1.0, batch=1.6), head_ms=0.5,
                            head_batch_ms=0.9, round_ms=0.3, hop_ms=0.2)
    b = dataclasses.replace(node("b", 500, decode=2.0, batch=2.4), round_ms=0.7, hop_ms=0.6)
    nodes = mesh([a, b], rtt_ms=0.0, bandwidth=1e15)
    problem = RingCosts(spec(parallel=3), SHAPE, nodes, 100)
    assert problem.hops_ms(("a", "b"), 1) == pytest.approx([0.4, 0.4])
    # One stream: the plain trip, plus each stage's round and both boundaries.
    layers_and_head = 5 * 1.0 + 3 * 2.0 + 0.5
    assert problem.decode_ms(("a", "b"), (5, 3), 1) == pytest.approx(
        layers_and_head + 0.3 + 0.7 + 2 * 0.4)
    # Three streams, groups of 2 and 1: the trip pays each stage's round once; a stage's
    # work pays its round once a group.
    at2 = {"a": 1.0 + 0.6 / 2, "b": 2.0 + 0.4 / 2}
    head2 = 0.5 + 0.4 / 2
    trip = 5 * at2["a"] + 3 * at2["b"] + head2 + 0.3 + 0.7 + 2 * 0.4
    work_a = 5 * (at2["a"] + 1.0) + head2 + 0.5 + 2 * 0.3
    work_b = 3 * (at2["b"] + 2.0) + 2 * 0.7
    links = 2 * 0.4
    assert problem.decode_ms(("a", "b"), (5, 3), 3) == pytest.approx(
        max(trip, work_a, work_b, links))
    # One node: no boundary crossed, its round's host work only.
    assert problem.decode_ms(("a",), (8,), 1) == pytest.approx(8 * 1.0 + 0.5 + 0.3)


def test_host_work_that_was_not_timed_costs_nothing():
    """A calibration from before the host work was timed: the price is as it was."""
    a = dataclasses.replace(node("a", 500, decode=1.0, batch=1.6), head_ms=0.5)
    b = node("b", 500, decode=2.0, batch=2.4)
    problem = RingCosts(spec(parallel=1), SHAPE, mesh([a, b], rtt_ms=0.0, bandwidth=1e15), 100)
    assert problem.decode_ms(("a", "b"), (5, 3), 1) == pytest.approx(5 * 1.0 + 3 * 2.0 + 0.5)


def test_negative_host_work_is_refused():
    with pytest.raises(PlacementError, match="host work"):
        dataclasses.replace(node("a", 500), round_ms=-1.0)
    with pytest.raises(PlacementError, match="host work"):
        dataclasses.replace(node("a", 500), hop_ms=-0.1)


def brute_period(trip_ms, work_ms, head_ms, constant_ms, n_layers, limits):
    """Every cut of `n_layers` layers over the stages (each at most its limit)."""
    best = None
    stages = len(trip_ms)
    for cuts in itertools.combinations(range(1, n_layers), stages - 1):
        bounds = (0, *cuts, n_layers)
        counts = [b - a for a, b in itertools.pairwise(bounds)]
        if any(c > lim for c, lim in zip(counts, limits)):
            continue
        cost = max(constant_ms + sum(c * t for c, t in zip(counts, trip_ms)),
                   *(c * w + h for c, w, h in zip(counts, work_ms, head_ms)))
        best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_search_of_caps_finds_brute_forces_best_cut(seed):
    """Through the dynamic program (per-layer times, a separate running sum for the cap),
    on random stages: the least period over every cut."""
    rng = random.Random(seed)
    for _ in range(40):
        stages, n_layers = rng.randint(2, 4), rng.randint(2, 9)
        if stages > n_layers:
            continue
        trip = [rng.uniform(0.2, 3.0) for _ in range(stages)]
        work = [t * rng.uniform(1.0, 3.0) for t in trip]  # several groups' worth
        head = [rng.uniform(0.0, 4.0)] + [0.0] * (stages - 1)
        constant = rng.uniform(0.0, 3.0)
        limits = [rng.randint(1, n_layers) for _ in range(stages)]
        bytes_prefix = list(range(n_layers + 1))  # a layer: one byte; a limit: a room
        trips = [[k * t for k in range(n_layers + 1)] for t in trip]
        works = [[k * w for k in range(n_layers + 1)] for w in work]

        def least_trip(cap, trips=trips, works=works, head=head, limits=limits,
                       bytes_prefix=bytes_prefix):
            return min_total_ms(trips, limits, bytes_prefix,
                                [cap - h for h in head], works)

        def cost(counts, trip=trip, work=work, head=head, constant=constant):
            return max(constant + sum(c * t for c, t in zip(counts, trip)),
                       *(c * w + h for c, w, h in zip(counts, work, head)))

        caps = [c * w + h for w, h in zip(work, head) for c in range(1, n_layers + 1)]
        found = search_cap(caps, constant, least_trip, cost)
        expected = brute_period(trip, work, head, constant, n_layers, limits)
        if expected is None:
            assert found is None
        else:
            assert found is not None and found[0] == pytest.approx(expected, rel=1e-9)
            assert cost(found[1]) == pytest.approx(found[0])

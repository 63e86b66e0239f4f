"""Several replicas placed jointly: equal to a brute force over every set of placements on
small random fleets (no node over its memory, the slowest replica then the sum the least);
`replicas: auto` counts as many as fit; explicit placements copy; one replica is `place`."""

from __future__ import annotations

import itertools
import random

import pytest

from supervisor.joint_placement import most_replicas, place_replicas
from supervisor.memory import ExecutionShape, stage_memory
from supervisor.placement import DoesNotFit, place
from tests.supervisor.test_placement import (
    MB,
    SHAPE,
    decode_period,
    mesh,
    node,
    spec,
    with_layers,
)


def every_placement(s, shape, nodes):
    """(ring, ranges, bytes per node, cost) for every ring and cut that fits alone."""
    execution = ExecutionShape(s.context, s.parallel, s.chunk, s.prompt_cache_slots or 0)
    by_name = {n.name: n for n in nodes}
    rtt = {(n.name, lk.peer): lk for n in nodes for lk in n.links}
    out = []
    names = [n.name for n in nodes]
    for size in range(1, len(names) + 1):
        for ring in itertools.permutations(names, size):
            links = []
            for a, b in zip(ring, ring[1:] + ring[:1]) if size > 1 else ():
                lk = rtt.get((a, b)) or rtt.get((b, a))
                if lk is None:
                    break
                links.append(lk)
            else:
                def hops(rows, links=links):
                    return [lk.rtt_ms / 2 + rows * shape.row_bytes
                            / lk.bandwidth_bytes_per_s * 1e3 for lk in links]

                for cuts in itertools.combinations(range(1, shape.n_layers), size - 1):
                    ranges = list(itertools.pairwise((0, *cuts, shape.n_layers)))
                    need = {}
                    for i, (n, r) in enumerate(zip(ring, ranges)):
                        need[n] = stage_memory(shape, execution, r, i == 0).total_bytes
                    if any(b > by_name[n].usable_memory_bytes for n, b in need.items()):
                        continue
                    per_layer = "decode_batch_ms_per_layer" if s.parallel > 1 \
                        else "decode_ms_per_layer"
                    stage_ms = {n: (b - a) * getattr(by_name[n], per_layer)
                                for n, (a, b) in zip(ring, ranges)}
                    alone = decode_period(s, shape, [by_name[n] for n in ring], ranges, hops)
                    out.append((ring, ranges, need, (stage_ms, alone)))
    return out


def brute_force(s, shape, nodes, count):
    """The least (slowest, sum) over every set of `count` placements that fit together."""
    usable = {n.name: n.usable_memory_bytes for n in nodes}
    best = None
    for combo in itertools.combinations_with_replacement(every_placement(s, shape, nodes),
                                                         count):
        held = {}
        for _, _, need, _ in combo:
            for n, b in need.items():
                held[n] = held.get(n, 0) + b
        if any(b > usable[n] for n, b in held.items()):
            continue
        sharing = {}  # node -> replicas on it: they share its compute
        for _, _, need, _ in combo:
            for n in need:
                sharing[n] = sharing.get(n, 0) + 1
        # alone: the placement's own period; each other replica on a node adds its stage
        costs = [alone + sum(ms * (sharing[n] - 1) for n, ms in stage_ms.items())
                 for *_, (stage_ms, alone) in combo]
        key = (max(costs), sum(costs))
        best = key if best is None or key < best else best
    return best


def joint_key(placements):
    sharing = {}
    for p in placements:
        for st in p.stages:
            sharing[st.node] = sharing.get(st.node, 0) + 1
    costs = [p.decode_ms_per_token + sum(st.decode_ms * (sharing[st.node] - 1)
                                         for st in p.stages) for p in placements]
    return max(costs), sum(costs)


def test_joint_replicas_equal_a_brute_force_on_random_fleets():
    rng = random.Random(11)
    checked = shared = 0
    for _ in range(120):
        count = rng.randint(2, 3)
        # within the joint search's bounds (past them it places one by one, and says so)
        shape = with_layers(SHAPE, rng.randint(1, 5 if count == 2 else 4))
        nodes = mesh([node(f"n{i}", rng.choice([45, 70, 110, 160, 230]),
                           decode=rng.choice([0.5, 1.0, 2.0]))
                      for i in range(rng.randint(1, 3))], rtt_ms=rng.choice([0.1, 2.0]))
        s = spec(parallel=rng.choice([1, 2]))
        expected = brute_force(s, shape, nodes, count)
        if expected is None:
            with pytest.raises(DoesNotFit):
                place_replicas(s, shape, nodes, count)
            continue
        placements = place_replicas(s, shape, nodes, count)
        assert len(placements) == count
        got = joint_key(placements)
        assert got == pytest.approx(expected), (shape.n_layers, nodes, count)
        held = {}
        for p in placements:
            for stage in p.stages:
                held[stage.node] = held.get(stage.node, 0) + stage.memory.total_bytes
        assert all(held[n.name] <= n.usable_memory_bytes for n in nodes if n.name in held)
        checked += 1
        shared += len({st.node for p in placements for st in p.stages}) < sum(
            len(p.stages) for p in placements)
    assert checked >= 40 and shared >= 5  # the cases cover sets that fit and shared nodes


def test_a_node_holds_two_replicas_only_when_its_memory_holds_both():
    # One stream each: two streams would go round a split ring one group per stage, which
    # can beat sharing "big" for its own reason.
    shape, one_stream = with_layers(SHAPE, 4), spec(parallel=1)
    one = stage_memory(shape, ExecutionShape(1000, 1, 100), (0, 4), True).total_bytes
    big = mesh([node("big", (2 * one + MB) / MB), node("small", (one + MB) / MB, decode=3.0)])
    both_on_big = place_replicas(one_stream, shape, big, 2)
    assert [p.ring for p in both_on_big] == [("big",), ("big",)]
    tight = mesh([node("big", (2 * one - MB) / MB), node("small", (one + MB) / MB, decode=3.0)])
    apart = place_replicas(one_stream, shape, tight, 2)
    assert [p.ring for p in apart] != [("big",), ("big",)]
    on_big = sum(st.memory.total_bytes for p in apart for st in p.stages if st.node == "big")
    assert on_big <= tight[0].usable_memory_bytes


def test_one_replica_is_place_and_auto_counts_what_fits():
    shape = with_layers(SHAPE, 2)
    nodes = mesh([node("a", 150), node("b", 80), node("c", 40)])
    assert place_replicas(spec(), shape, nodes, 1) == (place(spec(), shape, nodes),)
    auto = most_replicas(spec(), shape, nodes, limit=4)
    assert len(auto) == brute_force_count(spec(), shape, nodes, limit=4) > 1
    assert "replicas: auto" in auto[0].why[-1]


def brute_force_count(s, shape, nodes, limit):
    return max(k for k in range(1, limit + 1) if k == 1 or brute_force(s, shape, nodes, k))


def test_too_many_replicas_say_how_many_fit():
    shape = with_layers(SHAPE, 4)
    nodes = mesh([node("a", 120), node("b", 120)])
    with pytest.raises(DoesNotFit, match="3 replicas do not fit side by side"):
        place_replicas(spec(), shape, nodes, 3)

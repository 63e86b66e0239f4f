"""Several replicas of one model placed together: which placements, side by side, within
every node's memory. Pure, like `supervisor/placement.py`, whose single placement it extends.

The replicas are interchangeable, so the search minimises the slowest replica's objective
first and then the sum of the objectives (the fleet's total time per round); on a tie, the
set that shares the fewest nodes (one node lost then takes fewer replicas with it), then the
first in a fixed order. Replicas that share a node share its compute: a stage on a node that
k replicas use costs k times its time alone (their rounds take turns), so a node holds two
replicas only when that is still the faster set, or when nothing else fits. A node may hold stages of two replicas only when its memory
holds both stages. One replica is `place` itself. For several, every placement that fits
alone (each ring order of the candidate nodes, each way to cut the layers) is costed once,
and a branch-and-bound search over sets of them (taken in order of cost, a set's bound is its
cost so far plus the cheapest possible rest) finds the best set that fits together: exact,
and checked against a brute force in tests/supervisor/test_joint_placement.py. Past
`MAX_CANDIDATES` placements or `MAX_VISITS` steps of that search (large models on many
nodes) the replicas are placed one after another, each the best on what the earlier ones
left, and the placement's `why` says so.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from supervisor.fleet_config import ModelSpec
from supervisor.memory import ModelShape, format_bytes
from supervisor.placement import (
    MAX_SEARCH_NODES,
    DoesNotFit,
    NodeSnapshot,
    Placement,
    place,
    placement_for,
    ring_orders,
    usable_for,
)
from supervisor.ring_cost import RingCosts, layer_ranges

MAX_CANDIDATES = 1000  # single placements costed before the search falls back to one by one
MAX_VISITS = 20_000  # steps of the joint search before it does
MAX_AUTO_REPLICAS = 8  # `replicas: auto` stops counting here


@dataclass(frozen=True)
class Candidate:
    """One placement that fits alone: its ring, layer counts, cost and bytes per node."""

    ring: tuple[str, ...]
    counts: tuple[int, ...]
    objective_ms: float  # alone on its nodes
    bytes_by_node: tuple[tuple[str, int], ...]
    stage_ms: tuple[float, ...] = ()  # each stage's time for the objective, alone
    hop_ms: tuple[float, ...] = ()
    chunks: int = 1  # the prompt objective's chunks (decode: one round)
    decode: bool = False  # objective_ms is a decode period (supervisor/decode_groups.py)

    def shared_ms(self, replicas_on: Mapping[str, int]) -> float:
        """The objective when each node's compute is shared by `replicas_on[node]` replicas."""
        if self.decode:  # its period alone, and every other replica's turn on a shared node
            return self.objective_ms + sum(ms * (replicas_on.get(n, 1) - 1)
                                           for n, ms in zip(self.ring, self.stage_ms))
        # What sharing adds to the prompt time alone (which also holds rank 0's head).
        return self.objective_ms + self._prompt_ms(replicas_on) - self._prompt_ms({})

    def _prompt_ms(self, replicas_on: Mapping[str, int]) -> float:
        stages = [ms * replicas_on.get(n, 1) for n, ms in zip(self.ring, self.stage_ms)]
        return (sum(stages) + sum(self.hop_ms)
                + (self.chunks - 1) * max(stages + list(self.hop_ms)))


def place_replicas(spec: ModelSpec, shape: ModelShape, nodes: Sequence[NodeSnapshot],
                   count: int) -> tuple[Placement, ...]:
    """`count` placements of `spec` that fit side by side on `nodes` and minimise (slowest
    replica, sum of replicas); raises `DoesNotFit` (how many would fit) when they do not."""
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    first = place(spec, shape, nodes)  # one replica, or why none fits at all
    if count == 1:
        return (first,)
    if not spec.placement_is_auto:
        return _explicit_copies(spec, shape, nodes, first, count)
    found = _search(spec, shape, nodes, count)
    if found is None:
        return _one_by_one(spec, shape, nodes, count)
    if not found:
        raise DoesNotFit(f"{spec.id}: {count} replicas do not fit side by side (one does: "
                         f"{' -> '.join(first.ring)})", spec.id)
    why = ((f"{count} replicas placed jointly: the slowest replica's "
           f"{spec.objective} time, then the sum, is the least of every set that fits"),)
    return tuple(placement_for(spec, shape, nodes, c.ring, c.counts, why + _sharing(i, found))
                 for i, c in enumerate(found))


def most_replicas(spec: ModelSpec, shape: ModelShape, nodes: Sequence[NodeSnapshot],
                  limit: int = MAX_AUTO_REPLICAS) -> tuple[Placement, ...]:
    """As many replicas as fit side by side (`replicas: auto`), up to `limit`; raises
    `DoesNotFit` when not even one does."""
    best = place_replicas(spec, shape, nodes, 1)
    if spec.placement_is_auto:
        found = candidates(spec, shape, nodes)
        for count in range(2, limit + 1):
            chosen = None if found is None else _search(spec, shape, nodes, count, found)
            if chosen is None:  # past the search's bounds: one by one, as many as fit
                best = _one_by_one(spec, shape, nodes, limit, as_many_as_fit=True)
                break
            if not chosen:
                break
            best = place_replicas(spec, shape, nodes, count)
    else:
        for count in range(2, limit + 1):
            try:
                best = place_replicas(spec, shape, nodes, count)
            except DoesNotFit:
                break
    return tuple(replace(p, why=(*p.why, f"replicas: auto: {len(best)} fit")) for p in best)


def _explicit_copies(spec: ModelSpec, shape: ModelShape, nodes: Sequence[NodeSnapshot],
                     one: Placement, count: int) -> tuple[Placement, ...]:
    """An explicit placement's replicas are copies of it: each node holds `count` stages."""
    usable = {n.name: n.usable_memory_bytes for n in nodes}
    for stage in one.stages:
        need = count * stage.memory.total_bytes
        if need > usable[stage.node]:
            raise DoesNotFit(f"{spec.id}: {count} replicas of the explicit placement need "
                             f"{format_bytes(need)} on {stage.node}, which has "
                             f"{format_bytes(usable[stage.node])}", spec.id,
                             shortfall_bytes=need - usable[stage.node], node=stage.node)
    return (one,) * count


def candidates(spec: ModelSpec, shape: ModelShape,
               nodes: Sequence[NodeSnapshot]) -> list[Candidate] | None:
    """Every single placement that fits alone, cheapest first; None past MAX_CANDIDATES."""
    names = [n.name for n in usable_for(spec, nodes)][:MAX_SEARCH_NODES]
    rank0s = [spec.rank0] if spec.rank0 else names
    rings = [r for r in ring_orders(rank0s, names) if len(r) <= shape.n_layers]
    if sum(math.comb(shape.n_layers - 1, len(r) - 1) for r in rings) > MAX_CANDIDATES:
        return None
    problem = RingCosts(spec, shape, nodes, spec.prompt_length)
    usable = {n.name: n.usable_memory_bytes for n in nodes}
    out = []
    for ring in rings:
        if problem.hops_ms(ring, 1) is None:
            continue
        for cuts in itertools.combinations(range(1, shape.n_layers), len(ring) - 1):
            bounds = (0, *cuts, shape.n_layers)
            ranges = list(itertools.pairwise(bounds))
            need = [problem.charged(n, r, i == 0) for i, (n, r) in enumerate(zip(ring, ranges))]
            if any(b > usable[n] for n, b in zip(ring, need)):
                continue
            counts = tuple(b - a for a, b in ranges)
            decode = spec.objective == "decode"
            cost = problem.decode_ms(ring, counts, spec.parallel) if decode \
                else problem.prompt_ms(ring, counts)
            kind = ("decode" if spec.parallel > 1 else "single") if decode else "prefill"
            stage_ms = tuple(problem.stage_ms(n, kind, r) for n, r in zip(ring, ranges))
            hops = tuple(problem.hops_ms(ring, spec.parallel if decode else spec.chunk) or ())
            out.append(Candidate(ring, counts, cost, tuple(zip(ring, need)), stage_ms, hops,
                                 1 if decode else problem.chunks, decode))
    order = {n.name: i for i, n in enumerate(nodes)}
    out.sort(key=lambda c: (c.objective_ms, len(c.ring), [order[n] for n in c.ring], c.counts))
    return out


def _search(spec: ModelSpec, shape: ModelShape, nodes: Sequence[NodeSnapshot],
            count: int, found: list[Candidate] | None = None) -> list[Candidate] | None:
    """The best set of `count` candidates (`found`, else all) that fit together ([] when
    none does); None when the problem is past the search's bounds."""
    found = candidates(spec, shape, nodes) if found is None else found
    if found is None:
        return None
    usable = {n.name: n.usable_memory_bytes for n in nodes}
    best: tuple[float, float, int, tuple[int, ...]] | None = None
    visits = 0

    def fits(held: Mapping[str, int], c: Candidate) -> bool:
        return all(held.get(n, 0) + b <= usable[n] for n, b in c.bytes_by_node)

    def extend(start: int, picks: tuple[int, ...], held: dict[str, int], total: float) -> bool:
        """False once the visit budget is spent."""
        nonlocal best, visits
        if len(picks) == count:
            key = _set_key(found, picks)
            best = key if best is None or key < best else best
            return True
        left = count - len(picks)
        for i in range(start, len(found)):
            visits += 1
            if visits > MAX_VISITS:
                return False
            cost = found[i].objective_ms
            # Sorted by cost alone, which sharing only raises: every set from here on is at
            # least this slow and this costly.
            if best is not None and (cost, total + cost * left) > best[:2]:
                break
            if not fits(held, found[i]):
                continue
            more = dict(held)
            for n, b in found[i].bytes_by_node:
                more[n] = more.get(n, 0) + b
            if not extend(i, (*picks, i), more, total + cost):
                return False
        return True

    if not extend(0, (), {}, 0.0):
        return None
    return [] if best is None else [found[i] for i in best[3]]


def _set_key(found: Sequence[Candidate], picks: tuple[int, ...]
             ) -> tuple[float, float, int, tuple[int, ...]]:
    """(slowest, sum, shared stages, picks) of a set, its nodes' compute shared."""
    replicas_on: dict[str, int] = {}
    for i in picks:
        for n in set(found[i].ring):
            replicas_on[n] = replicas_on.get(n, 0) + 1
    costs = [found[i].shared_ms(replicas_on) for i in picks]
    stages = sum(len(found[i].ring) for i in picks)
    return max(costs), sum(costs), stages - len(replicas_on), picks


def _one_by_one(spec: ModelSpec, shape: ModelShape, nodes: Sequence[NodeSnapshot],
                count: int, as_many_as_fit: bool = False) -> tuple[Placement, ...]:
    """Past the joint search's bounds: each replica the best on what the earlier ones left,
    a node's times scaled by the replicas that share it then."""
    left = {n.name: n.usable_memory_bytes for n in nodes}
    sharing = {n.name: 1 for n in nodes}
    out: list[Placement] = []
    for i in range(count):
        try:
            placement = place(spec, shape, [_slowed(n, left[n.name], sharing[n.name])
                                            for n in nodes if left[n.name] > 0])
        except DoesNotFit as exc:
            if as_many_as_fit and out:
                break
            raise DoesNotFit(f"{spec.id}: {count} replicas do not fit side by side: {i} do "
                             f"(replica {i + 1}: {exc})", spec.id) from exc
        for stage in placement.stages:
            left[stage.node] -= stage.memory.total_bytes
            sharing[stage.node] += 1
        out.append(replace(placement, why=(*placement.why, (f"replica {i + 1} of {count} placed "
                                           "on what the earlier ones left (too many "
                                           "placements for the joint search)"))))
    return tuple(out)


def _slowed(node: NodeSnapshot, usable_memory_bytes: int, replicas: int) -> NodeSnapshot:
    """`node` with the memory left and each layer `replicas` times as slow (shared compute)."""
    return replace(node, usable_memory_bytes=usable_memory_bytes,
                   decode_ms_per_layer=node.decode_ms_per_layer * replicas,
                   decode_batch_ms_per_layer=node.decode_batch_ms_per_layer * replicas,
                   prefill_ms_per_layer=node.prefill_ms_per_layer * replicas,
                   layer_type_ms=tuple(replace(t, decode_ms_per_layer=t.decode_ms_per_layer
                                               * replicas, decode_batch_ms_per_layer=t.
                                               decode_batch_ms_per_layer * replicas,
                                               prefill_ms_per_layer=t.prefill_ms_per_layer
                                               * replicas) for t in node.layer_type_ms))


def _sharing(mine: int, chosen: Sequence[Candidate]) -> tuple[str, ...]:
    others = {n for i, c in enumerate(chosen) if i != mine for n in c.ring}
    shared = sorted(others & set(chosen[mine].ring))
    if not shared:
        return ()
    return ((f"shares {', '.join(shared)} with another replica: its memory holds both, and "
            f"each runs slower there while both are busy"),)


def ring_text(c: Candidate) -> str:
    return " -> ".join(f"{n} {a}:{b}" for n, (a, b) in zip(c.ring, layer_ranges(c.counts)))

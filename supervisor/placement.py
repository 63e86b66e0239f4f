"""Placement: which nodes, in which ring order, hold which contiguous layer range of a model.

A pure function of frozen snapshots (model spec, model shape, and per node its usable
memory, backend, calibrated ms per layer of each layer type and measured links). The search
is exhaustive and exact: every ring order of up to six candidate nodes (rank 0 first), and
for each the best layer ranges: in closed form when every layer has one type (a dense
family's layers all cost the same on a node), by a dynamic program over layer prefixes when
they differ (a hybrid's DeltaNet and full-attention layers: `supervisor/boundaries.py`).
docs/placement.md explains the cost model and why both are optimal;
tests/supervisor/test_placement.py checks them against a brute force over every boundary.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from supervisor.boundaries import TIME_TOLERANCE, min_prompt_ms, min_total_ms, stage_times
from supervisor.fleet_config import ModelSpec
from supervisor.memory import (
    ExecutionShape,
    ModelShape,
    StageMemory,
    fixed_bytes,
    format_bytes,
    layer_bytes,
    layers_that_fit,
    stage_memory,
)

MAX_SEARCH_NODES = 6  # 1,956 ring orders at six nodes; seven would be 13,699
# A NodeSnapshot's ms per layer by what is timed: "decode" is picked per spec (one row or a
# round of `parallel` rows), "single" is one row, "prefill" one prompt chunk.
TIMED = {"single": "decode_ms_per_layer", "batch": "decode_batch_ms_per_layer",
         "prefill": "prefill_ms_per_layer"}


class PlacementError(ValueError):
    """The inputs contradict each other (a snapshot, an explicit placement, the shape)."""


class DoesNotFit(PlacementError):
    """No placement fits the nodes there are; the message names the shortfall."""

    def __init__(self, message: str, model_id: str, shortfall_bytes: int = 0,
                 node: str | None = None) -> None:
        super().__init__(message)
        self.model_id, self.shortfall_bytes, self.node = model_id, shortfall_bytes, node


@dataclass(frozen=True)
class LinkSnapshot:
    """A measured link from the node that holds it to `peer`."""

    peer: str
    rtt_ms: float
    bandwidth_bytes_per_s: float


@dataclass(frozen=True)
class LayerTypeMs:
    """A node's calibrated ms for one layer of one type (config.json's `layer_types` name)."""

    layer_type: str
    decode_ms_per_layer: float  # one row
    decode_batch_ms_per_layer: float  # one round of `parallel` rows
    prefill_ms_per_layer: float  # one prompt chunk of `chunk` rows


@dataclass(frozen=True)
class NodeSnapshot:
    """What placement knows of one live node, for one model (calibrated on its shape)."""

    name: str
    usable_memory_bytes: int
    backend: str
    decode_ms_per_layer: float  # one row
    decode_batch_ms_per_layer: float  # one round of `parallel` rows
    prefill_ms_per_layer: float  # one prompt chunk of `chunk` rows
    links: tuple[LinkSnapshot, ...] = ()
    # Per layer type, where calibrated so; a type not listed costs the three numbers above.
    layer_type_ms: tuple[LayerTypeMs, ...] = ()

    def __post_init__(self) -> None:
        for timed in (self, *self.layer_type_ms):
            for name in TIMED.values():
                if not getattr(timed, name) > 0:
                    what = f" {timed.layer_type}" if timed is not self else ""
                    raise PlacementError(f"node {self.name}:{what} {name} = "
                                         f"{getattr(timed, name)!r}: expected a positive "
                                         "number of ms")
        for link in self.links:
            if not (link.rtt_ms >= 0 and link.bandwidth_bytes_per_s > 0):
                raise PlacementError(f"node {self.name}: link to {link.peer}: rtt {link.rtt_ms} "
                                     f"ms, {link.bandwidth_bytes_per_s} bytes/s: not a link")

    def ms_per_layer(self, layer_type: str, timed: str) -> float:
        """ms for one layer of `layer_type`; `timed` is "single", "batch" or "prefill"."""
        found = next((t for t in self.layer_type_ms if t.layer_type == layer_type), self)
        return getattr(found, TIMED[timed])


@dataclass(frozen=True)
class Stage:
    rank: int
    node: str
    backend: str
    layer_range: tuple[int, int]  # half-open, global layer indices
    memory: StageMemory
    usable_memory_bytes: int
    decode_ms: float  # this stage's layers in one decode round of `parallel` rows
    prefill_chunk_ms: float  # this stage's layers on one prompt chunk
    hop_decode_ms: float  # to the next stage (the last one: back to rank 0); 0 alone
    hop_chunk_ms: float
    layer_type_counts: tuple[tuple[str, int], ...] = ()  # its layers by type
    layer_type_ms: tuple[LayerTypeMs, ...] = ()  # the node's ms per layer of each type


@dataclass(frozen=True)
class Alternative:
    """The best placement not chosen, or why there is none."""

    ring: tuple[str, ...]
    layer_ranges: tuple[tuple[int, int], ...]
    objective_ms: float | None  # None: it does not fit
    reason: str


@dataclass(frozen=True)
class Placement:
    model_id: str
    objective: str  # "decode" or "prompt"
    parallel: int
    prompt_tokens: int
    stages: tuple[Stage, ...]  # rank 0 first
    decode_ms_per_token: float  # one round with `parallel` streams: each gets one token
    decode_ms_per_token_single: float  # one stream alone
    prompt_ms: float  # a prompt of `prompt_tokens` tokens, chunk by chunk
    explicit: bool
    runner_up: Alternative | None
    why: tuple[str, ...]

    @property
    def objective_ms(self) -> float:
        return self.decode_ms_per_token if self.objective == "decode" else self.prompt_ms

    @property
    def ring(self) -> tuple[str, ...]:
        return tuple(s.node for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON for fleetctl, each stage's memory with its totals (which it renders)."""
        out = asdict(self)
        for stage, raw in zip(self.stages, out["stages"], strict=True):
            raw["memory"].update(rank0_extras_bytes=stage.memory.rank0_extras_bytes,
                                 total_bytes=stage.memory.total_bytes)
        return out


@dataclass(frozen=True)
class _Ring:
    """One ring order with its best counts and predicted times."""

    nodes: tuple[str, ...]
    counts: tuple[int, ...]
    objective_ms: float
    rank: tuple  # sort key: objective, fewer stages, the other objective, input order


class _Problem:
    """Everything the search derives once from the inputs."""

    def __init__(self, spec: ModelSpec, shape: ModelShape, nodes: Sequence[NodeSnapshot],
                 prompt_tokens: int) -> None:
        self.spec, self.shape = spec, shape
        self.execution = ExecutionShape(spec.context, spec.parallel, spec.chunk)
        self.chunks = max(1, math.ceil(prompt_tokens / spec.chunk))
        self.prompt_tokens = prompt_tokens
        self.nodes = {n.name: n for n in nodes}
        self.order = {n.name: i for i, n in enumerate(nodes)}
        self.uniform = shape.is_uniform
        self.cap0 = {n.name: self.fit(n, True) for n in nodes}
        self.cap = {n.name: self.fit(n, False) for n in nodes}
        self._decode_fills: dict[tuple, dict[str, int] | None] = {}
        self._tables: dict[tuple, tuple] = {}  # (rank 0, node set) -> bottleneck table
        self._hops: dict[int, dict[tuple[str, str], float]] = {}  # rows -> (a, b) -> ms
        self._links = {(n.name, link.peer): link for n in nodes for link in n.links}
        timed = {"decode": "batch" if spec.parallel > 1 else "single", "single": "single",
                 "prefill": "prefill"}
        # kind -> node -> layer type -> ms per layer
        self._type_ms = {kind: {n.name: {t.name: n.ms_per_layer(t.name, what)
                                         for t in shape.types} for n in nodes}
                         for kind, what in timed.items()}
        self._layer_ms = {kind: {name: next(iter(by_type.values()))
                                 for name, by_type in per_node.items()}
                          for kind, per_node in self._type_ms.items()}  # uniform shapes only
        self._type_prefix = {t.name: list(itertools.accumulate(
            (int(layer.name == t.name) for layer in shape.layers), initial=0))
            for t in shape.types}
        self.bytes_prefix = list(itertools.accumulate(
            (layer_bytes(layer, self.execution) for layer in shape.layers), initial=0))
        self._time_prefix: dict[tuple[str, str], list[float]] = {}
        self._stage_times: dict[str, list[float]] = {}

    def fit(self, node: NodeSnapshot, is_rank0: bool) -> int:
        """The most layers of a uniform model the node holds; a hybrid's: 0 or 1 (no range
        can hold any layer, or one may: the search checks each range)."""
        room = self.room(node.name, is_rank0)
        if not self.uniform:
            smallest = min(layer_bytes(t, self.execution) for t in self.shape.types)
            return int(room >= smallest)
        return min(self.shape.n_layers,
                   layers_that_fit(self.shape, self.execution, node.usable_memory_bytes, is_rank0))

    def room(self, name: str, is_rank0: bool) -> int:
        """Bytes left for layers on `name` once its fixed bytes are held."""
        fixed = fixed_bytes(self.shape, self.execution, is_rank0).total_bytes
        return self.nodes[name].usable_memory_bytes - fixed

    def stage_ms(self, name: str, kind: str, layer_range: tuple[int, int]) -> float:
        """ms of `name` running the layers of `layer_range` (kind as for `layer_ms`)."""
        a, b = layer_range
        return sum((prefix[b] - prefix[a]) * self._type_ms[kind][name][t]
                   for t, prefix in self._type_prefix.items())

    def time_prefix(self, name: str, kind: str) -> list[float]:
        if (name, kind) not in self._time_prefix:
            ms = self._type_ms[kind][name]
            self._time_prefix[(name, kind)] = list(itertools.accumulate(
                (ms[layer.name] for layer in self.shape.layers), initial=0.0))
        return self._time_prefix[(name, kind)]

    def caps(self, ring: tuple[str, ...]) -> list[int]:
        return [self.cap0[ring[0]]] + [self.cap[n] for n in ring[1:]]

    def link(self, a: str, b: str) -> LinkSnapshot | None:
        """a -> b as measured from a, else b -> a (links are close to symmetric)."""
        return self._links.get((a, b)) or self._links.get((b, a))

    def hops_ms(self, ring: tuple[str, ...], rows: int) -> list[float] | None:
        """Each stage's hop to the next (the last one's back to rank 0); None: a link is missing."""
        if rows not in self._hops:
            self._hops[rows] = {
                (a, b): link.rtt_ms / 2 + rows * self.shape.row_bytes
                / link.bandwidth_bytes_per_s * 1000
                for a in self.nodes for b in self.nodes if (link := self.link(a, b))}
        table = self._hops[rows]
        if len(ring) == 1:
            return []
        out = []
        for pair in zip(ring, ring[1:] + ring[:1]):
            ms = table.get(pair)
            if ms is None:
                return None
            out.append(ms)
        return out

    def layer_ms(self, name: str, kind: str) -> float:
        """ms per layer: "decode" (a round of `parallel` rows), "single" (one row), "prefill"."""
        return self._layer_ms[kind][name]

    def decode_ms(self, ring: tuple[str, ...], counts: Sequence[int], rows: int) -> float:
        kind = "decode" if rows == self.spec.parallel else "single"
        hops = self.hops_ms(ring, rows) or []
        return sum(self.stage_ms(n, kind, r) for n, r in zip(ring, _ranges(counts))) + sum(hops)

    def prompt_ms(self, ring: tuple[str, ...], counts: Sequence[int]) -> float:
        stages = [self.stage_ms(n, "prefill", r) for n, r in zip(ring, _ranges(counts))]
        hops = self.hops_ms(ring, self.spec.chunk) or []
        return sum(stages) + sum(hops) + (self.chunks - 1) * max(stages + hops)

    def best_counts(self, ring: tuple[str, ...]) -> tuple[int, ...] | None:
        """The best layer counts for this ring under the objective; None when it cannot fit."""
        if not self.uniform:
            return self._searched_counts(ring)
        caps = dict(zip(ring, self.caps(ring)))
        if min(caps.values()) < 1 or sum(caps.values()) < self.shape.n_layers:
            return None
        if self.spec.objective == "decode":  # the fill depends on the set, not the order
            key = (ring[0], frozenset(ring))
            if key not in self._decode_fills:
                self._decode_fills[key] = self._fill(self._by_speed(ring, "decode"), caps)
            counts = self._decode_fills[key]
        else:
            hops = self.hops_ms(ring, self.spec.chunk)
            counts = None if hops is None else self._prompt_counts(ring, caps, max(hops, default=0))
        return None if counts is None else tuple(counts[n] for n in ring)

    def rooms(self, ring: Sequence[str]) -> list[int]:
        return [self.room(n, i == 0) for i, n in enumerate(ring)]

    def _searched_counts(self, ring: tuple[str, ...]) -> tuple[int, ...] | None:
        """A hybrid's best ranges for this ring order, by the dynamic program."""
        rooms = self.rooms(ring)
        if self.spec.objective == "decode":
            found = min_total_ms([self.time_prefix(n, "decode") for n in ring], rooms,
                                 self.bytes_prefix)
        else:
            hops = self.hops_ms(ring, self.spec.chunk)
            if hops is None:
                return None
            for name in ring:
                if name not in self._stage_times:
                    self._stage_times[name] = stage_times(self.time_prefix(name, "prefill"))
            found = min_prompt_ms([self.time_prefix(n, "prefill") for n in ring], rooms,
                                  self.bytes_prefix, [self._stage_times[n] for n in ring],
                                  self.chunks, hops)
        return None if found is None else found[1]

    def _by_speed(self, names: Sequence[str], kind: str) -> list[str]:
        return sorted(names, key=lambda n: (self.layer_ms(n, kind), self.order[n]))

    def _fill(self, fastest_first: Sequence[str], caps: dict[str, int]) -> dict[str, int] | None:
        """One layer each, then the rest to the fastest stages first, up to their caps."""
        left = self.shape.n_layers - len(fastest_first)
        if left < 0 or min(caps.values()) < 1:
            return None
        counts = dict.fromkeys(fastest_first, 1)
        for name in fastest_first:
            add = min(caps[name] - 1, left)
            counts[name] += add
            left -= add
        return counts if left == 0 else None

    def _capped_fill(self, fastest_first: Sequence[str], caps: dict[str, int],
                     bottleneck_ms: float) -> dict[str, int] | None:
        """The prompt fill with no stage slower than `bottleneck_ms` per chunk."""
        ms = self._layer_ms["prefill"]
        return self._fill(fastest_first, {
            n: min(caps[n], math.floor((bottleneck_ms + TIME_TOLERANCE) / ms[n]))
            for n in fastest_first})

    def _prompt_counts(self, ring: tuple[str, ...], caps: dict[str, int],
                       link_max_ms: float) -> dict[str, int] | None:
        # Bottlenecks at or below the slowest link all cost (chunks - 1) x that link, and the
        # fill only improves as the bottleneck grows: so T = the slowest link is the best of
        # them. Above it, the best is read from a table shared by every order of this set.
        key = (ring[0], frozenset(ring))
        if key not in self._tables:
            self._tables[key] = self._bottleneck_table(ring, caps)
        fastest_first, thresholds, suffix_best = self._tables[key]
        options = [self._capped_fill(fastest_first, caps, link_max_ms)]
        j = bisect.bisect_right(thresholds, link_max_ms + TIME_TOLERANCE)
        if j < len(thresholds) and suffix_best[j] is not None:
            options.append(suffix_best[j][1])
        found = [c for c in options if c is not None]
        if len(found) < 2:
            return found[0] if found else None
        return min(found, key=lambda c: self.prompt_ms(ring, [c[n] for n in ring]))

    def _bottleneck_table(self, names: Sequence[str], caps: dict[str, int]):
        """Bottlenecks T ascending, and for each the best (bound, counts) over all T' >= T,
        where bound = sum of stage times + (chunks - 1) x T' (hops left out: same for all)."""
        ms = self._layer_ms["prefill"]
        fastest_first = self._by_speed(names, "prefill")
        thresholds = sorted({c * ms[n] for n in names for c in range(1, caps[n] + 1)})
        suffix_best: list[tuple[float, dict[str, int]] | None] = [None] * len(thresholds)
        best = None
        for i in range(len(thresholds) - 1, -1, -1):
            counts = self._capped_fill(fastest_first, caps, thresholds[i])
            if counts is None:  # nor will any lower bottleneck fit: it caps stages harder
                suffix_best[:i + 1] = [best] * (i + 1)
                break
            bound = (sum(c * ms[n] for n, c in counts.items())
                     + (self.chunks - 1) * thresholds[i])
            if best is None or bound <= best[0]:
                best = (bound, counts)
            suffix_best[i] = best
        return fastest_first, thresholds, suffix_best

    def prompt_lower_bound(self, ring: tuple[str, ...]) -> float | None:
        """A hybrid's prompt ms on this ring is at least this (the least sum of stage times,
        the hops, and (chunks - 1) x the slowest hop or the mean stage); None: it cannot fit."""
        hops = self.hops_ms(ring, self.spec.chunk)
        if hops is None or self.hops_ms(ring, 1) is None:
            return None
        loose = min_total_ms([self.time_prefix(n, "prefill") for n in ring], self.rooms(ring),
                             self.bytes_prefix)
        if loose is None:
            return None
        return (loose[0] + sum(hops)
                + (self.chunks - 1) * max(max(hops, default=0.0), loose[0] / len(ring)))

    def ring_result(self, ring: tuple[str, ...]) -> _Ring | None:
        counts = self.best_counts(ring)
        if counts is None or self.hops_ms(ring, 1) is None:
            return None
        decode = self.decode_ms(ring, counts, self.spec.parallel)
        prompt = self.prompt_ms(ring, counts)
        objective, other = (decode, prompt) if self.spec.objective == "decode" else (prompt, decode)
        key = (objective, len(ring), other, tuple(self.order[n] for n in ring))
        return _Ring(ring, counts, objective, key)


def place(spec: ModelSpec, shape: ModelShape, nodes: Sequence[NodeSnapshot],
          prompt_tokens: int | None = None) -> Placement:
    """The placement of `spec` on the live `nodes` that minimises its objective.

    `prompt_tokens` sizes the predicted prompt time (and the prompt objective); the spec's
    context when None. Raises `DoesNotFit` when nothing fits, `PlacementError` when the
    inputs contradict each other.
    """
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise PlacementError(f"{spec.id}: node snapshots repeat a name: {names}")
    problem = _Problem(spec, shape, nodes, prompt_tokens or spec.context)
    if not spec.placement_is_auto:
        return _explicit(problem)
    excluded = {n.name: why for n in nodes if (why := _excluded(spec, n))}
    candidates = [n.name for n in nodes if n.name not in excluded]
    why = [f"excluded {name}: {reason}" for name, reason in excluded.items()]
    if spec.rank0 is not None and spec.rank0 not in candidates:
        reason = excluded.get(spec.rank0, "not among the live nodes")
        raise DoesNotFit(f"{spec.id}: rank0 {spec.rank0} cannot hold rank 0: {reason}",
                         spec.id, node=spec.rank0)
    if not candidates:
        reasons = "; ".join(f"{k} ({v})" for k, v in excluded.items()) or "no live nodes"
        raise DoesNotFit(f"{spec.id}: no node can hold a stage: {reasons}", spec.id)
    if len(candidates) > MAX_SEARCH_NODES:
        keep = sorted(candidates, key=lambda n: (n != spec.rank0,
                                                 -problem.nodes[n].usable_memory_bytes))
        keep = keep[:MAX_SEARCH_NODES]
        why.append(f"searched the {MAX_SEARCH_NODES} nodes with the most memory; left out: "
                   + ", ".join(n for n in candidates if n not in keep))
        candidates = [n for n in candidates if n in keep]
    rank0s = [spec.rank0] if spec.rank0 else candidates
    results, fitting = _search(problem, list(_rings(rank0s, candidates)))
    if not results:
        raise _does_not_fit(problem, candidates, rank0s)
    results.sort(key=lambda r: r.rank)
    best = results[0]
    why.insert(0, f"searched {sum(1 for _ in _rings(rank0s, candidates))} ring orders over "
               f"{len(candidates)} node(s); {fitting} fit")
    if spec.rank0:
        why.append(f"rank 0 is {spec.rank0}, as rank0 asks")
    runner_up = _runner_up(problem, best, results, candidates, rank0s)
    why.append(f"runner-up: {runner_up.reason}")
    for name in candidates:
        if name not in best.nodes:
            with_it = next((r for r in results if name in r.nodes), None)
            why.append(f"{name} unused: " + (
                f"the best ring with it is {_slower(with_it, best)}" if with_it
                else "no ring with it fits"))
    return _build(problem, best.nodes, best.counts, explicit=False, runner_up=runner_up,
                  why=tuple(why))


def _search(problem: _Problem, rings: list[tuple[str, ...]]) -> tuple[list[_Ring], int]:
    """The rings' results, and how many fit. Every ring's, except for a hybrid's prompt
    objective, whose search per ring is costly: there, rings are taken by a lower bound on
    their cost, and a ring is searched only while it could still be the best, the runner-up
    (best with another node set or rank 0) or the best ring with a node the best leaves out,
    which are all that `place` reports."""
    if problem.uniform or problem.spec.objective == "decode":
        results = [r for ring in rings if (r := problem.ring_result(ring)) is not None]
        return results, len(results)
    bounded = sorted((bound, i, ring) for i, ring in enumerate(rings)
                     if (bound := problem.prompt_lower_bound(ring)) is not None)
    results: list[_Ring] = []
    best: _Ring | None = None
    settled = False
    runner_ms, with_node_ms = math.inf, dict[str, float]()

    def same_set(ring: tuple[str, ...]) -> bool:
        return best is not None and (ring[0], frozenset(ring)) == (best.nodes[0],
                                                                    frozenset(best.nodes))

    def note(r: _Ring) -> None:
        nonlocal runner_ms
        if not same_set(r.nodes):
            runner_ms = min(runner_ms, r.objective_ms)
        for n in r.nodes:
            with_node_ms[n] = min(with_node_ms.get(n, math.inf), r.objective_ms)

    for bound, _, ring in bounded:
        if best is not None and bound > best.objective_ms + TIME_TOLERANCE and not settled:
            settled = True  # no ring left can beat or tie the best: what it leaves out is fixed
            for r in results:
                note(r)
        if settled and not (
                (not same_set(ring) and bound <= runner_ms + TIME_TOLERANCE)
                or any(n not in best.nodes and bound <= with_node_ms.get(n, math.inf)
                       + TIME_TOLERANCE for n in ring)):
            continue
        found = problem.ring_result(ring)
        if found is None:
            continue
        results.append(found)
        if settled:
            note(found)
        elif best is None or found.rank < best.rank:
            best = found
    return results, len(bounded)


def _excluded(spec: ModelSpec, node: NodeSnapshot) -> str | None:
    if node.backend not in spec.backends:
        return f"backend {node.backend} is not among {', '.join(spec.backends)}"
    if spec.checkpoint.path_for(node.name) is None:
        return "no checkpoint path for it"
    return None


def _rings(rank0s: Sequence[str], candidates: Sequence[str]):
    for r0 in rank0s:
        others = [n for n in candidates if n != r0]
        for size in range(len(others) + 1):
            for perm in itertools.permutations(others, size):
                yield (r0, *perm)


def _slower(alt: _Ring, best: _Ring) -> str:
    delta = alt.objective_ms - best.objective_ms
    pct = 100 * delta / best.objective_ms if best.objective_ms else 0.0
    if delta <= 0:
        return "a tie (broken by fewer stages, the other objective, then node order)"
    return f"{delta:.2f} ms slower (+{pct:.1f}%)"


def _ranges(counts: Sequence[int]) -> tuple[tuple[int, int], ...]:
    ends = list(itertools.accumulate(counts))
    return tuple(zip([0, *ends[:-1]], ends))


def _ring_text(ring: Sequence[str], counts: Sequence[int]) -> str:
    return " -> ".join(f"{n} {a}:{b}" for n, (a, b) in zip(ring, _ranges(counts)))


def _runner_up(problem: _Problem, best: _Ring, results: list[_Ring],
               candidates: Sequence[str], rank0s: Sequence[str]) -> Alternative:
    """The best ring with another node set or another rank 0 (a mere reorder says little)."""
    same = (best.nodes[0], frozenset(best.nodes))
    alt = next((r for r in results if (r.nodes[0], frozenset(r.nodes)) != same), None)
    if alt is not None:
        return Alternative(alt.nodes, _ranges(alt.counts), alt.objective_ms,
                           f"{_ring_text(alt.nodes, alt.counts)} is {_slower(alt, best)}")
    others = [r for r in _rings(rank0s, candidates) if (r[0], frozenset(r)) != same]
    if not problem.uniform:  # a search per ring and node: one order per node set is enough
        others = list({(r[0], frozenset(r)): r for r in reversed(others)}.values())
    if not others:
        return Alternative((), (), None, "none: no other node set to try")
    ring = min(others, key=lambda r: _shortfall(problem, r)[0])
    missing, short_node = _shortfall(problem, ring)
    if missing > 0:
        reason = f"is {format_bytes(missing)} short on {short_node}"
    elif len(ring) > problem.shape.n_layers:
        reason = "has more stages than the model has layers"
    else:
        reason = "lacks a measured link between two neighbours"
    return Alternative(ring, (), None, f"none fits; the closest, {' -> '.join(ring)}, {reason}")


def _shortfall(problem: _Problem, ring: tuple[str, ...]) -> tuple[int, str]:
    """The fewest bytes that, added to one node of `ring`, let it hold the model (dropping
    any other follower too small for a layer); and that node."""
    if not problem.uniform:
        return _searched_shortfall(problem, ring)
    caps = problem.caps(ring)
    per_layer = layer_bytes(problem.shape.layers[0], problem.execution)
    options = []
    for j, name in enumerate(ring):
        if j > 0 and caps[0] < 1:
            continue  # rank 0 cannot be dropped: it is the one that must grow
        others = sum(cap for i, cap in enumerate(caps) if i != j and cap >= 1)
        layers = max(1, problem.shape.n_layers - others)
        need = fixed_bytes(problem.shape, problem.execution, j == 0).total_bytes
        options.append((need + layers * per_layer - problem.nodes[name].usable_memory_bytes,
                        name))
    missing, name = min(options)
    return max(0, missing), name


def _searched_shortfall(problem: _Problem, ring: tuple[str, ...]) -> tuple[int, str]:
    """`_shortfall` for a hybrid: for each node, the least bytes its range can take while
    the others hold the rest within their rooms (a search with that node's bytes as its
    cost and no room limit)."""
    rooms = problem.rooms(ring)
    can_hold = [problem.fit(problem.nodes[n], i == 0) for i, n in enumerate(ring)]
    bytes_prefix = [float(b) for b in problem.bytes_prefix]
    zero = [0.0] * len(bytes_prefix)
    options = []
    for j, name in enumerate(ring):
        if j > 0 and not can_hold[0]:
            continue  # rank 0 cannot be dropped: it is the one that must grow
        kept = [i for i in range(len(ring)) if i == j or i == 0 or can_hold[i]]
        found = min_total_ms([bytes_prefix if i == j else zero for i in kept],
                             [2**62 if i == j else rooms[i] for i in kept],
                             problem.bytes_prefix)
        if found is not None:
            options.append((int(found[0]) - rooms[j], name))
    if not options:
        return 0, ring[0]  # more stages than layers: no bytes help
    missing, name = min(options)
    return max(0, missing), name


def _layers_text(problem: _Problem) -> str:
    """Each layer type's bytes, for a DoesNotFit message."""
    execution, counts = problem.execution, problem.shape.type_counts((0, problem.shape.n_layers))
    parts = []
    for t in problem.shape.types:
        text = f"{t.name} x{counts[t.name]}: weights {format_bytes(t.weight_bytes)}"
        if t.kv_bytes_per_position or not t.state_bytes_per_slot:
            kv = t.kv_bytes_per_position * execution.context * execution.parallel
            text += (f" + KV {format_bytes(kv)} for {execution.context} x "
                     f"{execution.parallel} positions")
        if t.state_bytes_per_slot:
            text += (f" + recurrent state {format_bytes(t.state_bytes_per_slot * execution.parallel)}"
                     f" for {execution.parallel} stream(s)")
        parts.append(text)
    return "; ".join(parts)


def _does_not_fit(problem: _Problem, candidates: Sequence[str],
                  rank0s: Sequence[str]) -> DoesNotFit:
    spec, shape, execution = problem.spec, problem.shape, problem.execution
    rings = [(r0, *[n for n in candidates if n != r0]) for r0 in rank0s]
    ring = min(rings, key=lambda r: _shortfall(problem, r)[0])
    missing, short_node = _shortfall(problem, ring)
    if missing <= 0:
        return DoesNotFit(f"{spec.id}: every ring that fits in memory lacks a measured link "
                          f"between two neighbours, or has more stages than layers "
                          f"({', '.join(candidates)})", spec.id)
    extras = fixed_bytes(shape, execution, True)
    need = problem.bytes_prefix[-1] + sum(fixed_bytes(shape, execution, i == 0).total_bytes
                                           for i in range(len(ring)))
    usable = sum(problem.nodes[n].usable_memory_bytes for n in ring)
    placed = ""
    if problem.uniform:  # with rank 0 holding what it can
        placed = f"places {min(sum(problem.caps(ring)), shape.n_layers)} of {shape.n_layers} " \
                 "layers and "
    states = "" if problem.uniform else ", recurrent states"
    return DoesNotFit(
        f"{spec.id} needs {format_bytes(need)} for weights, KV{states} and rank 0's extras "
        f"across {len(ring)} node(s), which have {format_bytes(usable)}; the largest fit, "
        f"rank 0 on {ring[0]}, {placed}leaves {format_bytes(missing)} short on "
        f"{short_node} (rank 0 extras: embeddings {format_bytes(extras.embedding_bytes)}, "
        f"head {format_bytes(extras.head_bytes)}, staging {format_bytes(extras.staging_bytes)};"
        f" each layer: {_layers_text(problem)})",
        spec.id, shortfall_bytes=missing, node=short_node)


def _explicit(problem: _Problem) -> Placement:
    spec, shape = problem.spec, problem.shape
    ring = tuple(s.node for s in spec.placement)
    if spec.placement[-1].layer_range[1] != shape.n_layers:
        raise PlacementError(f"{spec.id}: the explicit placement ends at layer "
                             f"{spec.placement[-1].layer_range[1]}, but the model has "
                             f"{shape.n_layers}")
    for stage in spec.placement:
        node = problem.nodes.get(stage.node)
        if node is None:
            raise DoesNotFit(f"{spec.id}: explicit stage on {stage.node} cannot start: "
                             "it is not among the live nodes", spec.id, node=stage.node)
        if (stage.backend or node.backend) != node.backend or node.backend not in spec.backends:
            raise PlacementError(f"{spec.id}: explicit stage on {stage.node} asks backend "
                                 f"{stage.backend or node.backend}; the node's snapshot is "
                                 f"for {node.backend} (model backends: "
                                 f"{', '.join(spec.backends)})")
    if problem.hops_ms(ring, 1) is None:
        raise PlacementError(f"{spec.id}: no measured link between two neighbouring stages "
                             f"of {' -> '.join(ring)}")
    counts = tuple(b - a for a, b in (s.layer_range for s in spec.placement))
    short = []
    for i, stage in enumerate(spec.placement):
        memory = stage_memory(shape, problem.execution, stage.layer_range, i == 0)
        usable = problem.nodes[stage.node].usable_memory_bytes
        if memory.total_bytes > usable:
            short.append((stage.node, stage.layer_range, memory.total_bytes - usable, memory))
    if short:
        parts = [f"{name} ({b - a} layers) needs {format_bytes(memory.total_bytes)}, "
                 f"has {format_bytes(memory.total_bytes - lack)}: {format_bytes(lack)} short"
                 for name, (a, b), lack, memory in short]
        missing = sum(lack for _, _, lack, _ in short)
        raise DoesNotFit(f"{spec.id}: the explicit placement does not fit: " + "; ".join(parts),
                         spec.id, shortfall_bytes=missing, node=short[0][0])
    why = ["explicit placement from fleet.yaml (not searched)"]
    runner_up = None
    try:
        auto = place(replace(spec, placement=()), shape, list(problem.nodes.values()),
                     problem.prompt_tokens)
        mine = problem.decode_ms(ring, counts, spec.parallel) if spec.objective == "decode" \
            else problem.prompt_ms(ring, counts)
        delta = mine - auto.objective_ms
        auto_counts = [b - a for a, b in (s.layer_range for s in auto.stages)]
        runner_up = Alternative(auto.ring, _ranges(auto_counts), auto.objective_ms,
                                f"auto would choose {_ring_text(auto.ring, auto_counts)}, "
                                f"{abs(delta):.2f} ms {'faster' if delta > 0 else 'slower'}")
        why.append(f"runner-up: {runner_up.reason}")
    except PlacementError as exc:
        why.append(f"auto placement: {exc}")
    return _build(problem, ring, counts, explicit=True, runner_up=runner_up, why=tuple(why))


def _build(problem: _Problem, ring: tuple[str, ...], counts: Sequence[int], explicit: bool,
           runner_up: Alternative | None, why: tuple[str, ...]) -> Placement:
    spec = problem.spec
    hops_decode = problem.hops_ms(ring, spec.parallel) or [0.0]
    hops_chunk = problem.hops_ms(ring, spec.chunk) or [0.0]
    stages = tuple(
        Stage(rank=i, node=name, backend=problem.nodes[name].backend, layer_range=rng,
              memory=stage_memory(problem.shape, problem.execution, rng, i == 0),
              usable_memory_bytes=problem.nodes[name].usable_memory_bytes,
              decode_ms=problem.stage_ms(name, "decode", rng),
              prefill_chunk_ms=problem.stage_ms(name, "prefill", rng),
              hop_decode_ms=hops_decode[i % len(hops_decode)],
              hop_chunk_ms=hops_chunk[i % len(hops_chunk)],
              layer_type_counts=tuple(problem.shape.type_counts(rng).items()),
              layer_type_ms=tuple(
                  LayerTypeMs(t.name, *(problem.nodes[name].ms_per_layer(t.name, what)
                                        for what in TIMED)) for t in problem.shape.types))
        for i, (name, rng) in enumerate(zip(ring, _ranges(counts))))
    return Placement(model_id=spec.id, objective=spec.objective, parallel=spec.parallel,
                     prompt_tokens=problem.prompt_tokens, stages=stages,
                     decode_ms_per_token=problem.decode_ms(ring, counts, spec.parallel),
                     decode_ms_per_token_single=problem.decode_ms(ring, counts, 1),
                     prompt_ms=problem.prompt_ms(ring, counts), explicit=explicit,
                     runner_up=runner_up, why=why)

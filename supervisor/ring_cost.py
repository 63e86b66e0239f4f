"""What one ring order costs and its best layer ranges: the node snapshots placement reads,
the cost model over them, and the search of every ring order.

Pure, over frozen snapshots. A ring's best ranges are solved in closed form when every layer
has one type (a dense family's layers all cost the same on a node), by a dynamic program
over layer prefixes when they differ (`supervisor/boundaries.py`). `supervisor/placement.py`
chooses among the rings and explains the choice; docs/placement.md gives the cost model.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from engine.hop_choice import choose
from supervisor.boundaries import TIME_TOLERANCE, min_total_ms, stage_times
from supervisor.decode_groups import groups_for, period_ms, rows_ms, search_cap
from supervisor.fleet_config import ModelSpec
from supervisor.memory import (
    MAX_BUDGET_SLOTS,
    ExecutionShape,
    ModelShape,
    fixed_bytes,
    kept_slot_bytes,
    layer_bytes,
    layers_that_fit,
    stage_memory,
)
from supervisor.prompt_search import RingPrompt, least_sum_cuts, search_prompt_rings

# A NodeSnapshot's three times per layer: one row, a round of `parallel` rows, one prompt
# chunk. (RingCosts' "decode" is "batch" or "single", as the spec's `parallel` says.)
TIMED = {"single": "decode_ms_per_layer", "batch": "decode_batch_ms_per_layer",
         "prefill": "prefill_ms_per_layer"}


class PlacementError(ValueError):
    """The inputs contradict each other (a snapshot, an explicit placement, the shape)."""


@dataclass(frozen=True)
class LinkSnapshot:
    """A measured link from the node that holds it to `peer`."""

    peer: str
    rtt_ms: float
    bandwidth_bytes_per_s: float
    # The torch.distributed path between the same two agents (agent/dist_probe.py), probed
    # where a hop between them would take it: "gloo" or "nccl"; "" when not measured.
    dist_transport: str = ""
    dist_rtt_ms: float = 0.0
    dist_bandwidth_bytes_per_s: float = 0.0

    def path(self, transport: str) -> tuple[float, float]:
        """(rtt ms, bytes/s) of the path a hop on `transport` takes: the torch.distributed
        path's where it was measured, else the TCP link's (the nearest measurement there is)."""
        if transport == self.dist_transport != "" and self.dist_bandwidth_bytes_per_s > 0:
            return self.dist_rtt_ms, self.dist_bandwidth_bytes_per_s
        return self.rtt_ms, self.bandwidth_bytes_per_s


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
    # The prompt cache's byte budget of a stage here (supervisor.planning.prompt_cache_budget);
    # placement charges it and buys kept slots with it, unless the spec sets their count.
    prompt_cache_budget_bytes: int = 0
    # As rank 0: its final norm, head and sampling, ms a decode round of one row and of
    # `parallel` rows (every ring pays its rank 0's once a round, whatever the cut).
    head_ms: float = 0.0
    head_batch_ms: float = 0.0
    # Host work that the layers' and the head's times leave out, timed through the serving
    # code (agent/calibrate.py's "round" and "hop" points; 0: a calibration from before
    # they were timed): a stage's, each round, beyond its layers (the plan checked against
    # its slots, the layout built, the rows settled), and a boundary's end here, beyond
    # the wire time the link probe prices (the rows to bytes and the send, the receiver
    # waking and checking the frame, the bytes to rows).
    round_ms: float = 0.0
    hop_ms: float = 0.0

    def __post_init__(self) -> None:
        for timed in (self, *self.layer_type_ms):
            for name in TIMED.values():
                if not getattr(timed, name) > 0:
                    what = f" {timed.layer_type}" if timed is not self else ""
                    raise PlacementError(f"node {self.name}:{what} {name} = "
                                         f"{getattr(timed, name)!r}: expected a positive "
                                         "number of ms")
        if not (self.head_ms >= 0 and self.head_batch_ms >= 0):
            raise PlacementError(f"node {self.name}: head {self.head_ms!r} / "
                                 f"{self.head_batch_ms!r} ms: expected 0 or more")
        if not (self.round_ms >= 0 and self.hop_ms >= 0):
            raise PlacementError(f"node {self.name}: host work a round {self.round_ms!r}, "
                                 f"a hop {self.hop_ms!r} ms: expected 0 or more")
        for link in self.links:
            if not (link.rtt_ms >= 0 and link.bandwidth_bytes_per_s > 0):
                raise PlacementError(f"node {self.name}: link to {link.peer}: rtt {link.rtt_ms} "
                                     f"ms, {link.bandwidth_bytes_per_s} bytes/s: not a link")

    def ms_per_layer(self, layer_type: str, timed: str) -> float:
        """ms for one layer of `layer_type`; `timed` is "single", "batch" or "prefill"."""
        found = next((t for t in self.layer_type_ms if t.layer_type == layer_type), self)
        return getattr(found, TIMED[timed])


@dataclass(frozen=True)
class RingResult:
    """One ring order with its best counts and predicted times."""

    nodes: tuple[str, ...]
    counts: tuple[int, ...]
    objective_ms: float
    rank: tuple  # sort key: objective, fewer stages, the other objective, input order


class RingCosts:
    """Everything the search derives once from the inputs."""

    def __init__(self, spec: ModelSpec, shape: ModelShape, nodes: Sequence[NodeSnapshot],
                 prompt_tokens: int) -> None:
        self.spec, self.shape = spec, shape
        self.execution = ExecutionShape(spec.context, spec.parallel, spec.chunk,
                                        spec.prompt_cache_slots or 0, spec.kv_pages)
        # What the prompt cache's budget takes from each node while the layers are placed:
        # the budget, or what MAX_BUDGET_SLOTS slots of the whole model hold if less (no
        # stage's slot is larger); nothing where the spec sets the slot count. Under a pool
        # of pages a kept slot's KV is the pool's, charged with the layers: its slot holds
        # its recurrent states alone, so a dense model's budget takes nothing.
        whole_slot = kept_slot_bytes(shape, spec.context, (0, shape.n_layers),
                                     kv_in_pool=spec.kv_pages > 0)
        self.cache_charge = {
            n.name: 0 if spec.prompt_cache_slots is not None
            else min(n.prompt_cache_budget_bytes, MAX_BUDGET_SLOTS * whole_slot) for n in nodes}
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
        self._time_prefix: dict[tuple[str, object], list[float]] = {}
        self._group_fills: dict[tuple, tuple[int, ...] | None] = {}
        # (node, decode groups' rows) -> layer type -> ms per layer summed over the groups
        self._group_type_ms: dict[tuple[str, tuple[int, ...]], dict[str, float]] = {}
        self._stage_times: dict[frozenset[str], list[float]] = {}

    def fit(self, node: NodeSnapshot, is_rank0: bool) -> int:
        """The most layers of a uniform model the node holds; a hybrid's: 0 or 1 (no range
        can hold any layer, or one may: the search checks each range)."""
        room = self.room(node.name, is_rank0)
        if not self.uniform:
            smallest = min(layer_bytes(t, self.execution) for t in self.shape.types)
            return int(room >= smallest)
        usable = node.usable_memory_bytes - self.cache_charge[node.name]
        return min(self.shape.n_layers,
                   layers_that_fit(self.shape, self.execution, usable, is_rank0))

    def room(self, name: str, is_rank0: bool) -> int:
        """Bytes left for layers on `name` once its fixed bytes and its prompt cache's
        budget are held."""
        fixed = fixed_bytes(self.shape, self.execution, is_rank0).total_bytes
        return self.nodes[name].usable_memory_bytes - fixed - self.cache_charge[name]

    def charged(self, name: str, layer_range: tuple[int, int], is_rank0: bool) -> int:
        """What a stage of `layer_range` on `name` is charged while placing: its memory and
        its prompt cache's budget."""
        memory = stage_memory(self.shape, self.execution, layer_range, is_rank0)
        return memory.total_bytes + self.cache_charge[name]

    def type_ms(self, name: str, kind: str | tuple[int, ...]) -> dict[str, float]:
        """ms per layer of each type on `name`: `kind` as for `layer_ms`, or a tuple of decode
        groups' rows, summed over them (`supervisor/decode_groups.py`)."""
        if isinstance(kind, str):
            return self._type_ms[kind][name]
        key = (name, kind)
        if key not in self._group_type_ms:
            node, batch = self.nodes[name], self.spec.parallel
            self._group_type_ms[key] = {
                t.name: sum(rows_ms(node.ms_per_layer(t.name, "single"),
                                    node.ms_per_layer(t.name, "batch"), batch, rows)
                            for rows in kind)
                for t in self.shape.types}
        return self._group_type_ms[key]

    def stage_ms(self, name: str, kind: str | tuple[int, ...],
                 layer_range: tuple[int, int]) -> float:
        """ms of `name` running the layers of `layer_range` (kind as for `type_ms`)."""
        a, b = layer_range
        ms = self.type_ms(name, kind)
        return sum((prefix[b] - prefix[a]) * ms[t] for t, prefix in self._type_prefix.items())

    def time_prefix(self, name: str, kind: str | tuple[int, ...]) -> list[float]:
        if (name, kind) not in self._time_prefix:
            ms = self.type_ms(name, kind)
            self._time_prefix[(name, kind)] = list(itertools.accumulate(
                (ms[layer.name] for layer in self.shape.layers), initial=0.0))
        return self._time_prefix[(name, kind)]

    def caps(self, ring: tuple[str, ...]) -> list[int]:
        return [self.cap0[ring[0]]] + [self.cap[n] for n in ring[1:]]

    def link(self, a: str, b: str) -> LinkSnapshot | None:
        """a -> b as measured from a, else b -> a (links are close to symmetric)."""
        return self._links.get((a, b)) or self._links.get((b, a))

    def hop_transport(self, a: str, b: str) -> str:
        """How a hop from a's stage to b's carries its rows (the engines' own choice)."""
        return choose(self.spec.hop_transport, self.nodes[a].backend, self.nodes[b].backend)[0]

    def hops_ms(self, ring: tuple[str, ...], rows: int) -> list[float] | None:
        """Each stage's hop to the next (the last one's back to rank 0); None: a link is missing."""
        if rows not in self._hops:
            self._hops[rows] = {
                (a, b): rtt_ms / 2 + rows * self.shape.row_bytes / bandwidth * 1000
                + self.hop_host_ms(a, b)
                for a in self.nodes for b in self.nodes if (link := self.link(a, b))
                for rtt_ms, bandwidth in (link.path(self.hop_transport(a, b)),)}
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

    def hop_host_ms(self, a: str, b: str) -> float:
        """A hop's host work from a's stage to b's: half of each end's (each node times both
        ends of a loopback hop: the sender's half on a, the receiver's on b)."""
        return (self.nodes[a].hop_ms + self.nodes[b].hop_ms) / 2

    def layer_ms(self, name: str, kind: str | tuple[int, ...]) -> float:
        """A uniform model's ms per layer: "decode" (a round of `parallel` rows), "single" (one
        row), "prefill", or decode groups' rows (as for `type_ms`)."""
        if isinstance(kind, str):
            return self._layer_ms[kind][name]
        return self.type_ms(name, kind)[self._one_type]

    def decode_ms(self, ring: tuple[str, ...], counts: Sequence[int], streams: int) -> float:
        """A stream's ms per token with `streams` streams decoding at once: the period of
        the decode groups rank 0 keeps in flight (`supervisor/decode_groups.py`)."""
        groups = groups_for(streams, len(ring))
        ranges = layer_ranges(counts)
        largest = (max(groups),)
        trip = (sum(self.stage_ms(n, largest, r) for n, r in zip(ring, ranges))
                + self._trip_constant(ring, groups))
        work = [self.stage_ms(n, groups, r) + fixed
                for n, r, fixed in zip(ring, ranges, self._fixed_work(ring, groups))]
        links = [sum(ms) for ms in zip(*(self.hops_ms(ring, rows) or [] for rows in groups))]
        return period_ms(trip, work, links)

    def head_ms(self, rank0: str, rows: int) -> float:
        """Rank 0's final norm, head and sampling in a decode round of `rows` rows."""
        node = self.nodes[rank0]
        return rows_ms(node.head_ms, node.head_batch_ms, self.spec.parallel, rows)

    def decode_groups(self, ring: Sequence[str]) -> tuple[int, ...]:
        """The rows of the decode rounds in flight with `parallel` streams on this ring."""
        return groups_for(self.spec.parallel, len(ring))

    def _trip_constant(self, ring: tuple[str, ...], groups: tuple[int, ...]) -> float:
        """The part of the largest group's trip no cut changes: its hops, rank 0's head and
        every stage's host work of a round."""
        rows = max(groups)
        return (sum(self.hops_ms(ring, rows) or []) + self.head_ms(ring[0], rows)
                + sum(self.nodes[n].round_ms for n in ring))

    def _fixed_work(self, ring: Sequence[str], groups: tuple[int, ...]) -> list[float]:
        """Each stage's work over the groups in flight that no cut changes: its host work
        of each round, and on rank 0 the head of each."""
        fixed = [len(groups) * self.nodes[n].round_ms for n in ring]
        fixed[0] += sum(self.head_ms(ring[0], rows) for rows in groups)
        return fixed

    def prompt_ms(self, ring: tuple[str, ...], counts: Sequence[int]) -> float:
        """The time to first token of a `prompt_tokens` prompt: its chunks overlapped across
        the stages, then rank 0's head on the last chunk's one returned row."""
        stages = [self.stage_ms(n, "prefill", r) for n, r in zip(ring, layer_ranges(counts))]
        hops = self.hops_ms(ring, self.spec.chunk) or []
        return (sum(stages) + sum(hops) + (self.chunks - 1) * max(stages + hops)
                + self.head_ms(ring[0], 1))

    def best_counts(self, ring: tuple[str, ...],
                    give_up_ms: float = math.inf) -> tuple[int, ...] | None:
        """The best layer counts for this ring under the objective; None when it cannot fit."""
        if not self.uniform:
            return self._searched_counts(ring, give_up_ms)
        caps = dict(zip(ring, self.caps(ring)))
        if min(caps.values()) < 1 or sum(caps.values()) < self.shape.n_layers:
            return None
        if self.spec.objective == "decode":
            groups = self.decode_groups(ring)
            if len(groups) > 1:  # several rounds in flight: a stage's work may bind
                return self._group_counts(ring, caps, groups)
            # One round: the least sum, which depends on the set, not the order.
            key = (ring[0], frozenset(ring))
            if key not in self._decode_fills:
                self._decode_fills[key] = self._fill(self._by_speed(ring, groups), caps)
            counts = self._decode_fills[key]
        else:
            hops = self.hops_ms(ring, self.spec.chunk)
            counts = None if hops is None else self._prompt_counts(ring, caps, max(hops, default=0))
        return None if counts is None else tuple(counts[n] for n in ring)

    def _group_counts(self, ring: tuple[str, ...], caps: dict[str, int],
                      groups: tuple[int, ...]) -> tuple[int, ...] | None:
        """A uniform model's best counts with several decode groups in flight: the least
        trip under a cap on every stage's work, the cap found by binary search."""
        if ring not in self._group_fills:
            trip = {n: self.layer_ms(n, (max(groups),)) for n in ring}
            work = {n: self.layer_ms(n, groups) for n in ring}
            fixed = dict(zip(ring, self._fixed_work(ring, groups)))
            fastest_first = sorted(ring, key=lambda n: (trip[n], self.order[n]))

            def least_trip(cap_ms: float):
                fill = self._fill(fastest_first, {
                    n: min(caps[n], math.floor((cap_ms - fixed[n] + TIME_TOLERANCE) / work[n]))
                    for n in ring})
                return None if fill is None else (sum(c * trip[n] for n, c in fill.items()),
                                                  tuple(fill[n] for n in ring))

            found = search_cap([c * work[n] + fixed[n] for n in ring
                                for c in range(1, caps[n] + 1)],
                               self._trip_constant(ring, groups), least_trip,
                               lambda counts: self.decode_ms(ring, counts, self.spec.parallel))
            self._group_fills[ring] = None if found is None else found[1]
        return self._group_fills[ring]

    @property
    def _one_type(self) -> str:
        return self.shape.types[0].name

    def rooms(self, ring: Sequence[str]) -> list[int]:
        return [self.room(n, i == 0) for i, n in enumerate(ring)]

    def _searched_counts(self, ring: tuple[str, ...],
                         give_up_ms: float) -> tuple[int, ...] | None:
        """A hybrid's best ranges for this ring order, by the dynamic program (for the prompt
        objective, by `supervisor/prompt_search.py`'s search of caps, only sought below
        `give_up_ms`)."""
        if self.spec.objective == "decode":
            found = self.searched_decode_cut(ring)
            return None if found is None else found[1]
        found = min_total_ms([self.time_prefix(n, "prefill") for n in ring], self.rooms(ring),
                             self.bytes_prefix)
        if found is None or self.hops_ms(ring, 1) is None:
            return None if found is None else found[1]
        return RingPrompt(self, ring, found).solve(give_up_ms)[1]

    def searched_decode_cut(self, ring: tuple[str, ...]) -> tuple[float, tuple[int, ...]] | None:
        """A hybrid's best decode cut for this ring, (its period, counts): the least sum at
        one round in flight; with several, the least trip under a cap on every stage's work
        (the dynamic program with a second running sum for the cap), the cap found by
        binary search."""
        groups = self.decode_groups(ring)
        trips = [self.time_prefix(n, (max(groups),)) for n in ring]
        rooms = self.rooms(ring)
        if len(groups) == 1:
            found = min_total_ms(trips, rooms, self.bytes_prefix)
            return None if found is None else (
                self.decode_ms(ring, found[1], self.spec.parallel), found[1])
        works = [self.time_prefix(n, groups) for n in ring]
        fixed = self._fixed_work(ring, groups)

        def least_trip(cap_ms: float):
            return min_total_ms(trips, rooms, self.bytes_prefix,
                                [cap_ms - f for f in fixed], works)

        caps = [t + f for f, prefix in zip(fixed, works) for t in stage_times(prefix)]
        return search_cap(caps, self._trip_constant(ring, groups), least_trip,
                          lambda counts: self.decode_ms(ring, counts, self.spec.parallel))

    def ring_stage_times(self, ring: tuple[str, ...]) -> list[float]:
        """Every time a prompt chunk's stage on a node of `ring` can take, ascending: the caps
        a hybrid's prompt search tries. Kept per node set."""
        key = frozenset(ring)
        if key not in self._stage_times:
            self._stage_times[key] = sorted({t for n in ring
                                             for t in stage_times(self.time_prefix(n, "prefill"))})
        return self._stage_times[key]

    def _by_speed(self, names: Sequence[str], kind: str | tuple[int, ...]) -> list[str]:
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

    def ring_result(self, ring: tuple[str, ...],
                    give_up_ms: float = math.inf) -> RingResult | None:
        """The ring's best ranges and times; with `give_up_ms`, exact only below it."""
        counts = self.best_counts(ring, give_up_ms)
        if counts is None or self.hops_ms(ring, 1) is None:
            return None
        return self.result_for(ring, counts)

    def result_for(self, ring: tuple[str, ...], counts: tuple[int, ...]) -> RingResult:
        """The ring with these layer counts, costed and ranked."""
        decode = self.decode_ms(ring, counts, self.spec.parallel)
        prompt = self.prompt_ms(ring, counts)
        objective, other = (decode, prompt) if self.spec.objective == "decode" else (prompt, decode)
        key = (objective, len(ring), other, tuple(self.order[n] for n in ring))
        return RingResult(ring, counts, objective, key)


def search_rings(problem: RingCosts, rings: list[tuple[str, ...]]) -> tuple[list[RingResult], int]:
    """The rings' results, and how many fit. Every ring's, except for a hybrid's prompt
    objective, whose search per ring is costly: there, `supervisor/prompt_search.py`
    searches only the rings that could be what `place` reports (the best, the runner-up,
    the best ring with each node the best leaves out), each only as far as it could."""
    if problem.uniform:
        results = [r for ring in rings if (r := problem.ring_result(ring)) is not None]
        return results, len(results)
    if problem.spec.objective == "decode":
        # One round in flight (one stream, one stage): every ring's least sum, over shared
        # prefixes. Several: each ring's own search of caps.
        single = [r for r in rings if len(problem.decode_groups(r)) == 1]
        cuts = {}
        for length in sorted({len(r) for r in single}):
            same = [r for r in single if len(r) == length]
            rows = (max(problem.decode_groups(same[0])),)
            cuts.update(least_sum_cuts(problem, same, rows))
        results = [problem.result_for(ring, counts) for ring, (_, counts) in cuts.items()]
        for ring in rings:
            if len(problem.decode_groups(ring)) > 1 and len(ring) <= problem.shape.n_layers \
                    and problem.hops_ms(ring, 1) is not None:
                found = problem.searched_decode_cut(ring)
                if found is not None:
                    results.append(problem.result_for(ring, found[1]))
        return results, len(results)
    searched, fitting = search_prompt_rings(problem, rings)
    return [problem.result_for(ring, counts) for ring, counts in searched], fitting


def layer_ranges(counts: Sequence[int]) -> tuple[tuple[int, int], ...]:
    ends = list(itertools.accumulate(counts))
    return tuple(zip([0, *ends[:-1]], ends))

"""Placement: which nodes, in which ring order, hold which contiguous layer range of a model.

A pure function of frozen snapshots (model spec, model shape, and per node its usable
memory, backend, calibrated ms per layer of each layer type and measured links). The search
is exhaustive and exact: every ring order of up to six candidate nodes (rank 0 first), and
for each the best layer ranges: in closed form when every layer has one type (a dense
family's layers all cost the same on a node), by a dynamic program over layer prefixes when
they differ (a hybrid's DeltaNet and full-attention layers: `supervisor/boundaries.py`).
`supervisor/ring_cost.py` costs each ring order and finds its best ranges; this module
chooses among them and explains the choice. With several streams decoding, a cut is priced
by the rounds rank 0 keeps in flight and searched by a cap on each stage's work
(`supervisor/decode_groups.py`). docs/placement.md explains the cost model and
why both are optimal; tests/supervisor/test_placement.py and test_placement_by_layer_type.py
check them against a brute force over every boundary.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from engine.kv_pages import PAGE_POSITIONS
from supervisor.boundaries import min_total_ms
from supervisor.fleet_config import ModelSpec
from supervisor.memory import (
    MAX_BUDGET_SLOTS,
    ModelShape,
    StageMemory,
    fixed_bytes,
    format_bytes,
    kept_slot_bytes,
    layer_bytes,
    slots_bought,
    stage_memory,
)
from supervisor.ring_cost import (
    TIMED,
    LayerTypeMs,
    LinkSnapshot,
    NodeSnapshot,
    PlacementError,
    RingCosts,
    RingResult,
    layer_ranges,
    search_rings,
)

__all__ = ["Alternative", "DoesNotFit", "LayerTypeMs", "LinkSnapshot", "NodeSnapshot",
           "Placement", "PlacementError", "Stage", "place"]

MAX_SEARCH_NODES = 6  # 1,956 ring orders at six nodes; seven would be 13,699


class DoesNotFit(PlacementError):
    """No placement fits the nodes there are; the message names the shortfall."""

    def __init__(self, message: str, model_id: str, shortfall_bytes: int = 0,
                 node: str | None = None) -> None:
        super().__init__(message)
        self.model_id, self.shortfall_bytes, self.node = model_id, shortfall_bytes, node


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
    prompt_cache_slot_bytes: int = 0  # what one kept slot holds here (memory counts them)
    prompt_cache_budget_bytes: int = 0  # its budget for them (0: the spec sets the count)


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
    # `parallel` streams decoding: the period of their groups in flight (one round per stage,
    # supervisor/decode_groups.py), in which each stream gets one token
    decode_ms_per_token: float
    decode_ms_per_token_single: float  # one stream alone
    prompt_ms: float  # a prompt of `prompt_tokens` tokens, chunk by chunk
    explicit: bool
    runner_up: Alternative | None
    why: tuple[str, ...]
    prompt_cache_slots: int = 0  # kept past `parallel` on every stage: set, or bought
    kv_pages: int = 0  # every stage's pool of KV pages (the spec's); 0: a whole context a slot
    # rank 0's final norm, head and sampling, in each decode round (the largest group's rows)
    head_ms: float = 0.0

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



def place(spec: ModelSpec, shape: ModelShape, nodes: Sequence[NodeSnapshot],
          prompt_tokens: int | None = None) -> Placement:
    """The placement of `spec` on the live `nodes` that minimises its objective.

    `prompt_tokens` sizes the predicted time to first token (and the prompt objective); the
    spec's `prompt_length` when None. Raises `DoesNotFit` when nothing fits, `PlacementError`
    when the inputs contradict each other. The answers for the last `KEPT_PLACEMENTS` inputs
    are kept: the supervisor asks again with the same inputs (a plan, then the apply that
    places it; every control step while a replica waits), and a six-node hybrid's search
    takes seconds.
    """
    key = (spec, shape, tuple(nodes), prompt_tokens)
    found = _kept.pop(key, None)
    if found is None:
        try:
            found = _search(spec, shape, nodes, prompt_tokens)
        except PlacementError as exc:
            found = exc
    _kept[key] = found  # the most recent last
    while len(_kept) > KEPT_PLACEMENTS:
        del _kept[next(iter(_kept))]
    if isinstance(found, PlacementError):
        raise found.with_traceback(None)
    return found


KEPT_PLACEMENTS = 32
_kept: dict[tuple, Placement | PlacementError] = {}


def forget_placements() -> None:
    """Drop the kept answers (a benchmark times the search itself)."""
    _kept.clear()


def _search(spec: ModelSpec, shape: ModelShape, nodes: Sequence[NodeSnapshot],
            prompt_tokens: int | None) -> Placement:
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise PlacementError(f"{spec.id}: node snapshots repeat a name: {names}")
    problem = RingCosts(spec, shape, nodes, prompt_tokens or spec.prompt_length)
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
    results, fitting = search_rings(problem, list(_rings(rank0s, candidates)))
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



def placement_for(spec: ModelSpec, shape: ModelShape, nodes: Sequence[NodeSnapshot],
                  ring: tuple[str, ...], counts: Sequence[int], why: tuple[str, ...]
                  ) -> Placement:
    """The placement of a ring and layer counts chosen elsewhere (the joint search of
    several replicas), costed and explained as `place` costs its own."""
    problem = RingCosts(spec, shape, nodes, spec.prompt_length)
    return _build(problem, ring, counts, explicit=False, runner_up=None, why=why)


def usable_for(spec: ModelSpec, nodes: Sequence[NodeSnapshot]) -> list[NodeSnapshot]:
    """The nodes that may hold a stage of `spec` (its backends, a checkpoint path)."""
    return [n for n in nodes if _excluded(spec, n) is None]


def ring_orders(rank0s: Sequence[str], candidates: Sequence[str]):
    """Every ring order of `candidates` that starts at one of `rank0s`."""
    return _rings(rank0s, candidates)


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


def _slower(alt: RingResult, best: RingResult) -> str:
    delta = alt.objective_ms - best.objective_ms
    pct = 100 * delta / best.objective_ms if best.objective_ms else 0.0
    if delta <= 0:
        return "a tie (broken by fewer stages, the other objective, then node order)"
    return f"{delta:.2f} ms slower (+{pct:.1f}%)"



def _ring_text(ring: Sequence[str], counts: Sequence[int]) -> str:
    return " -> ".join(f"{n} {a}:{b}" for n, (a, b) in zip(ring, layer_ranges(counts)))


def _runner_up(problem: RingCosts, best: RingResult, results: list[RingResult],
               candidates: Sequence[str], rank0s: Sequence[str]) -> Alternative:
    """The best ring with another node set or another rank 0 (a mere reorder says little)."""
    same = (best.nodes[0], frozenset(best.nodes))
    alt = next((r for r in results if (r.nodes[0], frozenset(r.nodes)) != same), None)
    if alt is not None:
        return Alternative(alt.nodes, layer_ranges(alt.counts), alt.objective_ms,
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


def _shortfall(problem: RingCosts, ring: tuple[str, ...]) -> tuple[int, str]:
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
        need = (fixed_bytes(problem.shape, problem.execution, j == 0).total_bytes
                + problem.cache_charge[name])
        options.append((need + layers * per_layer - problem.nodes[name].usable_memory_bytes,
                        name))
    missing, name = min(options)
    return max(0, missing), name


def _searched_shortfall(problem: RingCosts, ring: tuple[str, ...]) -> tuple[int, str]:
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


def _layers_text(problem: RingCosts) -> str:
    """Each layer type's bytes, for a DoesNotFit message."""
    execution, counts = problem.execution, problem.shape.type_counts((0, problem.shape.n_layers))
    parts = []
    for t in problem.shape.types:
        text = f"{t.name} x{counts[t.name]}: weights {format_bytes(t.weight_bytes)}"
        if t.kv_bytes_per_position or not t.state_bytes_per_slot:
            kv = t.kv_bytes_per_position * execution.kv_positions
            text += f" + KV {format_bytes(kv)} for " + (
                _pool_text(execution.kv_pages) if execution.kv_pages
                else f"{execution.context} x {execution.slots} positions")
        if t.state_bytes_per_slot:
            text += (f" + recurrent state {format_bytes(t.state_bytes_per_slot * execution.slots)}"
                     f" for {execution.slots} slot(s)")
        parts.append(text)
    if execution.prompt_cache_slots:
        parts.append(f"{execution.slots} slots: {execution.parallel} stream(s) and "
                     f"{execution.prompt_cache_slots} kept for the prompt cache "
                     "(prompt_cache_slots)")
    return "; ".join(parts)


def _pool_text(kv_pages: int) -> str:
    return f"a pool of {kv_pages} pages ({kv_pages * PAGE_POSITIONS} positions)"


def _does_not_fit(problem: RingCosts, candidates: Sequence[str],
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
                                           + problem.cache_charge[n] for i, n in enumerate(ring))
    usable = sum(problem.nodes[n].usable_memory_bytes for n in ring)
    placed = ""
    if problem.uniform:  # with rank 0 holding what it can
        placed = f"places {min(sum(problem.caps(ring)), shape.n_layers)} of {shape.n_layers} " \
                 "layers and "
    states = "" if problem.uniform else ", recurrent states"
    cache = ", the prompt cache's budget" if any(problem.cache_charge[n] for n in ring) else ""
    return DoesNotFit(
        f"{spec.id} needs {format_bytes(need)} for weights, KV{states}{cache} and rank 0's extras "
        f"across {len(ring)} node(s), which have {format_bytes(usable)}; the largest fit, "
        f"rank 0 on {ring[0]}, {placed}leaves {format_bytes(missing)} short on "
        f"{short_node} (rank 0 extras: embeddings {format_bytes(extras.embedding_bytes)}, "
        f"head {format_bytes(extras.head_bytes)}, staging {format_bytes(extras.staging_bytes)};"
        f" each layer: {_layers_text(problem)}{_budget_text(problem, ring)})",
        spec.id, shortfall_bytes=missing, node=short_node)


def _budget_text(problem: RingCosts, ring: Sequence[str]) -> str:
    """The prompt cache's charge per node, for a DoesNotFit message."""
    charges = [(n, problem.cache_charge[n]) for n in ring if problem.cache_charge[n]]
    if not charges:
        return ""
    source = ("prompt_cache_bytes" if problem.spec.prompt_cache_bytes is not None
              else "the default, a share of each node's usable memory; set prompt_cache_bytes "
                   "or prompt_cache_slots to change it")
    return ("; prompt cache budget: " + ", ".join(f"{n} {format_bytes(b)}" for n, b in charges)
            + f" ({source})")


def _explicit(problem: RingCosts) -> Placement:
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
        need = problem.charged(stage.node, stage.layer_range, i == 0)
        usable = problem.nodes[stage.node].usable_memory_bytes
        if need > usable:
            short.append((stage.node, stage.layer_range, need - usable, need))
    if short:
        cache = (" (its prompt cache's budget included)"
                 if any(problem.cache_charge[name] for name, *_ in short) else "")
        parts = [f"{name} ({b - a} layers) needs {format_bytes(need)}{cache}, "
                 f"has {format_bytes(need - lack)}: {format_bytes(lack)} short"
                 for name, (a, b), lack, need in short]
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
        runner_up = Alternative(auto.ring, layer_ranges(auto_counts), auto.objective_ms,
                                f"auto would choose {_ring_text(auto.ring, auto_counts)}, "
                                f"{abs(delta):.2f} ms {'faster' if delta > 0 else 'slower'}")
        why.append(f"runner-up: {runner_up.reason}")
    except PlacementError as exc:
        why.append(f"auto placement: {exc}")
    return _build(problem, ring, counts, explicit=True, runner_up=runner_up, why=tuple(why))


def _prompt_cache(problem: RingCosts, ring: tuple[str, ...],
                  ranges: Sequence[tuple[int, int]]) -> tuple[int, list[int], str]:
    """(kept slots, each stage's bytes per kept slot, why) for this ring: the count the
    spec sets, else what each stage's budget buys on the tightest stage. A budget set in
    fleet.yaml that buys no slot is refused: the cache was asked for and would be silent.
    Under a pool of KV pages a kept slot's KV is the pool's, so a slot costs its recurrent
    states alone: nothing for a dense model, whose budget then buys the most."""
    spec, shape = problem.spec, problem.shape
    pooled = spec.kv_pages > 0
    sizes = [kept_slot_bytes(shape, spec.context, r, kv_in_pool=pooled) for r in ranges]
    slot_text = ("its recurrent states; its KV is in the pool" if pooled
                 else f"{spec.context} positions")
    if spec.prompt_cache_slots is not None:
        over = (f", over prompt_cache_bytes {format_bytes(spec.prompt_cache_bytes)}"
                if spec.prompt_cache_bytes is not None else "")
        return spec.prompt_cache_slots, sizes, (f"prompt cache: {spec.prompt_cache_slots} "
                                                f"kept slot(s), as prompt_cache_slots sets{over}")
    budgets = [problem.nodes[n].prompt_cache_budget_bytes for n in ring]
    kept = slots_bought(budgets, sizes)
    tight = min(range(len(ring)), key=lambda i: (budgets[i] // max(1, sizes[i]), i))
    source = ("prompt_cache_bytes" if spec.prompt_cache_bytes is not None
              else "the default budget, a share of each node's usable memory")
    if kept == 0 and spec.prompt_cache_bytes:
        raise PlacementError(
            f"{spec.id}: prompt_cache_bytes {format_bytes(spec.prompt_cache_bytes)} buys no "
            f"kept slot: the tightest stage, rank {tight} on {ring[tight]} (layers "
            f"{ranges[tight][0]}:{ranges[tight][1]}), holds {format_bytes(sizes[tight])} per "
            f"slot ({slot_text}); raise it to at least that, or set "
            "prompt_cache_bytes: 0 to keep none")
    cap = " (the most a budget buys)" if kept == MAX_BUDGET_SLOTS else ""
    if pooled and not any(sizes):
        return kept, sizes, (
            f"prompt cache: {kept} kept slot(s){cap}, bought by {source}: under "
            f"{_pool_text(spec.kv_pages)} a kept slot's KV is the pool's, and the model keeps "
            "no recurrent state, so a slot costs no bytes of its own")
    return kept, sizes, (
        f"prompt cache: {kept} kept slot(s){cap}, bought by {source} "
        + ", ".join(f"{n} {format_bytes(b)}" for n, b in zip(ring, budgets))
        + f"; the tightest stage is rank {tight} on {ring[tight]}, "
        f"{format_bytes(sizes[tight])} per slot" + (f" ({slot_text})" if pooled else ""))


def _build(problem: RingCosts, ring: tuple[str, ...], counts: Sequence[int], explicit: bool,
           runner_up: Alternative | None, why: tuple[str, ...]) -> Placement:
    spec = problem.spec
    hops_decode = problem.hops_ms(ring, spec.parallel) or [0.0]
    hops_chunk = problem.hops_ms(ring, spec.chunk) or [0.0]
    ranges = layer_ranges(counts)
    kept, slot_bytes, cache_why = _prompt_cache(problem, ring, ranges)
    execution = replace(problem.execution, prompt_cache_slots=kept)
    if spec.kv_pages:
        why = (*why, (f"KV: {_pool_text(spec.kv_pages)} on every stage (kv_pages), shared by "
                      f"the {spec.parallel} stream(s) and the {kept} kept slot(s); rank 0 "
                      "admits requests by its pages"))
    stages = tuple(
        Stage(rank=i, node=name, backend=problem.nodes[name].backend, layer_range=rng,
              memory=stage_memory(problem.shape, execution, rng, i == 0),
              usable_memory_bytes=problem.nodes[name].usable_memory_bytes,
              decode_ms=problem.stage_ms(name, "decode", rng),
              prefill_chunk_ms=problem.stage_ms(name, "prefill", rng),
              hop_decode_ms=hops_decode[i % len(hops_decode)],
              hop_chunk_ms=hops_chunk[i % len(hops_chunk)],
              layer_type_counts=tuple(problem.shape.type_counts(rng).items()),
              layer_type_ms=tuple(
                  LayerTypeMs(t.name, *(problem.nodes[name].ms_per_layer(t.name, what)
                                        for what in TIMED)) for t in problem.shape.types),
              prompt_cache_slot_bytes=slot_bytes[i],
              prompt_cache_budget_bytes=0 if spec.prompt_cache_slots is not None
              else problem.nodes[name].prompt_cache_budget_bytes)
        for i, (name, rng) in enumerate(zip(ring, ranges)))
    return Placement(model_id=spec.id, objective=spec.objective, parallel=spec.parallel,
                     prompt_tokens=problem.prompt_tokens, stages=stages,
                     decode_ms_per_token=problem.decode_ms(ring, counts, spec.parallel),
                     decode_ms_per_token_single=problem.decode_ms(ring, counts, 1),
                     prompt_ms=problem.prompt_ms(ring, counts), explicit=explicit,
                     runner_up=runner_up, why=(*why, cache_why), prompt_cache_slots=kept,
                     kv_pages=spec.kv_pages,
                     head_ms=problem.head_ms(ring[0], max(problem.decode_groups(ring))))

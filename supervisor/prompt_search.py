"""The prompt objective's search over ring orders when a stage's cost depends on which layers
it holds (a hybrid's DeltaNet and full-attention layers): exact, by branch and bound.

A cut's prompt time is `sum(stage times) + sum(hops) + (chunks - 1) x max(stage times and
hops)`. With f(T) the least sum of stage times when every stage is within a cap T (the
dynamic program of `supervisor/boundaries.py`), a ring's best is the least, over the caps T
a stage time can take, of f(T) + hops + (chunks - 1) x max(T, slowest hop): the best cut's
own slowest stage is such a T, and no T under-reports its cut's cost. f only grows as T
falls, so a run of caps not yet tried (a "gap") costs at least f at the cap above it plus
(chunks - 1) x its lowest cap: a lower bound, which trying a cap in the gap splits (the
highest that could still beat the answer sought, else the middle).

Every ring starts from its cut of least sum (no cap) and its least bottleneck (no cap
below it fits), found for all rings at once over a tree of ring prefixes (rings that start
alike share their first stages' program), which also says which rings fit. Then one queue of rings ordered by lower bound serves each
question `place` asks (the best ring; the best with another node set or rank 0; the best
with each node the best leaves out): the ring of lowest bound has its lowest gap split until
no ring's bound is below the answer. So only rings that could be an answer are searched,
only where they could be, and each answer is exact (every ring tied with it is searched to
the end too, for the tie-break). docs/placement.md has the argument and the timings.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from supervisor.boundaries import (
    TIME_TOLERANCE,
    PromptCost,
    counts_from_starts,
    min_total_ms,
    next_stage,
)

if TYPE_CHECKING:
    from supervisor.ring_cost import RingCosts

Ring = tuple[str, ...]
Cut = tuple[float, tuple[int, ...]]  # (cost or sum, layer counts)


class RingPrompt:
    """One ring's prompt search: the best cut found (an upper bound on the ring's best) and
    the gaps of caps not yet tried, each (first, end, least sum above it) over `caps`."""

    def __init__(self, problem: RingCosts, ring: Ring, loose: Cut,
                 least_bottleneck_ms: float = 0.0) -> None:
        """`loose`: the ring's cut of least sum; `least_bottleneck_ms`: no cut's slowest
        stage is faster (0 when not known)."""
        self.ring, self.problem = ring, problem
        self.times = [problem.time_prefix(n, "prefill") for n in ring]
        self.rooms = problem.rooms(ring)
        hops = problem.hops_ms(ring, problem.spec.chunk) or []
        self.chunks = problem.chunks
        self.cost = PromptCost(self.times, self.chunks, hops, problem.head_ms(ring[0], 1))
        # hop_sum: the hops and rank 0's head, what every cut of the ring pays once
        self.hop_sum, self.hop_max = self.cost.hop_sum, max(hops, default=0.0)
        self.loose_sum = loose[0]
        self.best: Cut = (self.cost(loose[1]), loose[1])
        # No cut has a stage slower than the slowest hop cheaper than at that hop's time, nor
        # every stage below the mean or the least bottleneck: so no cap below the floor is
        # worth a try; nor one at or above the slowest stage of the cut of least sum, which
        # costs no more than it.
        self.floor = max(self.hop_max, loose[0] / len(ring), least_bottleneck_ms)
        self.slowest = max(self.cost.stage_ms(loose[1]))
        # Until its first split, the one gap's caps are only named by their floor.
        self.caps: list[float] = [self.floor]
        self.gaps: list[tuple[int, int, float]] = []
        self._listed = False
        if self.chunks > 1 and self.slowest > self.floor:
            self.gaps = [(0, 1, loose[0])]
            self._prune()

    @property
    def exact(self) -> bool:
        return not self.gaps

    @property
    def lower_bound(self) -> float:
        return min([self.best[0], *(self._gap_bound(g) for g in self.gaps)])

    def _gap_bound(self, gap: tuple[int, int, float]) -> float:
        first, _, least_sum = gap
        return (least_sum + self.hop_sum
                + (self.chunks - 1) * max(self.caps[first], self.hop_max))

    def _prune(self) -> None:
        """Drop the caps that cannot beat the best cut: a cap T in a gap costs at least the
        least sum above the gap, the hops, and (chunks - 1) x T."""
        kept = []
        for first, end, least_sum in self.gaps:
            end = bisect.bisect_left(self.caps, self._cap_limit(least_sum, self.best[0]),
                                     first, end)
            if first < end and self._gap_bound((first, end, least_sum)) < self.best[0]:
                kept.append((first, end, least_sum))
        self.gaps = kept

    def _cap_limit(self, least_sum: float, cost_ms: float) -> float:
        """Caps from this one up, in a gap of this least sum, cost at least `cost_ms`."""
        return (cost_ms - least_sum - self.hop_sum) / (self.chunks - 1)

    def refine(self, threshold_ms: float = math.inf) -> None:
        """Try a cap of the gap of lowest bound: the middle of the caps that could cost less
        than `threshold_ms` (those above are kept apart as a gap of their own)."""
        if not self._listed:  # every stage time of the ring's nodes from the floor up
            times = self.problem.ring_stage_times(self.ring)
            self.caps = [self.floor, *times[bisect.bisect_right(times, self.floor):
                                            bisect.bisect_left(times, self.slowest)]]
            self.gaps, self._listed = [(0, len(self.caps), self.loose_sum)], True
            self._prune()
            if not self.gaps:
                return
        gap = min(self.gaps, key=self._gap_bound)
        self.gaps.remove(gap)
        first, end, least_sum = gap
        split = bisect.bisect_right(self.caps, self._cap_limit(least_sum, threshold_ms),
                                    first + 1, end)
        if split < end:
            self.gaps.append((split, end, least_sum))
        middle = split - 1 if split < end else (first + split - 1) // 2
        found = min_total_ms(self.times, self.rooms, self.problem.bytes_prefix,
                             self.caps[middle])
        if found is None:  # nor does any lower cap fit
            self.gaps.append((middle + 1, split, least_sum))
        else:
            cost = self.cost(found[1])
            if cost < self.best[0]:
                self.best = (cost, found[1])
            # Every cap from the found cut's slowest stage up to the middle gives its sum.
            # (Within the tolerance, its slowest stage may be a hair above the middle cap.)
            below = min(middle, bisect.bisect_left(self.caps, max(self.cost.stage_ms(found[1])),
                                                   first, middle))
            self.gaps += [(first, below, found[0]), (middle + 1, split, least_sum)]
        self._prune()

    def solve(self, give_up_ms: float = math.inf) -> Cut:
        """The ring's best cut; with `give_up_ms`, sought only below it (a cut that costs at
        least that, not the best, may come back)."""
        while self.gaps and self.lower_bound < min(self.best[0], give_up_ms):
            self.refine()
        return self.best


def least_sum_cuts(problem: RingCosts, rings: Sequence[Ring],
                   kind: str | tuple[int, ...] = "prefill") -> dict[Ring, Cut]:
    """Each ring's cut of least sum of stage times (no cap; `kind` as `RingCosts.stage_ms`
    takes it: prompt chunks by default), for the rings that fit; over a tree of prefixes, so
    rings that start alike share their first stages (a decode search uses it too)."""
    n_layers, bytes_prefix = problem.shape.n_layers, problem.bytes_prefix
    start: list[float] = [0.0] + [math.inf] * n_layers
    programs: dict[Ring, tuple[list[float], list[int]]] = {}

    def program(prefix: Ring) -> tuple[list[float], list[int]]:
        if prefix not in programs:
            before = program(prefix[:-1])[0] if len(prefix) > 1 else start
            j = len(prefix) - 1
            programs[prefix] = next_stage(before, problem.time_prefix(prefix[-1], kind),
                                          problem.room(prefix[-1], j == 0), bytes_prefix, j,
                                          n_layers)
        return programs[prefix]

    out = {}
    for ring in rings:
        if len(ring) > n_layers or problem.hops_ms(ring, 1) is None:
            continue
        total = program(ring)[0][n_layers]
        if total < math.inf:
            starts = [program(ring[:j + 1])[1] for j in range(len(ring))]
            out[ring] = (total, counts_from_starts(starts, n_layers))
    return out


def least_bottlenecks(problem: RingCosts, rings: Sequence[Ring]) -> dict[Ring, float]:
    """Each ring's least slowest stage (prompt chunks) over every cut that fits, over the same
    tree of prefixes: stage j's best for layers [0, e) is the least over its starts s of the
    slower of the stages before (for [0, s)) and its own [s, e), a matrix of every (s, e)
    at once per node (numpy: a window's least of maxima has no monotone queue)."""
    n_layers = problem.shape.n_layers
    span = np.arange(n_layers + 1)
    sizes = np.asarray(problem.bytes_prefix, dtype=np.int64)
    # node, is rank 0 -> stage ms of every range [s, e) that fits its room, else inf
    ranges: dict[tuple[str, bool], np.ndarray] = {}
    programs: dict[Ring, np.ndarray] = {}
    start = np.full(n_layers + 1, np.inf)
    start[0] = 0.0

    def stage(name: str, first: bool) -> np.ndarray:
        if (name, first) not in ranges:
            prefix = np.asarray(problem.time_prefix(name, "prefill"))
            fits = ((span[:, None] < span[None, :])
                    & (sizes[None, :] - sizes[:, None] <= problem.room(name, first)))
            ranges[(name, first)] = np.where(fits, prefix[None, :] - prefix[:, None], np.inf)
        return ranges[(name, first)]

    def program(prefix: Ring) -> np.ndarray:
        if prefix not in programs:
            before = program(prefix[:-1]) if len(prefix) > 1 else start
            programs[prefix] = np.maximum(before[:, None],
                                          stage(prefix[-1], len(prefix) == 1)).min(axis=0)
        return programs[prefix]

    return {ring: float(program(ring)[n_layers]) for ring in rings}


def search_prompt_rings(problem: RingCosts, rings: Sequence[Ring]
                        ) -> tuple[list[tuple[Ring, tuple[int, ...]]], int]:
    """The rings searched to their best cut, enough to answer what `place` reports exactly
    (the best ring; the best with another node set or rank 0; the best with each node the
    best leaves out), and how many rings fit."""
    cuts = least_sum_cuts(problem, rings)
    bottlenecks = least_bottlenecks(problem, list(cuts))
    searches = [RingPrompt(problem, ring, cut, bottlenecks[ring]) for ring, cut in cuts.items()]
    if not searches:
        return [], 0

    def rank(s: RingPrompt) -> tuple:
        return problem.result_for(s.ring, s.best[1]).rank

    best = min((s for s in _answer(searches, lambda ring: True)), key=rank)
    same = (best.ring[0], frozenset(best.ring))
    _answer(searches, lambda ring: (ring[0], frozenset(ring)) != same)
    for name in {n for s in searches for n in s.ring} - set(best.ring):
        _answer(searches, lambda ring, name=name: name in ring)
    return [(s.ring, s.best[1]) for s in searches if s.exact], len(searches)


def _answer(searches: list[RingPrompt], wanted: Callable[[Ring], bool]) -> list[RingPrompt]:
    """Search the `wanted` rings until none could cost less than (or tie) the least found;
    the rings that cost that least."""
    queue = [(s.lower_bound, i) for i, s in enumerate(searches) if wanted(s.ring)]
    if not queue:
        return []
    heapq.heapify(queue)
    least = min(searches[i].best[0] for _, i in queue)
    while queue and queue[0][0] <= least + TIME_TOLERANCE:
        _, i = heapq.heappop(queue)
        s = searches[i]
        if s.exact:
            continue
        s.refine(least + TIME_TOLERANCE)
        least = min(least, s.best[0])
        heapq.heappush(queue, (s.lower_bound, i))
    return [s for s in searches if wanted(s.ring) and s.exact
            and s.best[0] <= least + TIME_TOLERANCE]

"""The best contiguous layer ranges for one ring order when a stage's cost depends on which
layers it holds, not only how many (a hybrid's DeltaNet and full-attention layers differ).

Pure arithmetic over running sums: stage j holding layers [s, e) takes
`time_prefix[j][e] - time_prefix[j][s]` ms and `bytes_prefix[e] - bytes_prefix[s]` bytes,
which must fit its `room`. A dynamic program over layer prefixes, one stage at a time; the
ranges a stage may take for a given end are a window whose both ends only move forward (more
layers never cost fewer bytes or ms), so a monotone queue finds each window's best start and
one stage costs O(layers). `supervisor/placement.py` uses it; docs/placement.md says why the
prompt search below is exact.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

TIME_TOLERANCE = 1e-9  # ms: a stage time equal to a bottleneck candidate is within it


def min_total_ms(time_prefix: Sequence[Sequence[float]], rooms: Sequence[int],
                 bytes_prefix: Sequence[int],
                 time_cap_ms: float = math.inf) -> tuple[float, tuple[int, ...]] | None:
    """The least sum of stage times over every cut of the layers into `len(rooms)` non-empty
    contiguous ranges, in order, each within its room and within `time_cap_ms`; with the layer
    counts that reach it. None when no cut fits."""
    n_layers, stages = len(bytes_prefix) - 1, len(rooms)
    if stages < 1 or stages > n_layers:
        return None
    best = [0.0] + [math.inf] * n_layers  # best[e]: layers [0, e) on the stages so far
    starts: list[list[int]] = []
    for j, (prefix, room) in enumerate(zip(time_prefix, rooms, strict=True)):
        here, start = [math.inf] * (n_layers + 1), [-1] * (n_layers + 1)
        window: deque[int] = deque()  # starts s, their best[s] - prefix[s] increasing
        low, added = 0, j  # every stage before this one holds a layer: s >= j
        last = n_layers - (stages - 1 - j)  # and every one after it will
        for e in range(j + 1, last + 1):
            while added < e:  # s = e - 1 joins the window
                if best[added] < math.inf:
                    value = best[added] - prefix[added]
                    while window and best[window[-1]] - prefix[window[-1]] >= value:
                        window.pop()
                    window.append(added)
                added += 1
            while low < e and (bytes_prefix[e] - bytes_prefix[low] > room
                               or prefix[e] - prefix[low] > time_cap_ms + TIME_TOLERANCE):
                low += 1
            while window and window[0] < low:
                window.popleft()
            if window:
                s = window[0]
                here[e], start[e] = best[s] - prefix[s] + prefix[e], s
        best = here
        starts.append(start)
    if best[n_layers] == math.inf:
        return None
    ends = [n_layers]
    for start in reversed(starts[1:]):
        ends.append(start[ends[-1]])
    bounds = [0, *reversed(ends)]
    return best[n_layers], tuple(b - a for a, b in itertools.pairwise(bounds))


def stage_times(prefix: Sequence[float]) -> list[float]:
    """Every time a stage on this node can take: one per layer range, ascending, distinct."""
    n = len(prefix) - 1
    return sorted({prefix[e] - prefix[s] for s in range(n) for e in range(s + 1, n + 1)})


@dataclass(frozen=True)
class PromptStart:
    """What a ring's prompt search starts from, and a lower bound on its cost."""

    loose: tuple[float, tuple[int, ...]]  # the cut of least sum, no cap
    best: tuple[float, tuple[int, ...]]  # the cheaper of that and the least-bottleneck cut
    caps: list[float]  # the stage times a cap may take, the floor first, ascending
    floor: float  # the slowest hop, or the mean stage of the loose cut: no cap pays below
    lower_bound_ms: float  # no cut of this ring costs less


class PromptCost:
    """The prompt cost of a cut: sum(stage times) + sum(hops) + (chunks - 1) x max(stage
    times and hops)."""

    def __init__(self, time_prefix: Sequence[Sequence[float]], chunks: int,
                 hop_ms: Sequence[float]) -> None:
        self.time_prefix, self.chunks, self.hop_ms = time_prefix, chunks, list(hop_ms)
        self.hop_sum = sum(hop_ms)

    def stage_ms(self, counts: tuple[int, ...]) -> list[float]:
        times, s = [], 0
        for prefix, count in zip(self.time_prefix, counts, strict=True):
            times.append(prefix[s + count] - prefix[s])
            s += count
        return times

    def __call__(self, counts: tuple[int, ...]) -> float:
        times = self.stage_ms(counts)
        return sum(times) + self.hop_sum + (self.chunks - 1) * max(times + self.hop_ms)


def prompt_start(time_prefix: Sequence[Sequence[float]], rooms: Sequence[int],
                 bytes_prefix: Sequence[int], candidate_times: Sequence[Sequence[float]],
                 chunks: int, hop_ms: Sequence[float]) -> PromptStart | None:
    """The cut of least sum, the cut of least bottleneck (a bisection over the caps:
    feasibility only grows with the cap), and from them a lower bound: the least sum, the
    hops, and (chunks - 1) x the least bottleneck or the slowest hop. None: no cut fits.
    `candidate_times[j]` is `stage_times` of stage j's node."""
    loose = min_total_ms(time_prefix, rooms, bytes_prefix)
    if loose is None:
        return None
    cost = PromptCost(time_prefix, chunks, hop_ms)
    best = (cost(loose[1]), loose[1])
    floor = max(max(hop_ms, default=0.0), loose[0] / len(rooms))
    if chunks == 1:
        return PromptStart(loose, best, [floor], floor, best[0])
    caps = sorted({floor, *(t for ts in candidate_times for t in ts if t > floor)})
    low, high = 0, bisect.bisect_left(caps, max(cost.stage_ms(loose[1])))
    while low < high:
        middle = (low + high) // 2
        found = min_total_ms(time_prefix, rooms, bytes_prefix, caps[middle])
        if found is None:
            low = middle + 1
        else:
            high = middle
            if (c := cost(found[1])) < best[0]:
                best = (c, found[1])
    # caps[low] is the least bottleneck if above the floor; else every cut's bottleneck
    # (with the slowest hop) is at least the floor.
    bound = loose[0] + cost.hop_sum + (chunks - 1) * max(caps[min(low, len(caps) - 1)], floor)
    return PromptStart(loose, best, caps, floor, min(bound, best[0]))


def min_prompt_ms(time_prefix: Sequence[Sequence[float]], rooms: Sequence[int],
                  bytes_prefix: Sequence[int], chunks: int, hop_ms: Sequence[float],
                  start: PromptStart,
                  give_up_ms: float = math.inf) -> tuple[float, tuple[int, ...]]:
    """The cut minimising sum(stage times) + sum(hops) + (chunks - 1) x max(stage times and
    hops), with its counts, from `prompt_start`'s answer for the same ring.

    The least sum with every stage within a cap T, f(T), only grows as T falls. The search
    starts with no cap and, each time, lowers the cap to the largest stage time below the
    slowest stage just found (caps between give the same cut), stopping when no cut fits or
    a cap is too low to pay. Exact: take the best cut's own bottleneck T* (its slowest
    stage). The last cap tried that is at least T* gives a cut whose sum is at most the best
    cut's, and whose slowest stage is at most T* (or the next cap would be at least T*); so it
    costs no more than the best cut. A cap below the floor (the slowest hop, or the mean
    stage time of the cut with no cap) gains nothing, and above `limit` cannot pay.

    With `give_up_ms`, a cut is sought only below it: when the best costs at least that, a
    cut that does (not the best) may be returned.
    """
    best, loose, caps, floor = start.best, start.loose, start.caps, start.floor
    if chunks == 1:
        return best
    cost = PromptCost(time_prefix, chunks, hop_ms)
    times = cost.stage_ms(loose[1])
    cap = math.inf
    while True:
        limit = ((min(best[0], give_up_ms) - loose[0] - cost.hop_sum) / (chunks - 1)
                 + TIME_TOLERANCE)
        below = bisect.bisect_left(caps, min(max(times), cap)) - 1
        if below < 0 or limit < floor:
            break
        cap = min(caps[below], limit)
        found = min_total_ms(time_prefix, rooms, bytes_prefix, cap)
        if found is None:
            break
        times = cost.stage_ms(found[1])
        if (c := cost(found[1])) < best[0]:
            best = (c, found[1])
    return best

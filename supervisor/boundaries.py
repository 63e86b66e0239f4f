"""The best contiguous layer ranges for one ring order when a stage's cost depends on which
layers it holds, not only how many (a hybrid's DeltaNet and full-attention layers differ).

Pure arithmetic over running sums: stage j holding layers [s, e) takes
`time_prefix[j][e] - time_prefix[j][s]` ms and `bytes_prefix[e] - bytes_prefix[s]` bytes,
which must fit its `room`. A dynamic program over layer prefixes, one stage at a time; the
ranges a stage may take for a given end are a window whose both ends only move forward (more
layers never cost fewer bytes or ms), so a monotone queue finds each window's best start and
one stage costs O(layers). `supervisor/ring_cost.py` uses it for one ring,
`supervisor/prompt_search.py` for a prompt's caps and for every ring at once (`next_stage`).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence

TIME_TOLERANCE = 1e-9  # ms: a stage time equal to a bottleneck candidate is within it


def min_total_ms(time_prefix: Sequence[Sequence[float]], rooms: Sequence[int],
                 bytes_prefix: Sequence[int],
                 time_cap_ms: float | Sequence[float] = math.inf,
                 cap_prefix: Sequence[Sequence[float]] | None = None,
                 ) -> tuple[float, tuple[int, ...]] | None:
    """The least sum of stage times over every cut of the layers into `len(rooms)` non-empty
    contiguous ranges, in order, each within its room and within `time_cap_ms` (one cap, or
    one per stage); with the layer counts that reach it. None when no cut fits. The cap holds
    each stage's time, or with `cap_prefix` another running sum per stage (a decode stage's
    work over every group in flight, while the sum is of one group's trip)."""
    n_layers, stages = len(bytes_prefix) - 1, len(rooms)
    if stages < 1 or stages > n_layers:
        return None
    caps = [time_cap_ms] * stages if isinstance(time_cap_ms, (int, float)) else time_cap_ms
    capped = cap_prefix or time_prefix
    best = [0.0] + [math.inf] * n_layers  # best[e]: layers [0, e) on the stages so far
    starts: list[list[int]] = []
    for j, (prefix, room) in enumerate(zip(time_prefix, rooms, strict=True)):
        best, start = next_stage(best, prefix, room, bytes_prefix, j,
                                 n_layers - (stages - 1 - j), caps[j], capped[j])
        starts.append(start)
    if best[n_layers] == math.inf:
        return None
    return best[n_layers], counts_from_starts(starts, n_layers)


def next_stage(best: Sequence[float], prefix: Sequence[float], room: int,
               bytes_prefix: Sequence[int], j: int, last: int,
               time_cap_ms: float = math.inf,
               cap_prefix: Sequence[float] | None = None) -> tuple[list[float], list[int]]:
    """One more stage (the `j`-th, 0-based) after stages whose least sums for layers [0, s)
    are `best[s]`: the least sums for [0, e) with this stage holding [s, e), e up to `last`,
    and each e's start s (-1: none). `time_cap_ms` bounds `prefix`'s range, or
    `cap_prefix`'s when given (another non-decreasing running sum)."""
    capped = prefix if cap_prefix is None else cap_prefix
    n_layers = len(bytes_prefix) - 1
    here, start = [math.inf] * (n_layers + 1), [-1] * (n_layers + 1)
    # The hot loop of every search: plain locals, each start's value computed once.
    window: deque[int] = deque()  # starts s, their values best[s] - prefix[s] increasing
    values: deque[float] = deque()
    inf, limit = math.inf, time_cap_ms + TIME_TOLERANCE
    low, added = 0, j  # every stage before this one holds a layer: s >= j
    for e in range(j + 1, last + 1):
        if added < e:  # s = e - 1 joins the window
            if best[added] < inf:
                value = best[added] - prefix[added]
                while values and values[-1] >= value:
                    values.pop()
                    window.pop()
                window.append(added)
                values.append(value)
            added += 1
        floor_bytes, floor_ms = bytes_prefix[e] - room, capped[e] - limit
        while low < e and (bytes_prefix[low] < floor_bytes or capped[low] < floor_ms):
            low += 1
        while window and window[0] < low:
            window.popleft()
            values.popleft()
        if window:
            here[e], start[e] = values[0] + prefix[e], window[0]
    return here, start


def counts_from_starts(starts: Sequence[Sequence[int]], n_layers: int) -> tuple[int, ...]:
    """The layer counts of the cut whose stages' starts (`next_stage`'s) end at `n_layers`."""
    ends = [n_layers]
    for start in reversed(starts[1:]):
        ends.append(start[ends[-1]])
    bounds = [0, *reversed(ends)]
    return tuple(b - a for a, b in itertools.pairwise(bounds))


def stage_times(prefix: Sequence[float]) -> list[float]:
    """Every time a stage on this node can take: one per layer range, ascending, distinct."""
    n = len(prefix) - 1
    return sorted({prefix[e] - prefix[s] for s in range(n) for e in range(s + 1, n + 1)})


class PromptCost:
    """The prompt cost of a cut: sum(stage times) + sum(hops) + rank 0's head (`head_ms`, on
    the last chunk's row) + (chunks - 1) x max(stage times and hops)."""

    def __init__(self, time_prefix: Sequence[Sequence[float]], chunks: int,
                 hop_ms: Sequence[float], head_ms: float = 0.0) -> None:
        self.time_prefix, self.chunks, self.hop_ms = time_prefix, chunks, list(hop_ms)
        self.hop_sum = sum(hop_ms) + head_ms  # what every cut of the ring pays once

    def stage_ms(self, counts: tuple[int, ...]) -> list[float]:
        times, s = [], 0
        for prefix, count in zip(self.time_prefix, counts, strict=True):
            times.append(prefix[s + count] - prefix[s])
            s += count
        return times

    def __call__(self, counts: tuple[int, ...]) -> float:
        times = self.stage_ms(counts)
        return sum(times) + self.hop_sum + (self.chunks - 1) * max(times + self.hop_ms)

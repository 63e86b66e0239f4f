"""What a decode token costs when several rounds are in flight, and the cut that costs least.

Rank 0's lane host keeps up to one round per stage in flight, each carrying a group of
`decode_rows_per_round` streams (`engine/pipeline/round_builder.py`, the one place that rule
lives): with S stages and P streams, groups of ceil(P / S) rows. Each stream gets one token
each time its group comes back, so a stream's ms per token is the period of the rounds, the
largest of:

- the largest group's full trip: every stage's layers at its rows and its host work of a
  round, every hop (its host work at both ends included), and rank 0's final norm, head
  and sampling (a group cannot come back sooner than it goes round);
- each stage's work summed over every group in flight (its host work each round, rank 0's
  head included): a stage
  runs the groups one after another, so it is busy that long between two rounds of a group;
- each link's transfers summed over the groups.

One group (one stream, or one stage) is the plain trip, the sum of the stages. The
calibration times a layer and the head at 1 row and at `parallel` rows; a group between
them is priced on the line through the two (`rows_ms`).

The cut search is exact: with T a cap on every stage's summed work, S(T) the least trip over
the cuts that keep every stage within T (a capped fill, or `supervisor/boundaries.py`'s
dynamic program for layers of several types), a ring's best is the least over the values T
a stage's work takes of max(S(T) + the trip's constant part, T). S only falls as T grows,
so the least is where the two cross: found by binary search over the sorted values.
docs/placement.md gives the argument; tests/supervisor/test_decode_groups.py checks it
against brute force over every cut.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

from engine.pipeline.round_builder import decode_groups

Cut = tuple[float, tuple[int, ...]]  # (trip sum of the stages, layer counts)

__all__ = ["decode_groups", "groups_for", "period_ms", "rows_ms", "search_cap"]


def groups_for(streams: int, stages: int) -> tuple[int, ...]:
    """The rows of each decode round in flight: `streams` streams on a ring of `stages`
    stages, whose rank 0 keeps one round per stage in flight (FLEET_ROUNDS_IN_FLIGHT unset)."""
    return decode_groups(max(1, streams), stages)


def rows_ms(single_ms: float, batch_ms: float, batch_rows: int, rows: int) -> float:
    """ms of a round of `rows` rows from the calibration's 1 row and `batch_rows` rows: the
    line through them (a batch of 1, or 1 row: the single figure)."""
    if rows == 1 or batch_rows <= 1:
        return single_ms
    return single_ms + (batch_ms - single_ms) * (rows - 1) / (batch_rows - 1)


def period_ms(trip_ms: float, stage_work_ms: Sequence[float],
              link_work_ms: Sequence[float]) -> float:
    """A stream's ms per token: the largest of its group's trip, any stage's work over every
    group in flight, any link's."""
    return max(trip_ms, *stage_work_ms, *link_work_ms)


def search_cap(caps_ms: Sequence[float], trip_constant_ms: float,
               least_trip: Callable[[float], Cut | None],
               cost: Callable[[tuple[int, ...]], float]) -> Cut | None:
    """The cut of least period: `caps_ms`, every value a stage's summed work can take;
    `least_trip(T)`, the cut of least trip sum with every stage's work within T (None: none
    fits); `cost(counts)`, a cut's period. Returns (its period, its counts).

    With g(T) = max(S(T) + constant, T), S non-increasing: the first cap where S(T) +
    constant <= T, or the one before it, holds the least g; and a cut found under T costs
    at most g(T) (its stages are within T), while the best cut's own largest stage work is a
    cap under which it is found, so the least g is the best period."""
    caps = sorted(set(caps_ms))
    found: dict[int, Cut | None] = {}

    def at(i: int) -> Cut | None:
        if i not in found:
            found[i] = least_trip(caps[i])
        return found[i]

    def crossed(i: int) -> bool:
        cut = at(i)
        return cut is not None and cut[0] + trip_constant_ms <= caps[i]

    # bisect over the predicate "crossed": False ... False True ... True
    first = bisect.bisect_left(range(len(caps)), True, key=crossed)
    options = [at(i) for i in (first - 1, first) if 0 <= i < len(caps)]
    options = [(cost(cut[1]), cut[1]) for cut in options if cut is not None]
    return min(options) if options else None

"""Rank 0's boot checks: the layer layout and every stage's description, refused by name.

Pure functions over what the stages said (RFC 6.4, v0's decisions): ranges half-open and
contiguous from layer 0 to the model's layer count, one engine release, ring neighbours
that agree on the boundary format, the same execution shapes, and the capacity floor.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.link.errors import (
    CapacityTooSmall,
    EmptyLayerRange,
    FormatMismatch,
    LayoutGap,
    LayoutOverlap,
    LayoutOverrun,
    RankMismatch,
    ShapeMismatch,
    VersionMismatch,
    WorldMismatch,
)
from engine.link.messages import Describe


def check_layout(ranges: Sequence[tuple[int, int]], n_layers: int) -> None:
    """`ranges[rank]` is that rank's half-open [first, end); together they must be [0, n)."""
    if n_layers <= 0:
        raise ValueError(f"a model has at least one layer, not {n_layers}")
    if not ranges:
        raise LayoutGap(f"no rank holds any of the {n_layers} layers")
    expected_first = 0
    for rank, (first, end) in enumerate(ranges):
        if first >= end:
            raise EmptyLayerRange(f"rank {rank}'s layer range {first}..{end} holds no layer")
        if rank == 0 and first < 0:
            raise LayoutOverrun(f"rank 0 starts at layer {first}, before layer 0")
        if rank == 0 and first > 0:
            raise LayoutGap(f"layers 0..{first} are held by no rank: rank 0 starts at {first}")
        if first > expected_first:
            raise LayoutGap(f"layer ranges leave a gap: rank {rank - 1} ends at "
                            f"{expected_first}, rank {rank} starts at {first}")
        if first < expected_first:
            raise LayoutOverlap(f"layer ranges overlap: rank {rank - 1} ends at "
                                f"{expected_first}, rank {rank} starts at {first}")
        if end > n_layers:
            raise LayoutOverrun(f"rank {rank}'s range {first}..{end} runs past the model's "
                                f"{n_layers} layers")
        expected_first = end
    if expected_first < n_layers:
        raise LayoutGap(f"layers {expected_first}..{n_layers} are held by no rank: the last "
                        f"rank, {len(ranges) - 1}, ends at {expected_first}")


def check_descriptions(
    descs: Sequence[Describe],
    *,
    n_layers: int,
    engine_version: str,
    context: int,
    parallel: int,
) -> list[Describe]:
    """Refuse the first thing wrong with the stages' descriptions; return them by rank.

    Rank 0 runs this once every stage has described itself, before any round. The world is
    rank 0's; each rank 0..world-1 must describe itself exactly once. Boundary formats are
    compared around the whole ring (the last stage's rows go back to rank 0), row dtype
    included: a stage reads its neighbour's rows as its own format, converting nothing.
    """
    by_rank: dict[int, Describe] = {}
    for d in descs:
        if d.rank in by_rank:
            raise RankMismatch(f"rank {d.rank} described itself twice")
        by_rank[d.rank] = d
    if 0 not in by_rank:
        raise RankMismatch("no description from rank 0")
    world = by_rank[0].world
    for d in descs:
        if d.world != world:
            raise WorldMismatch(f"rank {d.rank} runs a world of {d.world}; rank 0 runs {world}")
    missing = sorted(set(range(world)) - by_rank.keys())
    if missing:
        raise RankMismatch(f"ranks {missing} of a world of {world} sent no description")
    extra = sorted(by_rank.keys() - set(range(world)))
    if extra:
        raise RankMismatch(f"ranks {extra} are outside a world of {world}")
    ordered = [by_rank[rank] for rank in range(world)]

    for d in ordered:
        if d.engine_version != engine_version:
            raise VersionMismatch(f"rank {d.rank} runs engine {d.engine_version}; rank 0's "
                                  f"placement runs {engine_version}")
    check_layout([d.layer_range for d in ordered], n_layers)

    first = ordered[0]
    for d in ordered:
        if d.hidden == 0 or d.planes == 0:
            raise FormatMismatch(f"rank {d.rank} declares hidden width {d.hidden} and "
                                 f"{d.planes} planes; both must be at least 1")
        for name in ("prompt_chunk", "max_rows_per_round"):
            if getattr(d, name) != getattr(first, name):
                raise ShapeMismatch(f"rank {d.rank} declares {name} {getattr(d, name)}; "
                                    f"rank 0 declares {getattr(first, name)}")
        if d.context != context:
            raise ShapeMismatch(f"rank {d.rank} declares context {d.context}; the placement "
                                f"runs {context}")
        if d.parallel != parallel:
            raise ShapeMismatch(f"rank {d.rank} declares parallel {d.parallel}; the placement "
                                f"runs {parallel}")
    if world > 1:
        for sender in ordered:
            receiver = ordered[(sender.rank + 1) % world]
            _check_boundary(sender, receiver)

    for d in ordered:
        if d.kv_rows < context:
            raise CapacityTooSmall(f"rank {d.rank} holds {d.kv_rows} KV rows; the context "
                                   f"needs {context}")
        if d.recurrent_states < parallel:
            raise CapacityTooSmall(f"rank {d.rank} holds {d.recurrent_states} recurrent "
                                   f"states; --parallel needs {parallel}")
    return ordered


def _check_boundary(sender: Describe, receiver: Describe) -> None:
    hop = f"rank {sender.rank} -> rank {receiver.rank}"
    for name in ("hidden", "planes", "drafter_width"):
        ours, theirs = getattr(sender, name), getattr(receiver, name)
        if ours != theirs:
            raise FormatMismatch(f"{hop}: {name} differs: rank {sender.rank} declares {ours}, "
                                 f"rank {receiver.rank} declares {theirs}")
    if sender.row_dtype != receiver.row_dtype:
        raise FormatMismatch(
            f"{hop}: row dtype differs: rank {sender.rank} sends {sender.row_dtype.label}, "
            f"rank {receiver.rank} expects {receiver.row_dtype.label}"
        )

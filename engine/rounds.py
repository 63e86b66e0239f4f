"""A round's plan: which streams run, at which positions, with how many rows (RFC 6.4).

Rank 0 builds one `RoundPlan` per round; every stage runs it over its own layer range.
The same objects drive one process and a pipeline, so the stage link only has to put
them on the wire (engine.link.messages).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum


class Op(IntEnum):
    """What a stream entry does to its slot before its rows run."""

    OPEN = 1  # a new stream: the slot starts empty at position 0, generation 0
    CONTINUE = 2  # more rows (prompt chunk or decode) for an open slot
    CLOSE = 3  # the stream finished: release the slot; no rows
    CANCEL = 4  # the stream was abandoned (client gone, error): release; no rows
    RESUME = 5  # restart from a kept prompt state at `resume` positions


@dataclass(frozen=True)
class StreamEntry:
    """One stream's part of a round. The stream id is its slot (lane) index."""

    stream_id: int
    op: Op
    first: int  # position of the first row
    rows: int  # rows this round (0 for close / cancel)
    accepted: int  # rows of the stream's previous round that stay in its state
    resume: int  # kept-state position for RESUME, else 0
    generation: int  # the slot's state generation this entry expects

    @property
    def end(self) -> int:
        return self.first + self.rows


@dataclass(frozen=True)
class RoundPlan:
    """A round: stream entries in ascending id order, rows laid out in that order."""

    round_no: int
    entries: tuple[StreamEntry, ...]
    # Row offsets across the whole round where a prompt chunk ends (strictly ascending,
    # inside the round). v1 runs a round as one batch; the cuts are carried for v2.
    cuts: tuple[int, ...] = field(default=())

    @property
    def total_rows(self) -> int:
        return sum(e.rows for e in self.entries)

    @property
    def is_keepalive(self) -> bool:
        return not self.entries

    def row_spans(self) -> list[tuple[StreamEntry, int, int]]:
        """(entry, start, stop) of each entry's rows in the round's row order."""
        spans, start = [], 0
        for entry in self.entries:
            spans.append((entry, start, start + entry.rows))
            start += entry.rows
        return spans

    def returned_rows(self) -> list[int]:
        """Row indices that travel back to rank 0: the last row of each entry with rows."""
        return [stop - 1 for entry, _start, stop in self.row_spans() if entry.rows]

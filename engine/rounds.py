"""A round's plan: which streams run, at which positions, with how many rows (RFC 6.4).

Rank 0 builds one `RoundPlan` per round; every stage runs it over its own layer range.
The same objects drive one process and a pipeline, so the stage link only has to put
them on the wire (engine.link.messages).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import IntEnum
from itertools import pairwise


class Op(IntEnum):
    """What a stream entry does to its slot before its rows run."""

    OPEN = 1  # a new stream: the slot starts empty at position 0, generation 0
    CONTINUE = 2  # more rows (prompt chunk or decode) for an open slot
    CLOSE = 3  # the stream finished: release the slot; no rows
    CANCEL = 4  # the stream was abandoned (client gone, error): release; no rows
    RESUME = 5  # restart from a kept prompt state at `resume` positions


# A CONTINUE entry of 2 to VERIFY_ROWS rows is a verify entry: a stream's newest token and
# the tokens drafted after it (engine.lanes.drafting). Every row of it comes back to rank 0,
# whose head scores them all, and every stage can keep any prefix of its rows (the next
# entry's `accepted`). The wire carries no mark: every stage reads the same plan the same
# way. A prompt's tail of that many rows is read as one too; its extra rows cost nothing
# worth a field.
VERIFY_ROWS = 8
MAX_DRAFT_TOKENS = VERIFY_ROWS - 1  # a verify entry is the newest token and its drafts


def is_verify(op: Op, rows: int) -> bool:
    """The rule that makes an entry a verify entry, for those who know its op and rows but
    hold no entry (rank 0's prompt-cache record)."""
    return op == Op.CONTINUE and 1 < rows <= VERIFY_ROWS


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

    @property
    def verifies(self) -> bool:
        """A verify entry (VERIFY_ROWS): all its rows return, any prefix of them may stay."""
        return is_verify(self.op, self.rows)


@dataclass(frozen=True)
class RoundPlan:
    """A round: stream entries in ascending id order, rows laid out in that order."""

    round_no: int
    entries: tuple[StreamEntry, ...]
    # Row offsets across the whole round where a prompt chunk ends (strictly ascending,
    # inside the round), as the wire format (RFC 6.4) carries them. Every stage runs a round
    # as one batch; overlapped prompts put each chunk in its own round instead (the lane
    # host, engine/lanes/host.py), so the rounds rank 0 builds carry no cuts.
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

    def returned_rows(self, every_row: bool = False) -> list[int]:
        """Row indices that travel back to rank 0: every row of a verify entry, the last row
        of each other entry with rows (the rows rank 0's head scores). `every_row`: every
        row of the round, where rank 0 drafts with a draft head, which reads a prompt's
        rows too (engine.draft_head); the head still scores only the rows above."""
        if every_row:
            return list(range(self.total_rows))
        return [row for entry, start, stop in self.row_spans() if entry.rows
                for row in (range(start, stop) if entry.verifies else (stop - 1,))]

    def returned_by_stream(self) -> dict[int, range]:
        """Stream id -> its rows' indices among the returned rows (the last is the one that
        predicts the token after the entry)."""
        spans, at = {}, 0
        for entry in self.entries:
            if entry.rows:
                count = entry.rows if entry.verifies else 1
                spans[entry.stream_id] = range(at, at + count)
                at += count
        return spans


@dataclass(frozen=True)
class RowSpan:
    """A multi-row entry's rows: [start, stop) in the round, positions [first, end)."""

    start: int
    stop: int
    slot: int
    first: int
    end: int


@dataclass(frozen=True)
class RowLayout:
    """Where each row of a round sits, as plain lists every backend turns into tensors.

    One-row entries (decode rows) are batched into one attention call; each multi-row
    entry (a prompt chunk) attends over its own slot. A verify entry's rows are batched
    with the decode rows, one single row each at its own position (every row's K and V are
    written before any row attends, so each sees its entry's earlier rows): the decode
    path's kernels and captured graphs run them, and a recurrent layer runs them in steps,
    row j of every slot at once (`rows_a_slot` steps), since its step cannot take two rows
    of one slot in one batch.
    """

    positions: list[int]  # per row
    slots: list[int]  # per row
    single_rows: list[int]  # rows that are one-row entries
    single_slots: list[int]
    single_positions: list[int]
    spans: list[RowSpan]

    @classmethod
    def of(cls, plan: RoundPlan) -> RowLayout:
        layout = cls([], [], [], [], [], [])
        for entry, start, stop in plan.row_spans():
            if not entry.rows:
                continue
            layout.positions.extend(range(entry.first, entry.end))
            layout.slots.extend([entry.stream_id] * entry.rows)
            if entry.rows == 1 or entry.verifies:
                layout.single_rows.extend(range(start, stop))
                layout.single_slots.extend([entry.stream_id] * entry.rows)
                layout.single_positions.extend(range(entry.first, entry.end))
            else:
                layout.spans.append(RowSpan(start, stop, entry.stream_id, entry.first,
                                            entry.end))
        return layout

    @property
    def single_keys(self) -> int:
        """Keys the batched single rows need: [0, single_keys)."""
        return max(self.single_positions) + 1 if self.single_positions else 0

    @property
    def rows_a_slot(self) -> int:
        """The most single rows one slot holds (1: decode rows only; 0: none)."""
        return max(Counter(self.single_slots).values(), default=0)

    @property
    def single_span(self) -> tuple[int, int] | None:
        """The single rows' slots as [a, b) when they run through every slot from a to
        b - 1 in order, each one row or more (a decode round, verify rows among it): the
        shape the decode graphs take, with each row's slot an offset from a."""
        slots = self.single_slots
        if slots and all(0 <= b - a <= 1 for a, b in pairwise(slots)):
            return slots[0], slots[-1] + 1
        return None

"""Every stage's slot table refuses a plan it disagrees with, by name, and changes nothing."""

from __future__ import annotations

import pytest

from engine.link.errors import BadEntry, GenerationMismatch
from engine.rounds import Op, RoundPlan, StreamEntry
from engine.slots import SlotTable


def plan(*entries: StreamEntry, round_no: int = 1) -> RoundPlan:
    return RoundPlan(round_no, tuple(entries))


def test_open_continue_keep_close():
    table = SlotTable(parallel=2, context=16)
    table.apply(plan(StreamEntry(0, Op.OPEN, 0, 5, 0, 0, 0)))
    assert (table.slots[0].offset, table.slots[0].generation) == (5, 0)
    table.apply(plan(StreamEntry(0, Op.CONTINUE, 5, 3, 5, 0, 0)))
    # A keep: only 1 of the last round's 3 rows stays; the generation advances.
    table.apply(plan(StreamEntry(0, Op.CONTINUE, 6, 1, 1, 0, 0)))
    assert (table.slots[0].offset, table.slots[0].generation) == (7, 1)
    table.apply(plan(StreamEntry(0, Op.CLOSE, 0, 0, 0, 0, 1)))
    assert not table.slots[0].open and table.in_use() == 0


@pytest.mark.parametrize("entry, error, words", [
    (StreamEntry(0, Op.CONTINUE, 4, 1, 4, 0, 1), GenerationMismatch, "generation 1"),
    (StreamEntry(0, Op.CONTINUE, 3, 1, 4, 0, 0), BadEntry, "first 3"),
    (StreamEntry(0, Op.OPEN, 0, 1, 0, 0, 0), BadEntry, "already open"),
    (StreamEntry(1, Op.CONTINUE, 0, 1, 0, 0, 0), BadEntry, "closed slot"),
    (StreamEntry(5, Op.OPEN, 0, 1, 0, 0, 0), BadEntry, "no such slot"),
    (StreamEntry(0, Op.CONTINUE, 4, 20, 4, 0, 0), BadEntry, "exceed context"),
    (StreamEntry(0, Op.CONTINUE, 4, 1, 9, 0, 0), BadEntry, "accepted 9"),
    (StreamEntry(0, Op.RESUME, 4, 1, 0, 2, 0), BadEntry, "prompt cache"),
])
def test_a_bad_entry_is_refused_by_name_and_nothing_moves(entry, error, words):
    table = SlotTable(parallel=2, context=16)
    table.apply(plan(StreamEntry(0, Op.OPEN, 0, 4, 0, 0, 0)))
    before = [vars(s).copy() for s in table.slots]
    good = StreamEntry(1, Op.OPEN, 0, 1, 0, 0, 0) if entry.stream_id != 1 else None
    entries = tuple(sorted([e for e in (entry, good) if e], key=lambda e: e.stream_id))
    with pytest.raises(error, match=words):
        table.apply(RoundPlan(2, entries))
    assert [vars(s) for s in table.slots] == before

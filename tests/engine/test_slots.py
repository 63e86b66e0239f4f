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
    (StreamEntry(0, Op.RESUME, 2, 1, 0, 2, 0), BadEntry, "on a slot that is open"),
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


def closed_after(table: SlotTable, rows: int) -> None:
    """Slot 0 opened with a `rows`-row prompt, one decode row, then closed."""
    table.apply(plan(StreamEntry(0, Op.OPEN, 0, rows, 0, 0, 0)))
    table.apply(plan(StreamEntry(0, Op.CONTINUE, rows, 1, rows, 0, 0)))
    table.apply(plan(StreamEntry(0, Op.CLOSE, 0, 0, 0, 0, 0)))


def test_a_closed_slot_keeps_its_positions_for_a_resume_that_advances_the_generation():
    table = SlotTable(parallel=1, context=32)
    closed_after(table, 8)
    assert (table.slots[0].kept, table.slots[0].generation) == (9, 1)
    table.apply(plan(StreamEntry(0, Op.RESUME, 4, 3, 0, 4, 1)))
    slot = table.slots[0]
    assert (slot.open, slot.offset, slot.generation, slot.kept) == (True, 7, 2, 0)
    table.apply(plan(StreamEntry(0, Op.CONTINUE, 7, 1, 3, 0, 2)))  # and runs on from there


@pytest.mark.parametrize("entry, error, words", [
    (StreamEntry(0, Op.RESUME, 10, 1, 0, 10, 1), BadEntry, "keeps 9 positions"),
    (StreamEntry(0, Op.RESUME, 4, 1, 0, 4, 0), GenerationMismatch, "generation 0"),
    (StreamEntry(0, Op.RESUME, 5, 1, 0, 4, 1), BadEntry, "first 5"),
    (StreamEntry(0, Op.RESUME, 4, 0, 0, 4, 1), BadEntry, "runs no rows"),
])
def test_a_resume_the_slot_cannot_serve_is_refused_by_name(entry, error, words):
    table = SlotTable(parallel=1, context=32)
    closed_after(table, 8)
    before = vars(table.slots[0]).copy()
    with pytest.raises(error, match=words):
        table.apply(plan(entry))
    assert vars(table.slots[0]) == before


def test_a_cancel_or_a_fresh_open_keeps_nothing():
    table = SlotTable(parallel=1, context=32)
    closed_after(table, 8)
    table.apply(plan(StreamEntry(0, Op.OPEN, 0, 2, 0, 0, 0)))
    table.apply(plan(StreamEntry(0, Op.CANCEL, 0, 0, 0, 0, 0)))
    assert table.slots[0].kept == 0
    with pytest.raises(BadEntry, match="keeps 0 positions"):
        table.apply(plan(StreamEntry(0, Op.RESUME, 1, 1, 0, 1, 1)))


def test_a_recurrent_state_resumes_only_where_a_full_chunk_saved_it():
    table = SlotTable(parallel=1, context=64, can_roll_back=False, chunk=8)
    table.apply(plan(StreamEntry(0, Op.OPEN, 0, 8, 0, 0, 0)))
    table.apply(plan(StreamEntry(0, Op.CONTINUE, 8, 8, 8, 0, 0)))
    table.apply(plan(StreamEntry(0, Op.CONTINUE, 16, 5, 8, 0, 0)))  # 21: not on the grid
    table.apply(plan(StreamEntry(0, Op.CONTINUE, 21, 1, 5, 0, 0)))  # a decode row
    table.apply(plan(StreamEntry(0, Op.CLOSE, 0, 0, 0, 0, 0)))
    assert (table.slots[0].kept, table.slots[0].snapshot) == (22, 16)
    with pytest.raises(BadEntry, match="saved that slot's recurrent .* state at 16"):
        table.apply(plan(StreamEntry(0, Op.RESUME, 8, 2, 0, 8, 1)))
    table.apply(plan(StreamEntry(0, Op.RESUME, 16, 2, 0, 16, 1)))
    assert table.slots[0].snapshot == 16

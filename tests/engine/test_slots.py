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
    # A chunk of 16: its CONTINUE chunks are longer than a verify entry (VERIFY_ROWS).
    table = SlotTable(parallel=1, context=64, can_roll_back=False, chunk=16)
    table.apply(plan(StreamEntry(0, Op.OPEN, 0, 16, 0, 0, 0)))
    table.apply(plan(StreamEntry(0, Op.CONTINUE, 16, 16, 16, 0, 0)))
    table.apply(plan(StreamEntry(0, Op.CONTINUE, 32, 11, 16, 0, 0)))  # 43: not on the grid
    table.apply(plan(StreamEntry(0, Op.CONTINUE, 43, 1, 11, 0, 0)))  # a decode row
    table.apply(plan(StreamEntry(0, Op.CLOSE, 0, 0, 0, 0, 0)))
    assert (table.slots[0].kept, table.slots[0].snapshot) == (44, 32)
    with pytest.raises(BadEntry, match="saved that slot's recurrent .* state at 32"):
        table.apply(plan(StreamEntry(0, Op.RESUME, 16, 2, 0, 16, 1)))
    table.apply(plan(StreamEntry(0, Op.RESUME, 32, 2, 0, 32, 1)))
    assert table.slots[0].snapshot == 32


def test_a_verify_entry_saves_no_snapshot_even_on_the_chunk_grid():
    """A CONTINUE of 2 to VERIFY_ROWS rows is a verify entry, a prompt chunk of that size
    too (the plan carries no mark): the next entry may drop some of its rows, so its end is
    no resume point."""
    table = SlotTable(parallel=1, context=64, can_roll_back=False, chunk=8)
    table.apply(plan(StreamEntry(0, Op.OPEN, 0, 8, 0, 0, 0)))  # an OPEN is no verify entry
    assert table.slots[0].snapshot == 8
    verify = StreamEntry(0, Op.CONTINUE, 8, 8, 8, 0, 0)  # ends on 16, on the grid
    assert verify.verifies and not table.saves_snapshot(verify)
    table.apply(plan(verify))
    assert table.slots[0].snapshot == 8


def hybrid_after(*entries: StreamEntry) -> SlotTable:
    table = SlotTable(parallel=1, context=64, can_roll_back=False, chunk=16)
    for round_no, entry in enumerate(entries, start=1):
        table.apply(plan(entry, round_no=round_no))
    return table


def test_a_hybrid_keeps_any_prefix_of_a_verify_entry():
    for accepted in range(1, 6):
        table = hybrid_after(StreamEntry(0, Op.OPEN, 0, 10, 0, 0, 0),
                             StreamEntry(0, Op.CONTINUE, 10, 5, 10, 0, 0))  # a verify entry
        keep = StreamEntry(0, Op.CONTINUE, 10 + accepted, 1, accepted, 0, 0)
        assert table.restores_draft(keep) == (accepted < 5)
        table.apply(plan(keep, round_no=3))
        slot = table.slots[0]
        # A keep of fewer rows advances the generation, as a dense keep does.
        assert (slot.offset, slot.generation) == (11 + accepted, int(accepted < 5))


@pytest.mark.parametrize("before, keep, words", [
    # After a prompt chunk longer than a verify entry: no per-row states were kept.
    (StreamEntry(0, Op.CONTINUE, 10, 12, 10, 0, 0), StreamEntry(0, Op.CONTINUE, 15, 1, 5, 0, 0),
     "cannot be trimmed after an entry that is not a verify entry"),
    # After a decode row (one row: no verify entry), a keep of none of it.
    (StreamEntry(0, Op.CONTINUE, 10, 1, 10, 0, 0), StreamEntry(0, Op.CONTINUE, 10, 1, 0, 0, 0),
     "cannot be trimmed after an entry that is not a verify entry"),
    # After a verify entry, a keep of none of it: the state before it was overwritten.
    (StreamEntry(0, Op.CONTINUE, 10, 4, 10, 0, 0), StreamEntry(0, Op.CONTINUE, 10, 1, 0, 0, 0),
     "keeps at least its first row"),
])
def test_a_hybrid_refuses_a_keep_no_stage_can_serve_by_name(before, keep, words):
    table = hybrid_after(StreamEntry(0, Op.OPEN, 0, 10, 0, 0, 0), before)
    state = table.snapshot()
    with pytest.raises(BadEntry, match=words):
        table.apply(plan(keep, round_no=3))
    assert table.snapshot() == state


def test_a_dense_table_keeps_a_prefix_of_any_entry():
    table = SlotTable(parallel=1, context=64)
    table.apply(plan(StreamEntry(0, Op.OPEN, 0, 10, 0, 0, 0)))
    table.apply(plan(StreamEntry(0, Op.CONTINUE, 10, 12, 10, 0, 0)))  # no verify entry
    table.apply(plan(StreamEntry(0, Op.CONTINUE, 15, 1, 5, 0, 0)))
    assert not table.restores_draft(StreamEntry(0, Op.CONTINUE, 16, 1, 0, 0, 1))
    assert (table.slots[0].offset, table.slots[0].generation) == (16, 1)


@pytest.mark.parametrize("chunk", [4, 8, 16])
def test_rank_0s_record_saves_the_snapshot_where_the_stages_do(chunk):
    """engine.lanes.prompt_cache.ChunkRecord follows a prompt's entries as rank 0 feeds
    them; every stage's table follows the plans. Both must name the same resume point, for
    every way of cutting a prompt into entries (verify-sized CONTINUEs among them)."""
    import itertools

    from engine.lanes.prompt_cache import ChunkRecord

    sizes = (1, 2, chunk // 2, chunk, 8, 9, chunk + 8)
    for cut in itertools.product(sizes, repeat=3):
        table = SlotTable(parallel=1, context=256, can_roll_back=False, chunk=chunk)
        record = ChunkRecord(chunk)
        first, last_rows = 0, 0
        for at, rows in enumerate(cut):
            op = Op.OPEN if at == 0 else Op.CONTINUE
            table.apply(plan(StreamEntry(0, op, first, rows, last_rows, 0, 0), round_no=at + 1))
            record.ran(first, rows)
            first, last_rows = first + rows, rows
        assert record.snapshot == table.slots[0].snapshot, cut


def test_a_pool_of_pages_bounds_what_the_slots_hold_and_a_cancel_frees_a_kept_state():
    """FLEET_KV_PAGES: every slot's pages count against the pool (a closed slot's kept
    state too); a plan past it is refused by name with nothing moved; a CANCEL on a closed
    slot drops what it kept, pages and all, so a later plan fits."""
    table = SlotTable(parallel=3, context=256, pages=4)
    table.apply(plan(StreamEntry(0, Op.OPEN, 0, 130, 0, 0, 0)))  # 3 pages
    table.apply(plan(StreamEntry(0, Op.CLOSE, 0, 0, 0, 0, 0),
                     StreamEntry(1, Op.OPEN, 0, 64, 0, 0, 0), round_no=2))  # 1 page
    assert [s.pages for s in table.slots] == [3, 1, 0] and table.pages_held() == 4
    before = table.snapshot()
    with pytest.raises(BadEntry, match="would hold 5 KV pages, past this stage's pool of 4"):
        table.apply(plan(StreamEntry(1, Op.CONTINUE, 64, 1, 64, 0, 0), round_no=3))
    assert table.snapshot() == before
    # Rank 0 drops slot 0's kept state in the same plan that grows slot 1: it fits.
    table.apply(plan(StreamEntry(0, Op.CANCEL, 0, 0, 0, 0, 1),
                     StreamEntry(1, Op.CONTINUE, 64, 1, 64, 0, 0), round_no=3))
    assert [s.pages for s in table.slots] == [0, 2, 0]
    assert (table.slots[0].kept, table.slots[0].generation) == (0, 2)
    with pytest.raises(GenerationMismatch, match="cancel of a closed slot's kept state"):
        table.apply(plan(StreamEntry(0, Op.CANCEL, 0, 0, 0, 0, 1), round_no=4))


def test_a_resume_keeps_the_pages_its_slot_held():
    table = SlotTable(parallel=1, context=256, pages=3)
    table.apply(plan(StreamEntry(0, Op.OPEN, 0, 150, 0, 0, 0)))
    table.apply(plan(StreamEntry(0, Op.CLOSE, 0, 0, 0, 0, 0), round_no=2))
    table.apply(plan(StreamEntry(0, Op.RESUME, 64, 2, 0, 64, 1), round_no=3))
    assert table.slots[0].pages == 3  # its rows past 66 are stale, but their pages stay

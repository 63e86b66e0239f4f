"""Building a round decides from a frozen snapshot and changes nothing; every plan it builds
is one a stage's slot table accepts, with one token id per row and the chunk budget kept."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.pipeline.round_builder import Lane, RoundInputs, build_round
from engine.rounds import Op, StreamEntry
from engine.slots import Slot, SlotTable

CLOSED = Slot()


def opened(offset: int, generation: int = 0, last_rows: int = 1) -> Slot:
    return Slot(open=True, offset=offset, generation=generation, last_rows=last_rows)


def test_prompt_rows_share_the_chunk_budget_in_slot_order_and_decode_rows_ride_free():
    inputs = RoundInputs(
        round_no=7, chunk=5,
        lanes=(Lane((10, 11, 12, 13), 0, chunked=True),  # a new prompt: 4 rows
               Lane((20,), 9),  # a decode row: outside the budget
               Lane((30, 31, 32, 33, 34, 35), 0, chunked=True),  # 1 row left for it
               Lane((40, 41), 0, chunked=True)),  # nothing left: waits a round
        slots=(CLOSED, opened(9, generation=2, last_rows=1), CLOSED, CLOSED))
    built = build_round(inputs)
    assert built.plan.round_no == 7
    assert built.plan.entries == (
        StreamEntry(0, Op.OPEN, 0, 4, 0, 0, 0),
        StreamEntry(1, Op.CONTINUE, 9, 1, 1, 0, 2),
        StreamEntry(2, Op.OPEN, 0, 1, 0, 0, 0))
    assert built.token_ids == (10, 11, 12, 13, 20, 30)
    assert (built.taken, built.admitted, built.released) == (0, (), ())


def test_drafts_share_the_chunk_budget_and_a_keep_names_the_rows_that_stay():
    """A decode row always rides; its drafts take what the chunk budget leaves, so a round
    never carries more than parallel + chunk rows; `accepted` is the lane's keep."""
    inputs = RoundInputs(
        round_no=4, chunk=4,
        lanes=(Lane((10, 11, 12), 20, accepted=2),  # a decode row, 2 drafts; kept 2 of 4
               Lane((30, 31, 32, 33, 34), 0, chunked=True),  # a prompt: the 2 rows left
               Lane((40, 41, 42), 7)),  # its drafts find the budget spent
        slots=(opened(22, last_rows=4), CLOSED, opened(7)))
    built = build_round(inputs)
    assert built.plan.entries == (
        StreamEntry(0, Op.CONTINUE, 20, 3, 2, 0, 0),
        StreamEntry(1, Op.OPEN, 0, 2, 0, 0, 0),
        StreamEntry(2, Op.CONTINUE, 7, 1, 1, 0, 0))
    assert built.token_ids == (10, 11, 12, 30, 31, 40)
    assert built.plan.entries[0].verifies and not built.plan.entries[2].verifies
    assert built.plan.returned_rows() == [0, 1, 2, 4, 5]


def test_a_prompts_next_chunk_continues_where_its_slot_stands():
    inputs = RoundInputs(round_no=2, chunk=3, lanes=(Lane((5, 6, 7, 8), 3, chunked=True),),
                         slots=(opened(3, last_rows=3),))
    assert build_round(inputs).plan.entries == (StreamEntry(0, Op.CONTINUE, 3, 3, 3, 0, 0),)


def test_ended_streams_close_or_cancel_their_open_slot_and_an_unopened_lane_is_just_emptied():
    inputs = RoundInputs(
        round_no=3, chunk=8,
        lanes=(Lane((), 4, ending=Op.CLOSE), Lane((), 2, ending=Op.CANCEL),
               Lane((), 0, ending=Op.CANCEL), None),
        slots=(opened(4, generation=1), opened(2), CLOSED, CLOSED))
    built = build_round(inputs)
    assert built.plan.entries == (StreamEntry(0, Op.CLOSE, 0, 0, 0, 0, 1),
                                  StreamEntry(1, Op.CANCEL, 0, 0, 0, 0, 0))
    assert built.token_ids == () and built.released == (2,)


def test_waiters_take_the_empty_lanes_in_order_and_ride_this_round():
    gone = Lane((1, 2), 0, chunked=True, ending=Op.CANCEL)
    inputs = RoundInputs(
        round_no=1, chunk=16, lanes=(None, Lane((9,), 4), None),
        slots=(CLOSED, opened(4), CLOSED),
        waiting=(gone, Lane((1, 2), 0, chunked=True), Lane((3,), 0, chunked=True),
                 Lane((4,), 0, chunked=True)))
    built = build_round(inputs)
    # The cancelled waiter leaves without taking a lane; the last one waits on.
    assert (built.taken, built.admitted) == (3, ((1, 0), (2, 2)))
    assert [(e.stream_id, e.op) for e in built.plan.entries] == [
        (0, Op.OPEN), (1, Op.CONTINUE), (2, Op.OPEN)]
    assert built.token_ids == (1, 2, 9, 3)


def test_with_every_lane_taken_no_waiter_leaves_not_even_a_cancelled_one():
    inputs = RoundInputs(round_no=1, chunk=4, lanes=(Lane((9,), 4),), slots=(opened(4),),
                         waiting=(Lane((), 0, ending=Op.CANCEL),))
    assert (build_round(inputs).taken, build_round(inputs).admitted) == (0, ())


def test_nothing_to_run_is_no_plan_but_still_says_what_to_release():
    inputs = RoundInputs(round_no=5, chunk=4, lanes=(None, Lane((), 0, ending=Op.CLOSE)),
                         slots=(CLOSED, CLOSED))
    built = build_round(inputs)
    assert built.plan is None and built.released == (1,) and built.token_ids == ()


def test_without_a_budget_every_fed_row_rides():
    inputs = RoundInputs(round_no=1, chunk=None, lanes=(Lane(tuple(range(40)), 0, chunked=True),),
                         slots=(CLOSED,))
    assert build_round(inputs).plan.total_rows == 40


def test_lanes_and_slots_must_agree_in_number():
    with pytest.raises(ValueError, match="2 lanes but 1 slots"):
        build_round(RoundInputs(round_no=1, chunk=1, lanes=(None, None), slots=(CLOSED,)))


def test_a_lane_ends_only_by_closing_or_cancelling():
    with pytest.raises(ValueError, match="not CONTINUE"):
        Lane((), 0, ending=Op.CONTINUE)


@st.composite
def snapshots(draw):
    """Slot states as a stage could hold them, and lanes consistent with them."""
    parallel = draw(st.integers(1, 5))
    slots, lanes = [], []
    for _ in range(parallel):
        if draw(st.booleans()):
            last_rows = draw(st.integers(1, 6))
            offset = draw(st.integers(last_rows, 40))
            slots.append(opened(offset, draw(st.integers(0, 3)), last_rows))
        else:
            slots.append(CLOSED)
        kind = draw(st.sampled_from(["empty", "prompt", "decode", "close", "cancel"]))
        position = slots[-1].offset
        if kind == "empty" and not slots[-1].open:
            lanes.append(None)
        elif kind in ("close", "cancel"):
            lanes.append(Lane((), position, ending=Op.CLOSE if kind == "close" else Op.CANCEL))
        elif kind == "decode" and slots[-1].open:
            lanes.append(Lane((draw(st.integers(0, 99)),), position))
        else:
            ids = tuple(draw(st.lists(st.integers(0, 99), min_size=1, max_size=12)))
            lanes.append(Lane(ids, position, chunked=True))
    waiting = tuple(draw(st.lists(st.builds(
        lambda ids, gone: Lane(tuple(ids), 0, chunked=True,
                               ending=Op.CANCEL if gone else None),
        st.lists(st.integers(0, 99), min_size=1, max_size=6), st.booleans()), max_size=4)))
    chunk = draw(st.one_of(st.none(), st.integers(0, 16)))
    return RoundInputs(draw(st.integers(1, 10**6)), tuple(lanes), tuple(slots), chunk, waiting)


@settings(max_examples=300, deadline=None)
@given(snapshots())
def test_every_plan_built_is_one_a_stages_slot_table_accepts(inputs):
    built = build_round(inputs)
    table = SlotTable(len(inputs.slots), context=64)
    table.slots = list(inputs.slots)
    if built.plan is not None:
        table.apply(built.plan)  # raises if the builder and a stage disagree
        assert built.plan.round_no == inputs.round_no
        assert len(built.token_ids) == built.plan.total_rows
        chunked = {slot for slot, lane in enumerate(inputs.lanes) if lane and lane.chunked}
        chunked |= {slot for _index, slot in built.admitted}
        prompt_rows = sum(e.rows for e in built.plan.entries if e.stream_id in chunked)
        assert inputs.chunk is None or prompt_rows <= inputs.chunk
    # Admissions go to lanes empty at the start, each at most once, live waiters only.
    slots = [slot for _index, slot in built.admitted]
    assert len(set(slots)) == len(slots)
    assert all(inputs.lanes[slot] is None for slot in slots)
    assert all(inputs.waiting[index].ending is None for index, _slot in built.admitted)
    assert built.taken <= len(inputs.waiting)
    assert all(inputs.lanes[slot].ending and not inputs.slots[slot].open
               for slot in built.released)


def groups_in_flight(streams: int, depth: int, rounds: int = 12) -> list[int]:
    """The lane host's loop in miniature: fill up to `depth` rounds (a busy stream rides
    nothing), land the oldest, again; the rows of the rounds in flight once it settles."""
    from collections import deque

    from engine.pipeline.round_builder import decode_rows_per_round

    busy: set[int] = set()
    flying: deque[tuple[int, ...]] = deque()
    seen: list[int] = []
    for round_no in range(1, rounds + 1):
        while len(flying) < depth:
            lanes = tuple(Lane((), 5) if s in busy else Lane((7,), 5) for s in range(streams))
            built = build_round(RoundInputs(round_no, lanes, tuple(opened(5)
                                                                   for _ in range(streams)),
                                            chunk=None,
                                            decode_rows=decode_rows_per_round(streams, depth)))
            if built.plan is None:
                break
            ids = tuple(e.stream_id for e in built.plan.entries)
            busy.update(ids)
            flying.append(ids)
        seen = sorted((len(ids) for ids in flying), reverse=True)
        busy.difference_update(flying.popleft())
    return seen


@pytest.mark.parametrize("streams,depth", [(1, 1), (1, 3), (2, 1), (2, 2), (3, 2), (4, 2),
                                           (5, 2), (5, 4), (6, 3), (7, 3), (8, 8), (3, 8)])
def test_decode_groups_are_the_rounds_the_builder_keeps_in_flight(streams, depth):
    from engine.pipeline.round_builder import decode_groups

    assert list(decode_groups(streams, depth)) == groups_in_flight(streams, depth)

"""Building a round: a pure decision over a frozen snapshot of lanes, waiters and slot states.

Rank 0's lane host and the harness's round driver both decide rounds here and then apply
what comes back; nothing here changes a stream, a queue or a slot. Every live lane rides
every round: a decode row each (at most `decode_rows` of them, in slot order, when rounds
are grouped to keep several stages busy), and prompt rows up to the round's chunk budget,
shared in slot order; a decode row's drafts (a verify entry) share that budget too, so no
round carries more than `parallel + chunk` rows, what every stage's buffers and the link's
bound are sized for. A busy lane (its stream waits for a round in flight) rides nothing. A lane whose stream has ended closes (or cancels) its open slot, or, if the
slot never opened, is simply emptied. Waiters take the lanes that are empty at the start
of the round, in arrival order, and ride the same round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.rounds import Op, RoundPlan, StreamEntry
from engine.slots import Slot

ENDINGS = (Op.CLOSE, Op.CANCEL)


@dataclass(frozen=True)
class Lane:
    """One stream as the builder sees it: what it still has to run, and from where."""

    pending: tuple[int, ...]  # token ids not yet run: a prompt's rest, or the newest token
    position: int  # position of the first pending row
    chunked: bool = False  # prompt rows: they share the round's chunk budget
    ending: Op | None = None  # CLOSE (finished) or CANCEL (abandoned): no rows, release
    # Positions its closed slot's kept prompt state restores (the prompt cache): the first
    # rows RESUME there instead of opening at 0. 0: a fresh stream.
    resume: int = 0
    # Rows of its slot's last round that stay (a verify round's accepted path); None: all.
    accepted: int | None = None
    # A CANCEL that drops a closed slot's kept state (rank 0's page ledger frees its pages):
    # sent although the slot is not open.
    drops_kept: bool = False

    def __post_init__(self) -> None:
        if self.ending is not None and self.ending not in ENDINGS:
            raise ValueError(f"a lane ends with CLOSE or CANCEL, not {self.ending.name}")


# A closed slot's kept state dropped (rank 0's page ledger frees its pages): no rows.
DROP_KEPT = Lane((), 0, ending=Op.CANCEL, drops_kept=True)


@dataclass(frozen=True)
class RoundInputs:
    """Everything a round is decided from, frozen at one moment."""

    round_no: int  # the number the next round gets
    lanes: tuple[Lane | None, ...]  # one per slot; None: an empty lane
    slots: tuple[Slot, ...]  # the slot table's states, one per slot
    chunk: int | None  # prompt rows a round may carry; None: no budget
    waiting: tuple[Lane, ...] = ()  # streams waiting for a lane, in arrival order
    decode_rows: int | None = None  # one-row (decode) entries a round may carry; None: all


@dataclass(frozen=True)
class BuiltRound:
    """A round to run (or None: nothing to run) and the admissions and releases to apply."""

    plan: RoundPlan | None
    token_ids: tuple[int, ...]  # the plan's rows' token ids, in row order
    taken: int  # waiters that leave the queue: the admitted and the ended ones before them
    admitted: tuple[tuple[int, int], ...]  # (index in `waiting`, slot) for each admission
    released: tuple[int, ...]  # lanes to empty now: their streams ended before their slot opened


def decode_rows_per_round(decoding: int, depth: int) -> int | None:
    """The decode rows a round may carry when `decoding` streams decode and `depth` rounds
    may be in flight: ceil(decoding / depth), so the streams go round in `depth` groups and
    every stage has one (None: depth 1, one round takes every stream). The lane host builds
    its rounds with it and the supervisor prices a cut by it (`decode_groups`)."""
    if depth <= 1:
        return None
    return max(1, math.ceil(decoding / depth))


def decode_groups(streams: int, depth: int) -> tuple[int, ...]:
    """The rows of each round in flight once `streams` streams all decode with `depth` rounds
    allowed: groups of `decode_rows_per_round` in slot order, the last one what is left
    (5 streams at depth 4: 2, 2, 1; the fourth round finds every stream busy)."""
    if streams < 1:
        return ()
    per_round = decode_rows_per_round(streams, depth) or streams
    full, rest = divmod(streams, per_round)
    return (per_round,) * full + ((rest,) if rest else ())


def build_round(inputs: RoundInputs) -> BuiltRound:
    """Decide the next round from `inputs`; the caller applies the result."""
    if len(inputs.lanes) != len(inputs.slots):
        raise ValueError(f"{len(inputs.lanes)} lanes but {len(inputs.slots)} slots")
    lanes = list(inputs.lanes)
    taken, admitted = _admit(inputs.waiting, lanes)
    for index, slot in admitted:
        lanes[slot] = inputs.waiting[index]
    entries: list[StreamEntry] = []
    token_ids: list[int] = []
    released: list[int] = []
    budget = inputs.chunk
    decode_budget = inputs.decode_rows
    for slot, lane in enumerate(lanes):
        if lane is None:
            continue
        state = inputs.slots[slot]
        if lane.ending is not None:
            if state.open or lane.drops_kept:
                entries.append(StreamEntry(slot, lane.ending, 0, 0, 0, 0, state.generation))
            else:
                released.append(slot)  # never opened: nothing to release on any stage
            continue
        rows = len(lane.pending)
        if lane.chunked and budget is not None:
            rows = min(rows, budget)
            budget -= rows
        elif rows > 1 and budget is not None:  # a decode row and its drafts
            drafts = min(rows - 1, budget)
            budget -= drafts
            rows = 1 + drafts
        if rows == 0:
            continue  # the budget is spent (this prompt waits for the next round), or busy
        if not lane.chunked and decode_budget is not None:
            if decode_budget == 0:
                continue  # this round's decode group is full: the next round takes it
            decode_budget -= 1
        if state.open:
            accepted = state.last_rows if lane.accepted is None else lane.accepted
            entries.append(StreamEntry(slot, Op.CONTINUE, lane.position, rows, accepted,
                                       0, state.generation))
        elif lane.resume:
            if lane.resume > state.kept or lane.position != lane.resume:
                raise ValueError(f"slot {slot}: resume at {lane.resume} from position "
                                 f"{lane.position}, but the slot keeps {state.kept}")
            entries.append(StreamEntry(slot, Op.RESUME, lane.resume, rows, 0, lane.resume,
                                       state.generation))
        else:
            entries.append(StreamEntry(slot, Op.OPEN, 0, rows, 0, 0, 0))
        token_ids.extend(lane.pending[:rows])
    plan = RoundPlan(inputs.round_no, tuple(entries)) if entries else None
    return BuiltRound(plan, tuple(token_ids), taken, tuple(admitted), tuple(released))


def _admit(waiting: tuple[Lane, ...],
           lanes: list[Lane | None]) -> tuple[int, list[tuple[int, int]]]:
    """Waiters for the empty lanes, in order; an ended waiter leaves without taking one."""
    empty = [slot for slot, lane in enumerate(lanes) if lane is None]
    admitted: list[tuple[int, int]] = []
    taken = 0
    for index, waiter in enumerate(waiting):
        if len(admitted) == len(empty):
            break
        taken = index + 1
        if waiter.ending is None:
            admitted.append((index, empty[len(admitted)]))
    return taken, admitted

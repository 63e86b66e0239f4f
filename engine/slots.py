"""Per-slot bookkeeping every stage keeps: open or not, position, and state generation.

The tensors of a slot's state (KV, later recurrent state) live in the backend; this table
decides what a plan entry may do to them. Every stage applies the same plan to its own
table, so a stage whose table disagrees with rank 0's refuses the plan by name instead of
computing a wrong answer (RFC 6.1, "State consistency").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.link.errors import BadEntry, GenerationMismatch
from engine.rounds import Op, RoundPlan, StreamEntry


@dataclass(frozen=True)
class Slot:
    """One slot's state; frozen, so a snapshot of the table can be read while rounds run."""

    open: bool = False
    offset: int = 0  # positions held in state
    generation: int = 0  # advanced by every keep (rollback), release and restore
    last_rows: int = 0  # rows the previous round added, for `accepted`


class SlotTable:
    def __init__(self, parallel: int, context: int, *, can_roll_back: bool = True) -> None:
        self.parallel = parallel
        self.context = context
        # False where the state has a recurrent part (a Gated DeltaNet layer's), which is
        # overwritten every token: a keep cannot be undone by moving the offset back.
        self.can_roll_back = can_roll_back
        self.slots = [Slot() for _ in range(parallel)]

    def in_use(self) -> int:
        return sum(s.open for s in self.slots)

    def free_slot(self) -> int | None:
        return next((i for i, s in enumerate(self.slots) if not s.open), None)

    def snapshot(self) -> tuple[Slot, ...]:
        """Every slot's state as it stands (frozen: nothing later changes it)."""
        return tuple(self.slots)

    def apply(self, plan: RoundPlan) -> None:
        """Check every entry against this stage's state, then advance it.

        Checking all entries before changing any keeps the table intact when a plan is
        refused, so the error names the first bad entry and nothing else moved.
        """
        for entry in plan.entries:
            self._check(entry)
        for entry in plan.entries:
            self._advance(entry)

    def _check(self, e: StreamEntry) -> None:
        if not 0 <= e.stream_id < self.parallel:
            raise BadEntry(f"stream {e.stream_id}: no such slot (this stage has {self.parallel})")
        slot = self.slots[e.stream_id]
        if e.op == Op.OPEN:
            if slot.open:
                raise BadEntry(f"stream {e.stream_id}: open on a slot that is already open")
        elif e.op == Op.RESUME:
            raise BadEntry(f"stream {e.stream_id}: resume needs a prompt cache, which v1 lacks")
        else:
            if not slot.open:
                raise BadEntry(f"stream {e.stream_id}: {e.op.name.lower()} on a closed slot")
            if e.generation != slot.generation:
                raise GenerationMismatch(
                    f"stream {e.stream_id}: plan expects generation {e.generation}, "
                    f"this stage holds {slot.generation}"
                )
            if e.accepted > slot.last_rows:
                raise BadEntry(
                    f"stream {e.stream_id}: accepted {e.accepted} > last round's {slot.last_rows}"
                )
            if e.op == Op.CONTINUE and e.accepted < slot.last_rows \
                    and not self.can_roll_back:
                raise BadEntry(
                    f"stream {e.stream_id}: rollback to {e.accepted} of {slot.last_rows} rows "
                    f"refused: this model's recurrent (Gated DeltaNet) state cannot be trimmed")
        if e.op in (Op.OPEN, Op.CONTINUE):
            kept = 0 if e.op == Op.OPEN else slot.offset - slot.last_rows + e.accepted
            if e.first != kept:
                raise BadEntry(f"stream {e.stream_id}: first {e.first}, but the slot holds {kept}")
            if e.end > self.context:
                raise BadEntry(
                    f"stream {e.stream_id}: rows up to position {e.end} exceed context {self.context}"
                )

    def _advance(self, e: StreamEntry) -> None:
        slot = self.slots[e.stream_id]
        if e.op in (Op.CLOSE, Op.CANCEL):
            self.slots[e.stream_id] = Slot(open=False, generation=slot.generation + 1)
            return
        if e.op == Op.OPEN:
            slot = Slot(open=True, generation=0)
        elif e.accepted < slot.last_rows:  # a keep: roll back to the accepted path
            slot = replace(slot, generation=slot.generation + 1)
        self.slots[e.stream_id] = replace(slot, offset=e.end, last_rows=e.rows)

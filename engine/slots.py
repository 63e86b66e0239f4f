"""Per-slot bookkeeping every stage keeps: open or not, position, state generation, and
the prompt state a closed slot keeps for the next request that shares its prefix.

The tensors of a slot's state (KV and recurrent state) live in the backend; this table
decides what a plan entry may do to them. Every stage applies the same plan to its own
table, so a stage whose table disagrees with rank 0's refuses the plan by name instead of
computing a wrong answer (RFC 6.1, "State consistency").

The prompt cache is the slot itself (RFC 6.4's "resume from a kept prompt state"): a
CLOSE leaves the slot's state in place, and a later RESUME on that slot restarts from one
of its kept positions. KV rows stay valid for every position they hold. A recurrent
(Gated DeltaNet) state holds one position only, so a hybrid keeps a snapshot taken where a
full prompt chunk ended (`snapshot`), and resumes there alone. Every stage keeps the same
record from the same plans, so a resume that any stage could not serve is refused by name
on every stage, never served from different positions.

Where every stage's KV pool is smaller than a whole context a slot (FLEET_KV_PAGES), the
table counts each slot's pages (`Slot.pages`) and refuses a plan that would hold more than
the pool, on every stage alike. Rank 0 keeps its plans inside the pool: it admits a request
by the pages it may reach and drops a kept state it no longer wants with a CANCEL on that
closed slot, so no stage ever chooses on its own which kept state to lose.

A verify entry (`StreamEntry.verifies`: a stream's newest token and its drafted tokens)
may be kept in part: the next entry's `accepted` says how many of its rows stay. KV rows
roll back by the offset alone. A hybrid's stages keep the recurrent state after each row
of a slot's last verify entry, so a hybrid keeps any prefix of a verify entry too, and
refuses a rollback only after any other entry, whose per-row states no stage kept.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.kv_pages import pages_for
from engine.link.errors import BadEntry, GenerationMismatch
from engine.rounds import Op, RoundPlan, StreamEntry


@dataclass(frozen=True)
class Slot:
    """One slot's state; frozen, so a snapshot of the table can be read while rounds run."""

    open: bool = False
    offset: int = 0  # positions held in state
    generation: int = 0  # advanced by every keep (rollback), release and restore
    last_rows: int = 0  # rows the previous round added, for `accepted`
    kept: int = 0  # closed: positions [0, kept) of KV rows a RESUME may restart from
    snapshot: int = 0  # recurrent state saved at this position (0: none), on a hybrid
    # The previous round's entry was a verify entry: a hybrid's stages kept the recurrent
    # state after each of its rows, so the next entry may keep fewer of them.
    last_verified: bool = False
    # KV pages its state holds (engine.kv_pages): the pages of the furthest position any
    # row wrote since its state was last dropped, open or kept.
    pages: int = 0


class SlotTable:
    def __init__(self, parallel: int, context: int, *, can_roll_back: bool = True,
                 chunk: int = 0, keeps_verify_rows: bool = True, pages: int = 0) -> None:
        self.parallel = parallel
        self.context = context
        # The KV pages every stage's pool holds (FLEET_KV_PAGES): a plan whose slots would
        # hold more is refused. 0: every slot's whole context (nothing to count).
        self.pages = pages
        # False where the state has a recurrent part (a Gated DeltaNet layer's), which is
        # overwritten every token: a keep cannot be undone by moving the offset back, only
        # from the per-row states a verify entry kept (`restores_draft`).
        self.can_roll_back = can_roll_back
        # Whether a hybrid's stages keep those per-row states: only where the model drafts
        # (FLEET_DRAFTER), since for a 27B they take as much again as the live state 7 times.
        self.keeps_verify_rows = keeps_verify_rows
        # The prompt chunk: a hybrid saves its recurrent state where a multi-row entry ends
        # on a multiple of it (0: never). Rank 0 reuses only such full, aligned chunks, so
        # a resumed prompt runs the very chunks a fresh one would from there on.
        self.chunk = chunk
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
        advanced = {e.stream_id: self._advanced(e) for e in plan.entries}
        if self.pages:
            self._check_pages(plan.round_no, advanced)
        for stream_id, slot in advanced.items():
            self.slots[stream_id] = slot

    def pages_held(self) -> int:
        """KV pages every slot's state holds, open or kept."""
        return sum(s.pages for s in self.slots)

    def _check_pages(self, round_no: int, advanced: dict[int, Slot]) -> None:
        needed = sum(advanced.get(i, s).pages for i, s in enumerate(self.slots))
        if needed > self.pages:
            raise BadEntry(f"round {round_no}: its slots would hold {needed} KV pages, "
                           f"past this stage's pool of {self.pages}")

    def _check(self, e: StreamEntry) -> None:
        if not 0 <= e.stream_id < self.parallel:
            raise BadEntry(f"stream {e.stream_id}: no such slot (this stage has {self.parallel})")
        slot = self.slots[e.stream_id]
        if e.op == Op.OPEN:
            if slot.open:
                raise BadEntry(f"stream {e.stream_id}: open on a slot that is already open")
        elif e.op == Op.RESUME:
            self._check_resume(e, slot)
        elif e.op == Op.CANCEL and not slot.open:  # a kept state dropped (its pages freed)
            if e.generation != slot.generation:
                raise GenerationMismatch(
                    f"stream {e.stream_id}: cancel of a closed slot's kept state expects "
                    f"generation {e.generation}, this stage holds {slot.generation}")
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
                self._check_hybrid_keep(e, slot)
        if e.op in (Op.OPEN, Op.CONTINUE, Op.RESUME):
            kept = {Op.OPEN: 0, Op.RESUME: e.resume}.get(
                e.op, slot.offset - slot.last_rows + e.accepted)
            if e.first != kept:
                raise BadEntry(f"stream {e.stream_id}: first {e.first}, but the slot holds {kept}")
            if e.end > self.context:
                raise BadEntry(
                    f"stream {e.stream_id}: rows up to position {e.end} exceed context {self.context}"
                )

    def _check_hybrid_keep(self, e: StreamEntry, slot: Slot) -> None:
        """A hybrid keeps part of a round only where its stages kept the recurrent state
        after each row (a verify entry), and at least that entry's first row: the state
        before it was overwritten by it."""
        where = f"stream {e.stream_id}: rollback to {e.accepted} of {slot.last_rows} rows"
        if not slot.last_verified:
            raise BadEntry(f"{where} refused: this model's recurrent (Gated DeltaNet) state "
                           f"cannot be trimmed after an entry that is not a verify entry")
        if not self.keeps_verify_rows:
            raise BadEntry(f"{where} refused: this stage keeps no recurrent (Gated DeltaNet) "
                           f"state per verify row (its model does not draft)")
        if e.accepted < 1:
            raise BadEntry(f"{where} refused: a verify entry keeps at least its first row "
                           f"on a model with recurrent (Gated DeltaNet) state")

    def _check_resume(self, e: StreamEntry, slot: Slot) -> None:
        where = f"stream {e.stream_id}: resume at {e.resume}"
        if slot.open:
            raise BadEntry(f"{where} on a slot that is open")
        if e.generation != slot.generation:
            raise GenerationMismatch(f"{where}: plan expects generation {e.generation}, "
                                     f"this stage holds {slot.generation}")
        if not e.rows:
            raise BadEntry(f"{where} runs no rows")
        if e.resume > slot.kept:
            raise BadEntry(f"{where}, but this stage keeps {slot.kept} positions there")
        if not self.can_roll_back and e.resume != slot.snapshot:
            saved = f"at {slot.snapshot}" if slot.snapshot else "nowhere"
            raise BadEntry(f"{where}, but this stage saved that slot's recurrent (Gated "
                           f"DeltaNet) state {saved}")

    def _advanced(self, e: StreamEntry) -> Slot:
        """The state entry `e` leaves its slot in (the table is not changed)."""
        slot = self.slots[e.stream_id]
        if e.op == Op.CLOSE:  # its state stays for a RESUME, until the slot opens again
            return Slot(open=False, generation=slot.generation + 1, kept=slot.offset,
                        snapshot=slot.snapshot, pages=slot.pages)
        if e.op == Op.CANCEL:  # abandoned, or a kept state dropped: nothing of it is kept
            return Slot(open=False, generation=slot.generation + 1)
        if e.op == Op.OPEN:
            slot = Slot(open=True, generation=0)
        elif e.op == Op.RESUME:  # a restore advances the generation (RFC 6.2)
            slot = Slot(open=True, generation=slot.generation + 1, snapshot=slot.snapshot,
                        pages=slot.pages)
        elif e.accepted < slot.last_rows:  # a keep: roll back to the accepted path
            slot = replace(slot, generation=slot.generation + 1)
        if self.saves_snapshot(e):
            slot = replace(slot, snapshot=e.end)
        return replace(slot, offset=e.end, last_rows=e.rows, last_verified=e.verifies,
                       pages=max(slot.pages, pages_for(e.end)))

    def saves_snapshot(self, e: StreamEntry) -> bool:
        """Whether a hybrid saves this entry's slot's recurrent state once its rows ran: a
        prompt chunk (more than one row, not a verify entry) that ends on a multiple of the
        chunk. A verify entry's rows may be dropped by the next entry, so its end is no
        resume point. A prompt's CONTINUE chunk of 2 to VERIFY_ROWS rows reads as a verify
        entry too (the plan carries no mark), so it saves none either; rank 0's record of
        the snapshot (engine.lanes.prompt_cache.ChunkRecord) keeps the same rule."""
        return (not self.can_roll_back and self.chunk > 0 and e.rows > 1
                and not e.verifies and e.end % self.chunk == 0)

    def restores_draft(self, e: StreamEntry) -> bool:
        """Whether a hybrid must put this entry's slot's recurrent state back to where row
        `e.accepted` of its last verify entry left it, before the entry runs. Read before
        `apply` (it reads the slot as the previous round left it). Keeping every row needs
        nothing: the live state is already the last row's."""
        slot = self.slots[e.stream_id]
        return (not self.can_roll_back and e.op == Op.CONTINUE and slot.last_verified
                and e.accepted < slot.last_rows)


"""Which pages of a stage's KV pool each slot holds: the host's side of a paged cache.

A stage's KV is a pool of pages of `PAGE_POSITIONS` positions each, and every slot owns a
list of them: its positions [j x page, (j + 1) x page) lie in its j-th page. A slot takes
pages as its rows arrive (`cover`) and gives them all back when its state is dropped
(`release`: an OPEN over what a closed slot kept, a CANCEL). A slot's pages need not be
next to each other, so what the pool holds is the positions its conversations hold, not
a whole context per slot.

No other stage needs to know where this stage's rows sit: every stage applies the same
plans to the same slot table, so every stage covers and releases the same slots at the
same positions, each in a pool of its own. The backend keeps a device copy of the table
(a row per slot, a column per page) that its kernels read; this class says what changed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.rounds import RowLayout

# Positions a page holds: the cache's alignment (kv_cache.ALIGN_POSITIONS), so a slot's
# allocated positions are whole pages, and the decode kernel's block of keys (64) lies in
# one page wherever a block starts on a multiple of it.
PAGE_POSITIONS = 64


class PagesExhausted(RuntimeError):
    """A slot needed a page and the pool had none free."""


def pages_for(positions: int) -> int:
    """Pages that hold positions [0, positions)."""
    return -(-positions // PAGE_POSITIONS)


def consecutive(pages: list[int]) -> bool:
    """Whether `pages` (at least one) follow each other: one run of the pool."""
    return pages == list(range(pages[0], pages[0] + len(pages)))


class PageAllocator:
    """Which pages each slot holds, and which are free.

    A slot's next page is the one after its last where that is free, so a slot's pages are
    consecutive wherever the pool lets them be: MLX then reads a slot as one slice instead
    of gathering its pages (engine/backends/mlx/kv_cache.py), and any backend reads runs in
    order. A slot that starts, or whose next page is taken, begins a new run in the middle
    of the longest run of free pages (at its start where nothing precedes it), leaving the
    slot before that run room to grow into it."""

    def __init__(self, slots: int, pages_a_slot: int, pages: int = 0) -> None:
        self.pages_a_slot = pages_a_slot  # a slot's whole context
        # The pool (FLEET_KV_PAGES); 0, or more than every slot's whole context, which no
        # table can ever hold: that many.
        whole = slots * pages_a_slot
        self.pages = min(pages, whole) if pages else whole
        self.held: list[list[int]] = [[] for _ in range(slots)]
        self.free = set(range(self.pages))
        # `run_start`'s answers, each kept until its slot's pages change.
        self._run_starts: dict[int, int | None] = {}

    @property
    def pages_in_use(self) -> int:
        return self.pages - len(self.free)

    def cover(self, slot: int, positions: int) -> list[tuple[int, int]]:
        """Give `slot` pages for its positions [0, positions); returns each page it took as
        (its column in the slot's row of the table, the page)."""
        held = self.held[slot]
        wanted = pages_for(positions)
        if wanted > self.pages_a_slot:
            raise ValueError(f"slot {slot}: positions [0, {positions}) need {wanted} pages, "
                             f"past the {self.pages_a_slot} of a whole context")
        taken = []
        while len(held) < wanted:
            if not self.free:
                raise PagesExhausted(f"slot {slot}: no KV page free for positions up to "
                                     f"{positions} (all {self.pages} in use)")
            page = held[-1] + 1 if held and held[-1] + 1 in self.free else self._run_start()
            self.free.remove(page)
            taken.append((len(held), page))
            held.append(page)
        if taken:
            self._run_starts.pop(slot, None)
        return taken

    def run_start(self, slot: int) -> int | None:
        """The first of `slot`'s pages where they are all one run of the pool (each the one
        after the last), else None, as for a slot that holds none."""
        if slot not in self._run_starts:
            held = self.held[slot]
            self._run_starts[slot] = held[0] if held and consecutive(held) else None
        return self._run_starts[slot]

    def _run_start(self) -> int:
        """Where a new run of a slot's pages begins: the middle of the longest run of free
        pages (the lowest such run), or its start where it begins the pool."""
        free = sorted(self.free)
        best_start, best_length, start = free[0], 0, free[0]
        for before, page in zip(free, free[1:] + [-1], strict=True):
            if page != before + 1:  # the run [start, before] ends here
                if before + 1 - start > best_length:
                    best_start, best_length = start, before + 1 - start
                start = page
        return best_start if best_start == 0 else best_start + best_length // 2

    def cover_round(self, layout: RowLayout) -> list[tuple[int, int, int]]:
        """Pages for every position a round's rows write, taken before any layer runs;
        returns each page taken as (slot, its column in the slot's row, page)."""
        ends: dict[int, int] = {}
        for slot, position in zip(layout.single_slots, layout.single_positions, strict=True):
            ends[slot] = max(ends.get(slot, 0), position + 1)
        for span in layout.spans:
            ends[span.slot] = max(ends.get(span.slot, 0), span.end)
        return [(slot, column, page) for slot, end in ends.items()
                for column, page in self.cover(slot, end)]

    def release(self, slot: int) -> None:
        """Every page `slot` holds goes back to the pool; its table row is left as it was
        (a row past a slot's length reads stale, finite values that no attention weighs)."""
        self.free.update(self.held[slot])
        self.held[slot] = []
        self._run_starts.pop(slot, None)

"""Rank 0's admission by KV pages: a request holds the pages its prompt and reply may
reach, not a whole context window, and kept conversations fill the rest of the pool.

Every stage's KV pool holds the same number of pages (FLEET_KV_PAGES) and every stage's
slot table counts each slot's pages the same way (`engine.slots`), so rank 0 knows what
each stage holds without asking. It admits a request when the pages every open stream may
still reach (its reservation: `pages_for(prompt + max_tokens)`, or what the slot it resumes
already holds, if more) plus the new one's fit the pool once enough kept states are
dropped. It chooses which: first kept states no later request can reuse, then the least
recently closed. The drops go to every stage as a CANCEL on each closed slot, in the round
that opens the new stream or before it, so no plan ever holds more than the pool and no
stage chooses on its own which kept state to lose (a RESUME rank 0 already chose would
then be refused).

An open stream never waits for a page: its reservation is held from admission to close,
and its rows never pass it (a verify round's drafts stay within `max_tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv_pages import PAGE_POSITIONS, pages_for


class PageLedger:
    def __init__(self, pool: int, context: int) -> None:
        self.pool = pool  # pages every stage's pool holds
        self.context = context

    def reservation(self, prompt_tokens: int, max_tokens: int, held: int = 0) -> int:
        """Pages a stream may reach: its prompt and reply, or what its slot already holds
        (a resumed slot keeps the pages of its earlier conversation)."""
        return max(pages_for(min(self.context, prompt_tokens + max_tokens)), held)

    def never_fits(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request can never be admitted, with every kept state dropped; None: it can."""
        wanted = self.reservation(prompt_tokens, max_tokens)
        if wanted <= self.pool:
            return None
        return (f"the prompt's {prompt_tokens} tokens and 'max_tokens' {max_tokens} need "
                f"{wanted} KV pages of {PAGE_POSITIONS} positions; this model's pool holds "
                f"{self.pool} ({self.pool * PAGE_POSITIONS} positions)")

    def drops(self, wanted: int, in_use: int, droppable: Sequence[tuple[int, int]],
              ) -> list[int] | None:
        """The kept slots to drop so that `wanted` more pages fit beside `in_use` (open
        streams' reservations and every kept state's pages), from `droppable` (slot, its
        pages) in the order they go; None: they would not fit with all of them dropped."""
        short = in_use + wanted - self.pool
        dropped = []
        for slot, pages in droppable:
            if short <= 0:
                break
            dropped.append(slot)
            short -= pages
        return dropped if short <= 0 else None

"""Drafting with a head of the checkpoint's on rank 0 (Qwen3.5's MTP head, engine.draft_head).

Where prompt lookup (engine.lanes.drafting) guesses from a stream's own tokens, the MTP
head guesses from the model's own last hidden row: the row that scored the stream's newest
token, beside that token. Run k times, each time on its own output and its own guess, it
proposes k tokens; the verify round then keeps those the model agrees with, as for any
drafter, so a reply is the one it would be without a drafter (docs/drafting.md).

The head keeps one cache entry per position of the stream, as vLLM and SGLang run it: the
entry of position t pairs t's row with token t + 1. Where rank 0 drafts with the head,
every row of a round comes back to it (RoundPlan.returned_rows), so after every round the
host gives the stream's drafter the rows it ran (`landed`), normed, still on the head's
device: a prompt chunk's rows with the prompt's next tokens (the prompt's last row waits
for the first token drawn), a decode or verify entry's kept rows with the tokens handed
out. The stream's next `ask`, which the lane host hands the head with the round's other
streams' asks, feeds them to the head, and drafts after the last one where the stream
decodes; a stream still reading its prompt only feeds. The head's draft entries are cut
back at the next call, whatever the ring kept of the drafts: the kept tokens' own rows
come back from the ring and are fed then. A stream whose round hands out no draft (its
length paused, or no room left) still feeds its rows, so the head's cache stays whole.

A stream that resumes a closed slot's prompt state (the prompt cache) keeps that slot's
head entries too, as far as they rest on its own tokens (`resumed`,
engine.lanes.prompt_cache.head_entries_kept); where the entry just before the resume
point paired its row with another token, the stream's cache skips that position (it has
no row of it to feed again). Entries carry their own rotary positions, so the head
attends over what it has.

How many to draft adapts to what is accepted, as for prompt lookup (`DraftLength`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.draft_head import DraftAsk
from engine.lanes.drafting import DraftLength


class ModelDrafting:
    """One stream's drafting with rank 0's draft head: what it has fed the head, and how
    many drafts it may carry. The lane host gathers every stream's `ask` of a round and
    hands them to the head at once (their draft steps run batched)."""

    def __init__(self, most: int) -> None:
        self.length = DraftLength(most)
        self.drafted = 0  # tokens proposed in verify rounds, all told
        self.accepted = 0  # of them, the ones kept
        self.fed = 0  # entries of the stream's own rows in the head's cache for its slot
        # Of them, the first ones that hold positions 0, 1, ... in order (all, unless a
        # resume skipped a position): what a later stream resuming this slot may keep.
        self.in_step = 0
        # (slot, rows, returned-row indices, tokens, position of the first) not yet fed
        self.pending: tuple[int, Any, tuple[int, ...], tuple[int, ...], int] | None = None

    def resumed(self, entries: int) -> None:
        """The stream resumes a closed slot whose head cache holds `entries` entries of
        this stream's positions 0, 1, ...: it keeps them."""
        self.fed = self.in_step = entries

    def landed(self, slot: int, hidden: Any, rows: Sequence[int], tokens: Sequence[int],
               position: int) -> None:
        """A round ran `hidden[rows]`, the first at `position`, each followed by its token
        in `tokens` (a prompt's next token, or the token the row scored)."""
        if self.pending is not None:  # a round whose rows were never fed: never expected
            raise RuntimeError("a stream's drafter was handed two rounds' rows at once")
        self.pending = (slot, hidden, tuple(rows), tuple(tokens), position)

    def ask(self, room: int | None) -> DraftAsk | None:
        """The head's work for this stream's next round: feed the rows of the last round,
        then draft at most `room` tokens (and no more than its draft length allows; None:
        the stream is not to draft now, its prompt still running); None when no round has
        landed since the last ask."""
        allowed = 0 if room is None else min(self.length.allowed(), room)
        if self.pending is None:
            return None
        (slot, hidden, rows, tokens, position), self.pending = self.pending, None
        ask = DraftAsk(slot, self.fed, hidden, rows, tokens, position, max(allowed, 0))
        if self.in_step == self.fed == position:
            self.in_step += len(tokens)
        self.fed += len(tokens)
        return ask

    def took(self, token_id: int) -> None:
        """The head learns of the token with its row (`landed`), not alone."""

    def verified(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.length.verified(drafted, accepted)

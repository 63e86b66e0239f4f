"""Drafting with a head of the checkpoint's on rank 0 (Qwen3.5's MTP head, engine.draft_head).

Where prompt lookup (engine.lanes.drafting) guesses from a stream's own tokens, the MTP
head guesses from the model's own last hidden row: the row that scored the stream's newest
token, beside that token. Run k times, each time on its own output and its own guess, it
proposes k tokens; the verify round then keeps those the model agrees with, as for any
drafter, so a reply is the one it would be without a drafter (docs/drafting.md).

After every round that hands a stream tokens, the host gives its drafter the rows that
scored them (`landed`): the rows of the tokens handed out, normed, still on the head's
device. The stream's next `ask`, which the lane host hands the head with the round's
other streams' asks, feeds them to the head, which keeps one cache entry per row of the
stream's own, and drafts after the last one. The head's draft entries are cut back
at the next call, whatever the ring kept of the drafts: the kept tokens' own rows come
back from the ring and are fed then. A stream whose round hands out no draft (its
length paused, or no room left) still feeds its rows, so the head's cache stays whole.

The rows are those that came back to rank 0: the kept rows of a verify entry, the one row
of a decode entry, the last row of a prompt. The head never sees the other prompt rows,
which stay on the last stage; what it attends over begins at the prompt's last token.

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
        # (slot, rows, returned-row indices, tokens, position of the first) not yet fed
        self.pending: tuple[int, Any, tuple[int, ...], tuple[int, ...], int] | None = None

    def landed(self, slot: int, hidden: Any, rows: Sequence[int], tokens: Sequence[int],
               position: int) -> None:
        """A round handed out `tokens`, scored by `hidden[rows]`, the first at `position`."""
        if self.pending is not None:  # a round whose tokens were never fed: never expected
            raise RuntimeError("a stream's drafter was handed two rounds' rows at once")
        self.pending = (slot, hidden, tuple(rows), tuple(tokens), position)

    def ask(self, room: int) -> DraftAsk | None:
        """The head's work for this stream's next round: feed the rows of the last round,
        then draft at most `room` tokens (and no more than its draft length allows); None
        when no round has landed since the last ask."""
        allowed = min(self.length.allowed(), room)
        if self.pending is None:
            return None
        (slot, hidden, rows, tokens, position), self.pending = self.pending, None
        ask = DraftAsk(slot, self.fed, hidden, rows, tokens, position, max(allowed, 0))
        self.fed += len(tokens)
        return ask

    def took(self, token_id: int) -> None:
        """The head learns of the token with its row (`landed`), not alone."""

    def verified(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.length.verified(drafted, accepted)

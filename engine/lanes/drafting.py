"""Drafting on rank 0: the tokens a stream's next verify round proposes, and how many.

A verify round (engine.rounds.VERIFY_ROWS) runs a stream's newest token and the drafted
tokens after it as one entry; the head scores every row, and the lane host keeps the
longest prefix of drafts that equal what the stream's own sampler draws from those rows.
Each row draws with the uniform its token index gives it (engine.sampling.row_uniform), so
an accepted draft is the very token the stream would have drawn without a drafter: greedy
and seeded replies are the same tokens (up to the row-count rounding docs/exactness.md
names), and sampled ones keep their distribution. That is the standard speculative rule
for a drafter that proposes one token, not a distribution: accept with probability p(d).

The drafter here is prompt lookup: the longest n-gram (n from `max_n` down to `min_n`)
ending the stream's tokens that also occurs earlier among them; the tokens that followed
its latest earlier occurrence are the draft. It needs no weights, costs a few vectorised
comparisons over the history a round, and pays where replies repeat their context: edits,
code, summaries, quotes.

How many to draft adapts to what is accepted (`DraftLength`): all accepted, one more next
time (up to the model's `draft_tokens`, at most MAX_DRAFT_TOKENS); some rejected, one past what was accepted; none
accepted, no draft for 1, 2, 4 ... 32 rounds, so free chat, where drafts rarely land, pays
a verify row rarely.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

LONGEST_PAUSE = 32  # rounds without a draft after rejections in a row, at most


class TokenHistory:
    """A stream's tokens (its prompt, then what it generated) as one growing array."""

    def __init__(self, prompt: Sequence[int], capacity: int) -> None:
        self.tokens = np.zeros(max(capacity, len(prompt), 1), np.int64)
        self.tokens[:len(prompt)] = prompt
        self.count = len(prompt)

    def append(self, token_id: int) -> None:
        if self.count == len(self.tokens):
            self.tokens = np.concatenate([self.tokens, np.zeros_like(self.tokens)])
        self.tokens[self.count] = token_id
        self.count += 1

    def view(self) -> np.ndarray:
        return self.tokens[:self.count]


@dataclass(frozen=True)
class PromptLookup:
    """Drafts by prompt lookup: see the module's docstring."""

    max_n: int = 4
    min_n: int = 2

    def draft(self, history: np.ndarray, limit: int) -> tuple[int, ...]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest
        n-gram that ends `history`; () when none occurs or `limit` is 0."""
        count = len(history)
        if limit <= 0:
            return ()
        for n in range(min(self.max_n, count - 1), self.min_n - 1, -1):
            # starts s < count - n whose n tokens equal the last n (the tail itself excluded)
            same = history[:count - n] == history[count - n]
            for j in range(1, n):
                same &= history[j:count - n + j] == history[count - n + j]
            hits = np.flatnonzero(same)
            if len(hits):
                start = int(hits[-1]) + n
                return tuple(int(t) for t in history[start:start + limit])
        return ()


@dataclass
class DraftLength:
    """How many tokens a stream drafts next: adapted to what its verify rounds accept."""

    most: int  # the model's draft_tokens
    next: int = 0  # drafts the next verify round may carry
    pause: int = 0  # rounds left without a draft
    rejected_in_a_row: int = 0

    def __post_init__(self) -> None:
        self.next = self.most

    def allowed(self) -> int:
        """Drafts the stream may carry this round (0: a plain decode row); counts a paused
        round as spent."""
        if self.pause:
            self.pause -= 1
            return 0
        return self.next

    def verified(self, drafted: int, accepted: int) -> None:
        """A verify round with `drafted` drafts kept `accepted` of them."""
        if accepted == drafted:
            self.next = min(self.most, drafted + 1)
        else:
            self.next = max(1, accepted + 1)
        if accepted:
            self.rejected_in_a_row = 0
        else:
            self.rejected_in_a_row += 1
            self.pause = min(LONGEST_PAUSE, 2 ** (self.rejected_in_a_row - 1))


class Drafting:
    """One stream's drafter: its history, its draft length, and what it has drafted."""

    def __init__(self, lookup: PromptLookup, most: int, prompt: Sequence[int],
                 capacity: int) -> None:
        self.lookup = lookup
        self.history = TokenHistory(prompt, capacity)
        self.length = DraftLength(most)
        self.drafted = 0  # tokens proposed in verify rounds, all told
        self.accepted = 0  # of them, the ones kept

    def propose(self, room: int) -> tuple[int, ...]:
        """The drafts for the stream's next round: at most `room` (what its length limit
        and context leave after the next token)."""
        allowed = min(self.length.allowed(), room)
        return self.lookup.draft(self.history.view(), allowed) if allowed > 0 else ()

    def took(self, token_id: int) -> None:
        """The stream generated `token_id` (the history grows by it)."""
        self.history.append(token_id)

    def verified(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.length.verified(drafted, accepted)

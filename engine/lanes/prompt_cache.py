"""Rank 0's side of the prompt cache: which closed slot a new request resumes, and from where.

A closed slot keeps its state on every stage (engine.slots): the KV rows of every position
it held and, on a hybrid, its recurrent state where its last full prompt chunk ended. Rank
0 remembers the token ids behind that state and, when a request arrives, puts it in the
free slot whose kept tokens share the longest reusable prefix with the request's prompt;
the request's first round then RESUMEs there and runs only the rest.

What is reusable is chosen so that a reply after a hit has the bytes of the same request
on a fresh ring (docs/exactness.md): only positions that the earlier stream ran as full
prompt chunks aligned on the chunk size, which are the very rounds a fresh run of the new
prompt starts with, and a resume point on a chunk boundary, so the new prompt's later
chunks are the fresh run's too. Decode rows (the earlier reply) are run again: one row at
a time, their bits are not a prompt chunk's. A hybrid resumes only where its recurrent
state was saved. At least one prompt row always runs, for the logits of the first token.
Rank 0's draft head keeps entries of the slot's positions too (`head_entries_kept`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.rounds import Op, is_verify


@dataclass(frozen=True)
class KeptPrompt:
    """What a closed slot's state holds that a later request may reuse."""

    tokens: tuple[int, ...]  # the token ids of its reusable positions [0, len(tokens))
    closed_round: int  # the round that closed it: the least recent is replaced first
    # Where rank 0 drafts with a draft head: the tokens its entries for the slot rest on.
    # Entry t pairs position t's row with token t + 1, so the first len - 1 entries hold
    # positions 0, 1, ... and rest on these tokens (engine.lanes.model_drafting).
    head_tokens: tuple[int, ...] = ()


@dataclass
class ChunkRecord:
    """How far a stream's state was built of full, aligned prompt chunks, as it is fed."""

    chunk: int
    exact_until: int = 0  # positions [0, exact_until) ran as full aligned chunks
    snapshot: int = 0  # where a hybrid stage last saved the recurrent state (SlotTable's rule)
    broken: bool = False  # a chunk ran short or off the grid: nothing past it is exact
    entries: int = 0  # prompt entries run: the first is the OPEN or RESUME, the rest CONTINUEs

    def ran(self, first: int, rows: int) -> None:
        """A prompt entry of the stream ran `rows` rows from position `first`."""
        # SlotTable.saves_snapshot's rule: no snapshot where a verify entry ends, and a
        # CONTINUE chunk of 2 to VERIFY_ROWS rows reads as one on every stage (the plan
        # carries no mark). Such a prompt tail only returns more rows than it needs and, on
        # a hybrid, saves no resume point there.
        verifies = is_verify(Op.CONTINUE if self.entries else Op.OPEN, rows)
        self.entries += 1
        if rows > 1 and not verifies and (first + rows) % self.chunk == 0:
            self.snapshot = first + rows
        if not self.broken and first == self.exact_until and rows == self.chunk:
            self.exact_until += rows
        else:
            self.broken = True

    def reusable(self, recurrent: bool) -> int:
        """Positions a later request may resume from: the exact prefix, and on a hybrid only
        where the recurrent state was saved inside it."""
        if recurrent:
            return self.snapshot if self.snapshot <= self.exact_until else 0
        return self.exact_until


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if not n:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


def resume_point(kept: KeptPrompt | None, prompt: Sequence[int], chunk: int,
                 recurrent: bool) -> int:
    """Where a request with `prompt` can resume from `kept` (0: it cannot)."""
    if kept is None or not kept.tokens:
        return 0
    limit = len(prompt) - 1  # one prompt row must run: its logits give the first token
    match = shared_prefix(kept.tokens, prompt[:limit])
    if recurrent:  # one saved state, at the end of the kept tokens
        return len(kept.tokens) if match == len(kept.tokens) else 0
    return match // chunk * chunk


def choose_slot(free: Sequence[int], kept: Sequence[KeptPrompt | None], prompt: Sequence[int],
                chunk: int, recurrent: bool) -> tuple[int, int]:
    """(slot, resume point) for a new request among the `free` slots: the longest reuse;
    without one, a slot that keeps nothing, else the one kept longest ago."""
    best = max(free, key=lambda s: (resume_point(kept[s], prompt, chunk, recurrent),
                                    kept[s] is None,
                                    -(kept[s].closed_round if kept[s] else 0)))
    return best, resume_point(kept[best], prompt, chunk, recurrent)


def head_entries_kept(kept: KeptPrompt | None, prompt: Sequence[int], resume: int) -> int:
    """Entries of the draft head's cache a stream whose `prompt` resumes `kept` at `resume`
    keeps: those of positions before the resume point whose row and next token are the
    prompt's (entry t rests on tokens 0 to t + 1). The entry just before the resume point
    stays only where the old stream's next token was the prompt's too: its row is not run
    again, so a different one cannot be fed."""
    if kept is None or not resume:
        return 0
    return min(resume, max(0, shared_prefix(kept.head_tokens, prompt) - 1))

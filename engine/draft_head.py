"""A draft head on rank 0 (Qwen3.5's MTP head): what a backend's head offers the drafter.

The head is the checkpoint's own small predictor of the token after next: it reads the
hidden row (after the final norm) that scored a stream's newest token beside that token's
embedding, runs one full-attention decoder layer with a KV cache of its own, and scores
the token after with the model's head. Fed its own output and its own guess, it guesses
again, so k steps give k drafts (engine.lanes.model_drafting). Each backend has one file
(`engine/backends/<backend>/mtp_head.py`); the weights' names and shapes are the family's
description's (`draft_head_tensors`), read by `engine.family.load_draft_head`.

Its cache holds, per slot, one entry for each row it was fed, in order: the rows of the
stream's own tokens first (`kept`), then the entries its last drafts wrote. A draft call
cuts back to the kept entries before it writes anything, which is the keep of a verify
round for the head: the drafts' entries are dropped whether or not the ring accepted them,
and the accepted tokens' own rows are fed next time. Entries are stored compactly (each
with its own rotary position already applied), so a stream whose prompt rows never came
back to rank 0 (only a prompt's last row does) attends over what it has.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class DraftAsk:
    """One stream's turn at the head: cut `slot`'s cache back to its first `kept` entries;
    feed it `hidden[rows]` (the normed rows that scored `tokens`, the first of them at
    `position`) with the embeddings of `tokens`, one entry each; then propose `count`
    tokens (greedy), each after the last of `tokens`, writing an entry for every draft but
    the last. `count` 0 only feeds."""

    slot: int
    kept: int
    hidden: Any
    rows: tuple[int, ...]
    tokens: tuple[int, ...]
    position: int
    count: int


class DraftHead(Protocol):
    """A backend's draft head; the stage calls it inside its own compute context."""

    nbytes: int  # its weights (the model's embeddings and head not counted) and its KV

    def normed(self, rows: Any) -> Any:
        """The final norm of a round's returned rows [rows, hidden]: what the head reads. A
        new tensor, so the stage may reuse its output buffers for the next round."""

    def draft(self, asks: Sequence[DraftAsk]) -> list[tuple[int, ...]]:
        """Each ask's drafts, in order. Every stream's feed runs as one batch of rows (each
        row in its own slot, after that slot's kept entries), then the draft steps, step j
        of every stream still drafting as one batch, so a round of streams x k drafts
        reads the head's weights and the vocabulary's head k times, not streams x k."""

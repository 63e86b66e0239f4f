"""A draft head on rank 0 (Qwen3.5's MTP head): what a backend's head offers the drafter.

The head is the checkpoint's own small predictor of the token after next: it reads the
hidden row (after the final norm) of a position beside the embedding of the token that
follows it (a prompt's next token; the token the row scored), runs one full-attention
decoder layer with a KV cache of its own, and scores the token after with the model's
head. Fed its own output and its own guess, it guesses again, so k steps give k drafts
(engine.lanes.model_drafting). Each backend has one file
(`engine/backends/<backend>/mtp_head.py`); the weights' names and shapes are the family's
description's (`draft_head_tensors`), read by `engine.family.load_draft_head`.

Its cache holds, per slot, one entry for each row it was fed, in order: the rows of the
stream's own tokens first (`kept`: its prompt's, each beside the prompt's next token, then
its reply's), then the entries its last drafts wrote. A draft call cuts back to the kept
entries before it writes anything, which is the keep of a verify round for the head: the
drafts' entries are dropped whether or not the ring accepted them, and the accepted
tokens' own rows are fed next time. Entries are stored compactly (each with its own rotary
position already applied), so a stream whose cache skips a position (a prompt-cache
resume that could not keep it, engine.lanes.model_drafting) attends over what it has.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class DraftAsk:
    """One stream's turn at the head: cut `slot`'s cache back to its first `kept` entries;
    feed it `hidden[rows]` (normed rows, the first of them at `position`) with the
    embeddings of `tokens` (the token after each row: the prompt's next one, or the one
    the row scored), one entry each; then propose `count` tokens (greedy), each after the
    last of `tokens`, writing an entry for every draft but the last. `count` 0 only feeds
    (a prompt chunk's rows, or a stream paused from drafting)."""

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


class HeadSteps(Protocol):
    """What a backend's head gives the draft loop both backends share (`draft_in_batches`):
    its entry counts and the few array operations the loop needs, in that backend's arrays."""

    count: list[int]  # entries each slot's cache holds

    def forward(self, slots: Sequence[int], hidden: Any, token_ids: Any,
                positions: Sequence[int]) -> Any:
        """Rows [n, hidden] with their next tokens [n], each written as its slot's next
        entry: the head's output rows [n, hidden]."""

    def fed_rows(self, asks: Sequence[DraftAsk]) -> Any:
        """Every ask's `hidden[rows]`, in order, as one batch [rows, hidden]."""

    def ids(self, values: Sequence[int]) -> Any:
        """Token ids as the backend's index array."""

    def take(self, x: Any, indices: Sequence[int]) -> Any:
        """The rows of `x` at `indices`."""

    def greedy(self, out: Any) -> Any:
        """Each output row's most likely next token, by the model's head [rows]."""


def draft_in_batches(head: HeadSteps, asks: Sequence[DraftAsk]) -> list[tuple[int, ...]]:
    """`DraftHead.draft` on any backend: each slot cut back to its kept entries, every
    stream's feed as one batch, then draft step j of every stream still drafting as one
    batch, each step fed the last step's output row and its guess, one position on."""
    if not asks:
        return []
    for a in asks:  # each slot's cache back to the stream's own rows
        head.count[a.slot] = a.kept
    fed = head.forward([a.slot for a in asks for _ in a.tokens], head.fed_rows(asks),
                       head.ids([t for a in asks for t in a.tokens]),
                       [p for a in asks for p in range(a.position, a.position + len(a.tokens))])
    ends = list(itertools.accumulate(len(a.tokens) for a in asks))
    next_position = [a.position + len(a.tokens) for a in asks]
    drafts: list[list[int]] = [[] for _ in asks]
    live = [i for i, a in enumerate(asks) if a.count > 0]
    out = head.take(fed, [ends[i] - 1 for i in live])
    # Each step's guesses stay on the device until every step is queued: reading each
    # on the host as it comes would make every step wait for the last one's kernels.
    guessed: list[tuple[list[int], Any]] = []
    step = 0
    while live:
        tokens = head.greedy(out)  # [streams still drafting]
        guessed.append((live, tokens))
        step += 1
        going = [j for j, i in enumerate(live) if asks[i].count > step]
        if not going:
            break
        live = [live[j] for j in going]
        out = head.forward([asks[i].slot for i in live], head.take(out, going),
                           head.take(tokens, going), [next_position[i] + step - 1 for i in live])
    for streams, tokens in guessed:
        for i, token in zip(streams, tokens.tolist(), strict=True):
            drafts[i].append(token)
    return [tuple(d) for d in drafts]


@dataclass(frozen=True)
class SlotGroups:
    """A call's rows grouped by slot, for the head's attention: each slot's rows attend over
    that slot's entries, read once for all of them, as a batch of [slots, most rows] queries
    (a slot with fewer rows padded). A prompt chunk's rows then share their slot's keys,
    where gathering them for each row would cost rows x context."""

    slots: list[int]  # the call's slots, in the order first seen
    group: list[int]  # per row: its slot's index in `slots`
    within: list[int]  # per row: its index among its slot's rows
    most: int  # the most rows one slot has

    @classmethod
    def of(cls, slots: Sequence[int]) -> SlotGroups:
        index: dict[int, int] = {}
        taken: list[int] = []
        group, within = [], []
        for slot in slots:
            if slot not in index:
                index[slot] = len(taken)
                taken.append(0)
            group.append(index[slot])
            within.append(taken[index[slot]])
            taken[index[slot]] += 1
        return cls(list(index), group, within, max(taken))


def next_entries(count: list[int], slots: Sequence[int], capacity: int) -> list[int]:
    """Each row's entry in its slot's cache, rows of one slot in order after its last,
    advancing `count`; ValueError naming the entry for a row past a slot's `capacity`."""
    entries = []
    for slot in slots:
        entries.append(count[slot])
        count[slot] += 1
    if max(entries) >= capacity:
        raise ValueError(f"the draft head's cache holds {capacity} entries a slot; a row "
                         f"would be entry {max(entries)}")
    return entries

"""Driving rounds by hand, for benchmarks and tests that need every logit without HTTP.

A `RoundDriver` builds the same plans the lane host would for streams fed explicitly:
`round({slot: token_ids})` opens or continues each slot and returns the logits of each
slot's last row; `close(slots)` releases them.
"""

from __future__ import annotations

import numpy as np

from engine.lanes.host import RoundRunner
from engine.rounds import Op, RoundPlan, StreamEntry


class RoundDriver:
    def __init__(self, runner: RoundRunner) -> None:
        self.runner = runner
        self.slots = runner.slots
        self.round_no = 0

    @property
    def stage(self):
        """Rank 0's stage (every runner has one)."""
        return self.runner.stage

    def _plan(self, entries: list[StreamEntry]) -> RoundPlan:
        self.round_no += 1
        return RoundPlan(self.round_no, tuple(entries))

    def round(self, feeds: dict[int, list[int]]) -> dict[int, np.ndarray]:
        """feeds: slot -> token ids to run this round. Returns slot -> its last row's logits."""
        entries, ids = [], []
        for slot in sorted(feeds):
            state = self.slots.slots[slot]
            rows = len(feeds[slot])
            if state.open:
                entries.append(StreamEntry(slot, Op.CONTINUE, state.offset, rows,
                                           state.last_rows, 0, state.generation))
            else:
                entries.append(StreamEntry(slot, Op.OPEN, 0, rows, 0, 0, 0))
            ids.extend(feeds[slot])
        logits = self.runner.run_round(self._plan(entries), ids)
        return {slot: logits[i] for i, slot in enumerate(sorted(feeds))}

    def close(self, slots: list[int]) -> None:
        entries = [StreamEntry(s, Op.CLOSE, 0, 0, 0, 0, self.slots.slots[s].generation)
                   for s in sorted(slots)]
        self.runner.run_round(self._plan(entries), [])

    def greedy(self, prompts: dict[int, list[int]], steps: int) -> dict[int, list[int]]:
        """Prompt every slot in one round, then `steps` greedy decode rounds."""
        tokens: dict[int, list[int]] = {s: [] for s in prompts}
        logits = self.round(prompts)
        for _ in range(steps):
            feeds = {}
            for slot, row in logits.items():
                tokens[slot].append(int(np.argmax(row)))
                feeds[slot] = [tokens[slot][-1]]
            logits = self.round(feeds)
        return tokens

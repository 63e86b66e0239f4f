"""Driving rounds by hand, for benchmarks and tests that need every logit without HTTP.

A `RoundDriver` decides its rounds with the lane host's own builder, for streams fed
explicitly: `round({slot: token_ids})` opens or continues each slot with all of its ids
and returns the logits of each slot's last row; `greedy_round` does the same and returns
each slot's next token drawn on the head's device, as serving does (only ids reach the
host); `sampled_round` hands back the round's SampledRows (a mid-prompt chunk's, with no
draw; every row kept for a draft head); `close(slots)` releases them, keeping their
states, and `drop(slots)` drops what closed slots kept.
"""

from __future__ import annotations

import numpy as np

from engine.backends.base import Stage
from engine.pipeline.round_builder import DROP_KEPT, BuiltRound, Lane, RoundInputs, build_round
from engine.pipeline.runner import RoundRunner
from engine.rounds import Op
from engine.sampling import RowDraw, SampledRows, SamplingBatch, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


class RoundDriver:
    def __init__(self, runner: RoundRunner) -> None:
        self.runner = runner
        self.slots = runner.slots
        self.round_no = 0

    @property
    def stage(self) -> Stage:
        """Rank 0's stage (every runner has one)."""
        return self.runner.stage

    def _build(self, lanes: dict[int, Lane]) -> BuiltRound:
        inputs = RoundInputs(self.round_no + 1,
                             tuple(lanes.get(slot) for slot in range(self.slots.parallel)),
                             self.slots.snapshot(), chunk=None)
        built = build_round(inputs)
        if built.plan is not None:
            self.round_no = built.plan.round_no
        return built

    def round(self, feeds: dict[int, list[int]]) -> dict[int, np.ndarray]:
        """feeds: slot -> token ids to run this round. Returns slot -> its last row's logits."""
        states = self.slots.snapshot()
        built = self._build({slot: Lane(tuple(ids), states[slot].offset)
                             for slot, ids in feeds.items()})
        if built.plan is None:
            return {}
        logits = self.runner.run_round(built.plan, built.token_ids)
        return {stream: logits[rows[-1]]
                for stream, rows in built.plan.returned_by_stream().items()}

    def greedy_round(self, feeds: dict[int, list[int]]) -> dict[int, int]:
        """As `round`, but each slot's next token is drawn greedily on the head's device:
        slot -> token id."""
        drawn, sampled = self.sampled_round(feeds)
        return {stream: int(token) for stream, token in zip(drawn, sampled.token_ids,
                                                             strict=True)}

    def sampled_round(self, feeds: dict[int, list[int]], *, draw: bool = True,
                      every_row: bool = False,
                      keep_hidden: bool = False) -> tuple[list[int], SampledRows]:
        """As `greedy_round`, the round's SampledRows and the slots drawn, in their order:
        each slot's last row drawn greedily, or none where not `draw` (a mid-prompt chunk,
        as the lane host runs it); `every_row`: each slot's every returned row drawn, as a
        verify round judges its drafts (its slots listed once a draw); `keep_hidden`: every
        row of the round kept, normed, for a draft head (SamplingBatch.keep_hidden)."""
        states = self.slots.snapshot()
        built = self._build({slot: Lane(tuple(ids), states[slot].offset)
                             for slot, ids in feeds.items()})
        if built.plan is None:
            return [], SampledRows.empty()
        returned = built.plan.returned_by_stream().items() if draw else ()
        drawn = [(stream, row) for stream, rows in returned
                 for row in (rows if every_row else rows[-1:])]
        batch = SamplingBatch.of([RowDraw(row, GREEDY, 0.0) for _, row in drawn],
                                 keep_hidden=keep_hidden)
        return ([stream for stream, _ in drawn],
                self.runner.sample_round(built.plan, built.token_ids, batch))

    def close(self, slots: list[int]) -> None:
        self._end(slots, Lane((), 0, ending=Op.CLOSE))

    def drop(self, slots: list[int]) -> None:
        """CANCELs that drop closed slots' kept states, as rank 0's page ledger sends them."""
        self._end(slots, DROP_KEPT)

    def _end(self, slots: list[int], ending: Lane) -> None:
        """A round of `ending` (a lane without rows) for each of `slots`."""
        built = self._build(dict.fromkeys(slots, ending))
        if built.plan is not None:
            self.runner.run_round(built.plan, ())

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

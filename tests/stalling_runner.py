"""Test support: a one-process round runner whose rounds stall on demand.

The one fault some tests inject: after `free_rounds` rounds, every round waits until
`release` is set, so that streams are certainly in flight when the test acts.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from engine.pipeline.runner import LocalRunner
from engine.rounds import RoundPlan
from engine.sampling import SamplingBatch

STALL_LIMIT_S = 30.0  # a stalled round ends by itself this late, should a test not release it


class StallingRunner(LocalRunner):
    def __init__(self, stage, free_rounds: int) -> None:
        super().__init__(stage)
        self.free_rounds, self.rounds = free_rounds, 0
        self.stalled, self.release = threading.Event(), threading.Event()

    def launch(self, plan: RoundPlan, token_ids: Sequence[int],
               batch: SamplingBatch | None) -> None:
        self._maybe_stall()
        super().launch(plan, token_ids, batch)

    def _maybe_stall(self) -> None:
        self.rounds += 1
        if self.rounds > self.free_rounds:
            self.stalled.set()
            self.release.wait(STALL_LIMIT_S)

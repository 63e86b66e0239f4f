"""Round runners: what runs one round over the whole model for rank 0, and the one-process kind.

A runner takes rounds in two halves, so that several may be in flight at once (RFC 6.3,
v2/v3): `launch` starts a round (the plan to every stage, rank 0's own layers, the rows on
their way round the ring) and `land` finishes the oldest launched round (its returned rows,
the head, the draws) and hands back what the round's head made of them. Rounds land in the
order they were launched. `depth` is how many may be in flight: one per stage lets every
stage work at once; one process has nothing to overlap. `sample_round` and `run_round` are
a launch and a land together (the harness's round driver and tests).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from engine.backends.base import Stage
from engine.rounds import RoundPlan
from engine.sampling import SampledRows, SamplingBatch
from engine.slots import SlotTable

# What a round's head makes of the returned rows: the batch's draws, or the logits.
Head = Callable[[Any], Any]


def head_of(stage: Stage, plan: RoundPlan, batch: SamplingBatch | None) -> Head:
    """Sample `batch`'s draws on the head's device; None: the returned rows' logits. A round
    without rows (it only closes slots) returns nothing: no draws, no logits."""
    if not plan.total_rows:
        nothing = np.empty((0, 0), dtype=np.float32) if batch is None else SampledRows.empty()
        return lambda _rows: nothing
    scored = plan.returned_rows()
    if stage.spec.draft_head and len(scored) < plan.total_rows:
        # Every row came back, for the draft head; the head scores only the usual ones.
        def scored_of(rows: Any) -> Any:
            return stage.take_rows(rows, scored)
    else:
        def scored_of(rows: Any) -> Any:
            return rows
    if batch is None:
        return lambda rows: stage.logits(scored_of(rows))
    if batch.keep_hidden:  # rank 0's draft head reads every row after the round lands
        return lambda rows: replace(stage.sample(scored_of(rows), batch),
                                    hidden=stage.draft_rows(rows))
    return lambda rows: stage.sample(scored_of(rows), batch)


class RoundRunner(Protocol):
    """Runs rounds over the whole model, up to `depth` of them in flight at once."""

    slots: SlotTable
    stage: Stage  # rank 0's own stage
    depth: int  # rounds that may be in flight; 1: each lands before the next is launched

    def launch(self, plan: RoundPlan, token_ids: Sequence[int],
               batch: SamplingBatch | None) -> None:
        """Start a round; its head will draw `batch` (None: keep the logits)."""

    def land(self) -> Any:
        """Finish the oldest launched round: its SampledRows (its logits if batch was None)."""

    def run_round(self, plan: RoundPlan, token_ids: Sequence[int]) -> np.ndarray: ...

    def sample_round(self, plan: RoundPlan, token_ids: Sequence[int],
                     batch: SamplingBatch) -> SampledRows: ...

    def start(self, loop: asyncio.AbstractEventLoop, on_drain: Callable[[], None]) -> None:
        """Begin any background work (a pipeline's keep-alives); `on_drain`: a stage asks."""

    async def ring_failed(self) -> str:
        """Completes, with the reason, if the runner's ring dies (never for one process)."""

    def stop(self, reason: str, *, clean: bool) -> None:
        """End the runner's peers: cleanly, or failing with `reason`."""


class LaunchAndLand:
    """`run_round` and `sample_round` for a runner that has `launch` and `land`."""

    def run_round(self, plan: RoundPlan, token_ids: Sequence[int]) -> np.ndarray:
        self.launch(plan, token_ids, None)
        return self.land()

    def sample_round(self, plan: RoundPlan, token_ids: Sequence[int],
                     batch: SamplingBatch) -> SampledRows:
        self.launch(plan, token_ids, batch)
        return self.land()


class LocalRunner(LaunchAndLand):
    """Rank 0 holds every layer: embed, all layers, keep the returned rows, head.

    `depth` above 1 changes only how rounds are grouped (the lane host builds the next
    round before the last one lands), not what runs: a round's head runs at its launch,
    because the next launch reuses the stage's output buffers. Tests use it to hold a
    pipeline to one process running the same rounds.
    """

    def __init__(self, stage: Stage, *, depth: int = 1) -> None:
        if not (stage.is_first and stage.is_last):
            raise ValueError(f"a local runner needs the whole model, not {stage.layer_range}")
        if depth < 1:
            raise ValueError(f"depth must be at least 1, not {depth}")
        self.stage = stage
        self.slots = stage.slots
        self.depth = depth
        self._landed: deque[Any] = deque()

    def launch(self, plan: RoundPlan, token_ids: Sequence[int],
               batch: SamplingBatch | None) -> None:
        rows = self.stage.forward(plan, None, token_ids)
        self._landed.append(head_of(self.stage, plan, batch)(rows))

    def land(self) -> Any:
        return self._landed.popleft()

    def start(self, loop: asyncio.AbstractEventLoop, on_drain: Callable[[], None]) -> None:
        """One process has no peers to keep alive or to ask for a drain."""

    async def ring_failed(self) -> str:
        await asyncio.Event().wait()  # there is no ring to fail
        return ""

    def stop(self, reason: str, *, clean: bool) -> None:
        """Nothing beyond this process to end."""

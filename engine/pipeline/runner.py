"""Round runners: what runs one round over the whole model for rank 0, and the one-process kind.

The lane host hands a runner one plan, its token ids and its draws at a time and gets back
the sampled tokens (`sample_round`: sampled where the logits are); the harness's round
driver and tests get the returned rows' logits instead (`run_round`). `LocalRunner` holds
every layer in this process; `engine.pipeline.rank0.PipelineRunner` sends the plan round
a ring of stages.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from engine.backends.base import Stage
from engine.lanes.sampler import SampledRows, SamplingBatch
from engine.rounds import RoundPlan
from engine.slots import SlotTable


class RoundRunner(Protocol):
    """Runs one round over the whole model and returns the returned rows' logits."""

    slots: SlotTable
    stage: Stage  # rank 0's own stage

    def run_round(self, plan: RoundPlan, token_ids: Sequence[int]) -> np.ndarray: ...

    def sample_round(self, plan: RoundPlan, token_ids: Sequence[int],
                     batch: SamplingBatch) -> SampledRows:
        """The round, then the batch's draws from its returned rows, on the head's device."""

    def start(self, loop: asyncio.AbstractEventLoop, on_drain: Callable[[], None]) -> None:
        """Begin any background work (a pipeline's keep-alives); `on_drain`: a stage asks."""

    async def ring_failed(self) -> str:
        """Completes, with the reason, if the runner's ring dies (never for one process)."""

    def stop(self, reason: str, *, clean: bool) -> None:
        """End the runner's peers: cleanly, or failing with `reason`."""


class LocalRunner:
    """Rank 0 holds every layer: embed, all layers, keep the returned rows, head."""

    def __init__(self, stage: Stage) -> None:
        if not (stage.is_first and stage.is_last):
            raise ValueError(f"a local runner needs the whole model, not {stage.layer_range}")
        self.stage = stage
        self.slots = stage.slots

    def run_round(self, plan: RoundPlan, token_ids: Sequence[int]) -> np.ndarray:
        rows = self.stage.forward(plan, None, token_ids)
        return self.stage.logits(rows)

    def sample_round(self, plan: RoundPlan, token_ids: Sequence[int],
                     batch: SamplingBatch) -> SampledRows:
        rows = self.stage.forward(plan, None, token_ids)
        return self.stage.sample(rows, batch) if plan.total_rows else SampledRows.empty()

    def start(self, loop: asyncio.AbstractEventLoop, on_drain: Callable[[], None]) -> None:
        """One process has no peers to keep alive or to ask for a drain."""

    async def ring_failed(self) -> str:
        await asyncio.Event().wait()  # there is no ring to fail
        return ""

    def stop(self, reason: str, *, clean: bool) -> None:
        """Nothing beyond this process to end."""

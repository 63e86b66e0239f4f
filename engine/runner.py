"""Running one round over the whole model in this process (a world of one stage)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import numpy as np

from engine.backends.base import Stage
from engine.rounds import RoundPlan


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

    def start(self, loop: asyncio.AbstractEventLoop, on_drain: Callable[[], None]) -> None:
        """One process has no peers to keep alive or to ask for a drain."""

    async def ring_failed(self) -> str:
        await asyncio.Event().wait()  # there is no ring to fail
        return ""

    def stop(self, reason: str, *, clean: bool) -> None:
        """Nothing beyond this process to end."""

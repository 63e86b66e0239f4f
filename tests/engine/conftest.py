"""Helpers that drive a stage round by round, by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.backends.base import StageSpec, load_stage
from engine.rounds import Op, RoundPlan, StreamEntry
from tests.conftest import FAMILY_SPECS  # noqa: F401 - re-exported for the backend tests


def whole_stage(model_dir: Path, *, parallel: int = 4, context: int = 256, chunk: int = 64,
                layers: tuple[int, int] | None = None):
    import json

    n_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    spec = StageSpec(model_dir, layers or (0, n_layers), "torch-cpu", parallel, context, chunk)
    return load_stage(spec)


class Driver:
    """Feeds rounds to a whole-model stage by hand and returns the returned rows' logits."""

    def __init__(self, stage) -> None:
        self.stage = stage
        self.round_no = 0

    def round(self, feeds: dict[int, list[int]]) -> dict[int, np.ndarray]:
        """feeds: slot -> token ids to run this round. Returns slot -> logits of its last row."""
        entries, ids = [], []
        for slot in sorted(feeds):
            state = self.stage.slots.slots[slot]
            rows = len(feeds[slot])
            if state.open:
                entries.append(StreamEntry(slot, Op.CONTINUE, state.offset, rows,
                                           state.last_rows, 0, state.generation))
            else:
                entries.append(StreamEntry(slot, Op.OPEN, 0, rows, 0, 0, 0))
            ids.extend(feeds[slot])
        self.round_no += 1
        rows = self.stage.forward(RoundPlan(self.round_no, tuple(entries)), None, ids)
        logits = self.stage.logits(rows)
        return {slot: logits[i] for i, slot in enumerate(sorted(feeds))}

    def close(self, slots: list[int]) -> None:
        entries = tuple(StreamEntry(s, Op.CLOSE, 0, 0, 0, 0, self.stage.slots.slots[s].generation)
                        for s in sorted(slots))
        self.round_no += 1
        self.stage.forward(RoundPlan(self.round_no, entries), None, [])

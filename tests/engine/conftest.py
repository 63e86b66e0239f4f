"""Helpers that drive a stage round by round, by hand."""

from __future__ import annotations

from pathlib import Path

from engine.backends.base import StageSpec, load_stage
from engine.harness.driver import RoundDriver
from engine.pipeline.runner import LocalRunner
from engine.rounds import RowLayout, RowSpan


def whole_stage(model_dir: Path, *, parallel: int = 4, context: int = 256, chunk: int = 64,
                layers: tuple[int, int] | None = None, kv_pages: int = 0,
                backend: str = "torch-cpu"):
    from engine.harness.local_pipeline import model_config

    n_layers = model_config(model_dir).num_hidden_layers  # text_config's, where it is nested
    spec = StageSpec(model_dir, layers or (0, n_layers), backend, parallel, context, chunk,
                     kv_pages=kv_pages)
    return load_stage(spec)


def stage_driver(stage) -> RoundDriver:
    """Rounds by hand over a whole-model stage."""
    return RoundDriver(LocalRunner(stage))


def layout_of(singles: list[tuple[int, int]], spans: list[tuple[int, int, int]]) -> RowLayout:
    """singles: (slot, position) decode rows first; spans: (slot, first, end) prompt chunks."""
    layout = RowLayout([], [], [], [], [], [])
    for row, (slot, position) in enumerate(singles):
        layout.positions.append(position)
        layout.slots.append(slot)
        layout.single_rows.append(row)
        layout.single_slots.append(slot)
        layout.single_positions.append(position)
    for slot, first, end in spans:
        start = len(layout.positions)
        layout.positions.extend(range(first, end))
        layout.slots.extend([slot] * (end - first))
        layout.spans.append(RowSpan(start, start + end - first, slot, first, end))
    return layout


def teacher_forced_agreement(drivers, feeds: dict[int, list[int]], rounds: int,
                             tolerance: float) -> int:
    """Rounds through (reference, other) drivers, both fed the reference's greedy tokens:
    every row's logits within `tolerance`, and the same argmax wherever the reference's top
    two are further apart than it. Returns how many tokens were so compared."""
    import numpy as np

    decided = 0
    for _ in range(rounds):
        want, got = (driver.round(feeds) for driver in drivers)
        for slot, row in want.items():
            np.testing.assert_allclose(got[slot], row, rtol=0, atol=tolerance)
            second, first = np.sort(row)[-2:]
            if first - second > tolerance:
                assert got[slot].argmax() == row.argmax(), slot
                decided += 1
        feeds = {slot: [int(row.argmax())] for slot, row in want.items()}
    return decided


def poison_torch_kv_past(cache, start: int) -> None:
    """An injected fault for a paged PyTorch KV cache (`kv_cache.KVCache`): NaN in every
    slot's K and V at positions [start, context), as far as they are ever reached.

    A slot's pages are taken as its rows arrive, so the fault follows them: every time the
    cache covers a round, each page it holds past `start` is NaN from there on, and every
    column of a slot's table row at or past `start` that holds no page points at a spare
    page of NaN (the pool's last, taken out of the free pages so that no slot takes it).
    A read of those positions, even under a mask, poisons the output (0 x NaN is
    NaN); the positions below `start` that a slot holds no page for read page 0, finite,
    as a real stage's stale pages are."""
    from engine.kv_pages import PAGE_POSITIONS

    spare = max(cache.pages.free)
    cache.pages.free.remove(spare)
    for pool in (cache.k, cache.v):
        pool[:, spare] = float("nan")
    first_column = start // PAGE_POSITIONS
    cover = cache.cover

    def covering_then_poisoning(layout) -> None:
        cover(layout)
        for slot, held in enumerate(cache.pages.held):
            cache.table[slot, max(first_column, len(held)):] = spare
            for column, page in enumerate(held[first_column:], first_column):
                cut = max(0, start - column * PAGE_POSITIONS)
                for pool in (cache.k, cache.v):
                    pool[:, page, :, cut:] = float("nan")

    cache.cover = covering_then_poisoning
    cache.table[:, first_column:] = spare

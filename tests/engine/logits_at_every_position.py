"""Test support: a stage's logits checked at every position of a batch of prompts.

Prompts of unequal lengths go in together, one row per stream per round, so each round
mixes streams at different positions and every position of every prompt is compared with
the reference's logits for it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from engine.harness.driver import RoundDriver

PROMPT_LENGTHS = (5, 23, 14)  # mistral's window of 9 is crossed by two of them
ATOL = 1e-4  # float32 noise between two implementations of the same model


def prompts(seed: int) -> list[list[int]]:
    """One prompt of each of PROMPT_LENGTHS, random tokens of the test vocabulary (300)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 300, n).tolist() for n in PROMPT_LENGTHS]


def one_row_a_stream(batch: Sequence[Sequence[int]]) -> Iterator[tuple[int, dict[int, list[int]]]]:
    """(position, feeds) for each round: every stream still in its prompt gets its next token."""
    for pos in range(max(len(ids) for ids in batch)):
        yield pos, {slot: [ids[pos]] for slot, ids in enumerate(batch) if pos < len(ids)}


def check_logits_at_every_position(driver: RoundDriver, batch: Sequence[Sequence[int]],
                                   expected: Sequence[np.ndarray], *, atol: float = ATOL) -> None:
    """Feed `batch` one row a stream a round; `expected[slot]` is [positions, vocab]."""
    for pos, feeds in one_row_a_stream(batch):
        got = driver.round(feeds)
        assert set(got) == set(feeds), f"position {pos}: logits for {sorted(got)}"
        for slot, logits in got.items():
            np.testing.assert_allclose(logits, expected[slot][pos], atol=atol, rtol=0,
                                       err_msg=f"stream {slot}, position {pos}")

"""A stage's KV in pages (engine/kv_pages.py): which pages a slot takes and gives back, and
that where its pages lie never changes a conversation's bytes, on PyTorch and on MLX."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.harness.driver import RoundDriver
from engine.kv_pages import PAGE_POSITIONS, PageAllocator, PagesExhausted, pages_for
from engine.rounds import Op, RoundPlan, StreamEntry
from tests.engine.conftest import stage_driver, whole_stage


def test_a_slot_takes_the_pages_its_positions_need_lowest_first():
    pages = PageAllocator(slots=3, pages_a_slot=4, pages=12)
    assert pages.cover(1, 1) == [(0, 0)]
    assert pages.cover(1, PAGE_POSITIONS) == []  # position 63 is in the page it holds
    assert pages.cover(1, PAGE_POSITIONS + 1) == [(1, 1)]
    assert pages.cover(0, 3 * PAGE_POSITIONS) == [(0, 2), (1, 3), (2, 4)]
    assert pages.pages_in_use == 5 and pages.held == [[2, 3, 4], [0, 1], []]
    assert [pages_for(n) for n in (0, 1, 64, 65, 128)] == [0, 1, 1, 2, 2]


def test_released_pages_are_taken_again_and_a_slot_never_passes_its_context():
    pages = PageAllocator(slots=2, pages_a_slot=2, pages=3)
    pages.cover(0, 2 * PAGE_POSITIONS)
    pages.cover(1, 1)
    with pytest.raises(PagesExhausted, match="no KV page free for positions up to 65"):
        pages.cover(1, PAGE_POSITIONS + 1)
    pages.release(0)
    assert pages.pages_in_use == 1 and pages.held[0] == []
    assert pages.cover(1, PAGE_POSITIONS + 1) == [(1, 0)]
    with pytest.raises(ValueError, match=r"need 3 pages, past the 2 of a whole context"):
        pages.cover(0, 2 * PAGE_POSITIONS + 1)


PROMPT = {0: list(range(3, 150)), 1: [7, 1, 8, 2, 8] * 9}


def test_pages_scattered_by_earlier_conversations_give_a_fresh_stages_bytes(make_model):
    """The same conversations on a fresh stage (each slot's pages in order) and on a stage
    whose earlier conversations left its free pages out of order: an OPEN over a kept slot
    hands its pages back, and the new streams take them in another order. Every round's
    logits are the same bytes."""
    model_dir = make_model("qwen3", seed=11)
    fresh, churned = whole_stage(model_dir, context=512), whole_stage(model_dir, context=512)
    earlier = stage_driver(churned)
    earlier.greedy({2: list(range(5, 205)), 0: list(range(9, 79))}, 3)
    earlier.close([0, 2])  # both kept; slot 0's pages go back when it opens again
    logits = []
    for driver in (stage_driver(fresh), earlier):
        rounds = [driver.round(PROMPT)]
        for _ in range(6):
            rounds.append(driver.round({s: [int(np.argmax(row))]
                                        for s, row in rounds[-1].items()}))
        logits.append(rounds)
    table = churned.model.cache.table
    assert table[0, :3].tolist() != [0, 1, 2]  # the churned stage's pages really moved
    assert fresh.model.cache.table[0, :3].tolist() == [0, 1, 2]
    for want, got in zip(*logits, strict=True):
        assert want.keys() == got.keys()
        for slot in want:
            assert got[slot].tobytes() == want[slot].tobytes(), slot


def greedy_logits(driver: RoundDriver, rounds: int = 6) -> list[dict[int, np.ndarray]]:
    """PROMPT's two conversations, `rounds` greedy tokens after their prompts: every
    round's logits."""
    logits = [driver.round(PROMPT)]
    for _ in range(rounds):
        logits.append(driver.round({s: [int(np.argmax(row))] for s, row in logits[-1].items()}))
    return logits


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_an_mlx_pool_with_scattered_pages_gives_whole_windows_bytes(make_model, family):
    """MLX reads a slot's pages as one slice where they are consecutive and gathers them
    where they are not: both give the bytes of a stage holding a whole window a slot.
    Earlier conversations, kept and then dropped, leave the pool's free pages out of order
    for the next streams."""
    model_dir = make_model(family, seed=12)
    windows = whole_stage(model_dir, context=512, backend="mlx-cpu")
    pooled = whole_stage(model_dir, context=512, backend="mlx-cpu", kv_pages=20)
    earlier = stage_driver(pooled)
    earlier.greedy({2: list(range(5, 205)), 0: list(range(9, 79)), 3: [6] * 100}, 3)
    earlier.close([0, 2, 3])
    cache = pooled.model.cache
    pages = (cache.kv if family == "qwen3_5" else cache).pages  # a hybrid's attention layers'
    assert pages.held[0] == [0, 1] and pages.held[3] == [6, 7]
    earlier.drop([0, 3])  # slot 0's pages go back, then slot 3's: taken 6, 7, 0, 1
    assert pages.pages_in_use == 4
    want, got = greedy_logits(stage_driver(windows)), greedy_logits(earlier)
    assert pages.held[0] == [6, 7, 0]  # read by a gather, not a slice
    for want_round, got_round in zip(want, got, strict=True):
        assert want_round.keys() == got_round.keys()
        for slot in want_round:
            assert got_round[slot].tobytes() == want_round[slot].tobytes(), slot


def test_a_cancel_and_an_open_hand_back_a_slots_pages(make_model):
    stage = whole_stage(make_model("qwen3", seed=11), context=512)
    driver = stage_driver(stage)
    driver.greedy({0: list(range(3, 200)), 1: [4] * 10}, 2)
    pages = stage.model.cache.pages
    assert [len(held) for held in pages.held[:2]] == [pages_for(200), 1]
    driver.close([1])
    assert len(pages.held[1]) == 1  # a closed slot keeps its state for a later resume
    generation = stage.slots.slots[0].generation
    with torch.inference_mode():
        stage.forward(RoundPlan(driver.round_no + 1,
                                (StreamEntry(0, Op.CANCEL, 0, 0, 0, 0, generation),)), None, [])
    driver.round_no += 1
    assert pages.held[0] == [] and pages.pages_in_use == 1
    driver.round({1: [5, 6]})  # an OPEN over slot 1's kept state: its page goes back first
    assert pages.pages_in_use == 1 and len(pages.held[1]) == 1

"""A stage's KV in pages (engine/kv_pages.py): which pages a slot takes and gives back, and
that where its pages lie never changes a conversation's bytes, on PyTorch and on MLX."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.kv_pages import PAGE_POSITIONS, PageAllocator, PagesExhausted, pages_for
from engine.rounds import Op, RoundPlan, StreamEntry
from tests.engine.conftest import stage_driver, whole_stage


def test_a_slots_pages_follow_each_other_and_a_new_run_starts_mid_gap():
    pages = PageAllocator(slots=4, pages_a_slot=8, pages=16)
    assert pages.cover(0, 3 * PAGE_POSITIONS) == [(0, 0), (1, 1), (2, 2)]  # the pool's start
    assert pages.cover(0, 3 * PAGE_POSITIONS) == []  # position 191 is in the pages it holds
    assert pages.cover(1, PAGE_POSITIONS + 1) == [(0, 9), (1, 10)]  # mid [3, 15]: room for 0
    assert pages.cover(0, 4 * PAGE_POSITIONS) == [(3, 3)]  # the page after its last
    assert pages.cover(2, 1) == [(0, 6)]  # mid [4, 8], the lowest of the longest free runs
    pages.release(1)
    assert pages.cover(3, 2 * PAGE_POSITIONS) == [(0, 11), (1, 12)]  # mid [7, 15]
    assert pages.pages_in_use == 7 and pages.held == [[0, 1, 2, 3], [], [6], [11, 12]]
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


@pytest.mark.parametrize(("backend", "family", "dtype"), [
    ("torch-cpu", "qwen3", "float32"), ("torch-cpu", "qwen3_5", "bfloat16"),
    ("mlx-cpu", "qwen3", "float32"), ("mlx-cpu", "qwen3_5", "float32")])
def test_scattered_pages_give_the_bytes_of_whole_windows(make_model, backend, family, dtype):
    """In a pool of one window's 8 pages, slot 0's prompt runs into the page slot 1 took
    and goes on in pages further on: its pages are not consecutive (both backends gather
    them, where whole windows are read from one run: a view copied once on a PyTorch CPU
    stage, widened where it is half precision, one slice on MLX). Every round's logits are
    the bytes of a stage holding a whole window a slot."""
    model_dir = make_model(family, seed=12, dtype=dtype)
    rng = np.random.default_rng(5)
    first, second = rng.integers(3, 200, 320).tolist(), rng.integers(3, 200, 40).tolist()
    rounds = []
    for kv_pages in (0, 8):
        stage = whole_stage(model_dir, context=512, backend=backend, kv_pages=kv_pages)
        driver = stage_driver(stage)
        logits = [driver.round({0: first[:64], 1: second}), driver.round({0: first[64:]})]
        feeds = {s: [int(np.argmax(row))] for s, row in (logits[0] | logits[1]).items()}
        for _ in range(6):
            logits.append(driver.round(feeds))
            feeds = {s: [int(np.argmax(row))] for s, row in logits[-1].items()}
        rounds.append(logits)
    cache = stage.model.cache
    pages = (cache.kv if family == "qwen3_5" else cache).pages  # a hybrid's attention layers'
    assert pages.held[:2] == [[0, 1, 2, 3, 6, 7], [4]]  # page 4 was slot 1's: 0 went on at 6
    for want, got in zip(*rounds, strict=True):
        assert want.keys() == got.keys()
        for slot in want:
            assert got[slot].tobytes() == want[slot].tobytes(), slot


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


def test_a_slots_run_start_follows_its_pages():
    """`run_start`: the first page of a slot whose pages are one run, None once they are
    not (or it holds none), and again after the slot's pages are handed back."""
    pages = PageAllocator(slots=2, pages_a_slot=4, pages=4)
    assert pages.run_start(0) is None  # no pages yet
    pages.cover(0, PAGE_POSITIONS)
    assert pages.run_start(0) == 0
    pages.cover(1, 1)  # mid the free run [1, 3]: page 2
    pages.cover(0, 3 * PAGE_POSITIONS)  # page 1, then page 2 is taken: page 3
    assert pages.held[0] == [0, 1, 3] and pages.run_start(0) is None
    pages.release(0)
    pages.cover(0, PAGE_POSITIONS)
    assert pages.held[0] == [0] and pages.run_start(0) == 0

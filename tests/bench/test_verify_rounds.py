"""bench/verify_rounds.py's prompt-chunk table: what it times is what the lane host runs."""

from __future__ import annotations

import json
from types import SimpleNamespace

from bench.verify_rounds import ChunkMs, prompt_chunks_ms, prompt_rows
from engine.backends.base import StageSpec, load_stage
from engine.config import ModelConfig
from tests.engine.conftest import stage_driver

PROMPT, CHUNK = 40, 16


def test_a_prompt_read_with_and_without_the_head_feed(make_model):
    model_dir = make_model("qwen3_5", mtp=True, seed=31)
    config = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    stage = load_stage(StageSpec(model_dir, (0, config.num_hidden_layers), "torch-cpu",
                                 parallel=2, context=64, chunk=CHUNK, drafting=True,
                                 draft_head=True))
    driver = stage_driver(stage)

    chunks = prompt_chunks_ms(driver, PROMPT, 2, config.vocab_size, lambda: None)

    assert [(c.rows, c.position) for c in chunks] == [(16, 0), (16, 16), (8, 32)]
    assert all(min(c.plain, c.every_row, c.norm, c.feed) > 0 for c in chunks)
    # Every prompt row was fed to the head once, in order, and the slot was closed after.
    assert stage.draft_head.count[0] == PROMPT
    assert all(state.offset == 0 for state in stage.slots.snapshot())
    # A plain round keeps no rows for the head; an MTP round keeps every one, normed.
    _, plain = driver.sampled_round({0: list(range(3, 3 + CHUNK))}, draw=False)
    _, mtp = driver.sampled_round({1: list(range(3, 3 + CHUNK))}, keep_hidden=True)
    assert plain.hidden is None and len(plain.token_ids) == 0
    assert tuple(mtp.hidden.shape) == (CHUNK, config.hidden_size)


def test_the_table_sums_a_prompt_of_several_chunks():
    stage = SimpleNamespace(row_format=SimpleNamespace(nbytes=lambda rows: 1000 * rows))
    chunks = [ChunkMs(16, 0, 2.0, 3.0, 0.5, 1.0), ChunkMs(8, 16, 1.0, 2.0, 0.25, 0.5)]
    rows = prompt_rows(stage, 24, chunks)
    assert [r[:3] for r in rows] == [["24", 16, 0], ["24", 8, 16],
                                     ["24 (whole prompt)", 24, "all"]]
    # plain, norm, feed, MTP (every row back + feed) and its ratio, bytes back
    assert rows[-1][3:7] == ["3.00", "0.75", "0.25", "1.50"] and rows[-1][7] == "0.5"
    assert rows[-1][8:] == ["6.50", "2.17", "2.0 KB -> 0.02 MB"]
    assert rows[0][8:] == ["4.00", "2", "1.0 KB -> 0.02 MB"]

"""The MLX round index's short paths: a round of one entry, and decode rows that see every
key, run fewer ops (slices for the gathers and the scatter, no mask) for the same bits.

Each check runs the same rows over the same cache twice, once with the short path and
once with it switched off (the gathers, the scatter and an all-true mask), and holds the
two outputs equal byte for byte.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from engine.backends.base import StageSpec, load_stage
from engine.backends.mlx.kv_cache import RoundIndex
from engine.harness.local_pipeline import model_config
from engine.rounds import RowLayout
from tests.engine.conftest import layout_of, stage_driver

PROMPT = [5, 17, 9, 250, 3, 77, 41, 8, 120]


def the_long_way(index: RoundIndex, layout: RowLayout) -> RoundIndex:
    """The same index with every short path off."""
    mask = index.single_mask
    if layout.single_rows and mask is None:
        mask = mx.ones((len(layout.single_rows), 1, 1, layout.single_keys), dtype=mx.bool_)
    return replace(index, single_mask=mask, singles_in_order=False, one_entry=None)


@pytest.fixture(scope="module")
def prompted_stage(make_model):
    model = make_model("qwen3", dtype="bfloat16", seed=11)
    layers = model_config(model).num_hidden_layers
    stage = load_stage(StageSpec(model, (0, layers), "mlx-cpu", 2, 64, 64))
    stage_driver(stage).round({0: PROMPT, 1: PROMPT[:4]})
    return stage


@pytest.mark.parametrize("singles, spans", [
    ([(0, len(PROMPT))], []),  # one stream decoding: slices, no mask
    ([], [(1, 4, 9)]),  # one prompt chunk: a slice for the scatter
    ([(0, len(PROMPT)), (1, 4)], []),  # two streams at unequal positions: a mask, in order
], ids=["one-decode-row", "one-chunk", "two-decode-rows"])
def test_short_paths_give_the_long_ways_bytes(prompted_stage, singles, spans):
    model = prompted_stage.model
    layout = layout_of(singles, spans)
    tokens = mx.array([7 + row for row in range(len(layout.positions))], dtype=mx.int32)
    with mx.stream(mx.cpu):
        index = model.round_index(layout)
        short = model.run_layers(model.embed_tokens(tokens), index)
        mx.eval(short, model.cache.arrays())
        long = model.run_layers(model.embed_tokens(tokens), the_long_way(index, layout))
        mx.eval(long, model.cache.arrays())
    assert np.array_equal(np.array(short.view(mx.uint16)), np.array(long.view(mx.uint16)))


def test_which_rounds_take_which_short_path():
    one = RoundIndex.build(layout_of([(3, 9)], []), None)
    assert one.single_mask is None and one.singles_in_order and one.one_entry == (3, 9)
    # Unequal positions: the row at 4 must not see keys 5..9.
    two = RoundIndex.build(layout_of([(0, 9), (1, 4)], []), None)
    assert two.single_mask is not None and two.singles_in_order and two.one_entry is None
    # A window shorter than the keys hides the oldest ones even from the newest row.
    assert RoundIndex.build(layout_of([(3, 9)], []), 4).single_mask is not None
    assert RoundIndex.build(layout_of([(3, 9)], []), 16).single_mask is None
    # Decode rows beside a prompt chunk: the query rows must be gathered.
    mixed = RoundIndex.build(layout_of([(0, 9)], [(1, 4, 9)]), None)
    assert not mixed.singles_in_order and mixed.one_entry is None
    chunk = RoundIndex.build(layout_of([], [(2, 0, 5)]), None)
    assert chunk.one_entry == (2, 0)

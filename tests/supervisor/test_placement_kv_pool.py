"""Placement under a pool of KV pages (`kv_pages`): every attention layer is charged the
pool's positions instead of a whole context a slot, the recurrent states still one per
slot; a kept slot's KV is the pool's, so the budget buys slots by their recurrent states
alone (a dense model's: the most); and the explanations name the pool."""

from __future__ import annotations

import dataclasses

import pytest

from supervisor.fleet_config import ExplicitStage
from supervisor.memory import (
    MAX_BUDGET_SLOTS,
    ExecutionShape,
    kept_slot_bytes,
    layer_bytes,
    layers_that_fit,
    stage_memory,
)
from supervisor.placement import DoesNotFit, PlacementError, place
from tests.supervisor.test_placement import MB, SHAPE, mesh, node, spec
from tests.supervisor.test_placement_by_layer_type import LINEAR, hybrid

# SHAPE: 8 layers of 10 MB weights and 100 bytes of KV per position; rank 0 adds 20 MB of
# embeddings, 20 MB of head and a 1000-byte norm; a row is 1000 bytes, the vocabulary 1000.
PAGE = 64


def test_each_layer_is_charged_the_pool_not_a_window_a_slot():
    pooled = ExecutionShape(context=1000, parallel=2, chunk=100, prompt_cache_slots=3,
                            kv_pages=40)
    assert pooled.kv_positions == 40 * PAGE
    assert ExecutionShape(1000, 2, 100, 3).kv_positions == 1000 * 5
    layer = SHAPE.layers[0]
    assert layer_bytes(layer, pooled) == 10 * MB + 100 * 40 * PAGE
    memory = stage_memory(SHAPE, pooled, (2, 5), False)
    assert memory.kv_bytes == 3 * 100 * 40 * PAGE
    # More kept slots share the same pool: a dense stage's bytes do not change with them.
    assert stage_memory(SHAPE, dataclasses.replace(pooled, prompt_cache_slots=60), (2, 5),
                        False) == memory
    # The uniform shortcut agrees with the stage's own count.
    room = stage_memory(SHAPE, pooled, (0, 6), True).total_bytes
    assert layers_that_fit(SHAPE, pooled, room, True) == 6
    assert layers_that_fit(SHAPE, pooled, room - 1, True) == 5


def test_a_hybrids_recurrent_states_stay_one_a_slot_and_the_draft_head_a_window_a_slot():
    shape = hybrid(8, draft_head_weight_bytes=5 * MB, draft_head_kv_bytes_per_position=50)
    pooled = ExecutionShape(1000, 2, 100, prompt_cache_slots=3, kv_pages=40)
    memory = stage_memory(shape, pooled, (0, 8), True)
    assert memory.kv_bytes == 2 * 400 * 40 * PAGE  # two full-attention layers in 0:8
    assert memory.state_bytes == 6 * 2 * MB * 5  # six DeltaNet layers, five slots
    # The draft head's KV is not paged: a whole context for each of the five slots.
    assert memory.draft_head_bytes == 5 * MB + 50 * 1000 * 5


def test_a_pool_places_many_streams_where_whole_windows_do_not_fit():
    """16 streams of 32768 positions on one node whose memory holds two whole windows: with
    a window each they need 16; a pool of two windows' pages fits, to the byte."""
    long = spec(context=32768, parallel=16, chunk=512)
    pool = 2 * 32768 // PAGE
    # By hand: weights, embeddings, head, norm, the rows in and out, the float32 logits of
    # 16 rows, and the pool's K and V in each of the 8 layers.
    need = (8 * 10 * MB + 20 * MB + 20 * MB + 1000 + 2 * 512 * 1000 + 16 * 1000 * 4
            + 8 * 100 * pool * PAGE)
    one = [dataclasses.replace(node("n0", 1), usable_memory_bytes=need)]
    with pytest.raises(DoesNotFit, match=r"KV 52.4 MB for 32768 x 16 positions"):
        place(long, SHAPE, one)
    p = place(dataclasses.replace(long, kv_pages=pool), SHAPE, one)
    assert p.kv_pages == pool and p.stages[0].memory.total_bytes == need
    assert f"KV: a pool of {pool} pages (65536 positions) on every stage (kv_pages), shared " \
           "by the 16 stream(s) and the 0 kept slot(s); rank 0 admits requests by its pages" \
        in p.why
    short = [dataclasses.replace(one[0], usable_memory_bytes=need - 1)]
    with pytest.raises(DoesNotFit, match=rf"full_attention x8: weights 10.0 MB \+ KV 6.6 MB for a pool of "
                                         rf"{pool} pages \(65536 positions\)"):
        place(dataclasses.replace(long, kv_pages=pool), SHAPE, short)


def two_stages(model, shape, budgets, memory_mb=(500, 500), cut=2):
    nodes = [dataclasses.replace(n, prompt_cache_budget_bytes=b) for n, b in
             zip(mesh([node("n0", memory_mb[0]), node("n1", memory_mb[1])]), budgets)]
    explicit = (ExplicitStage("n0", (0, cut)), ExplicitStage("n1", (cut, shape.n_layers)))
    return place(dataclasses.replace(model, placement=explicit), shape, nodes)


def test_a_dense_models_kept_slot_costs_nothing_under_a_pool_so_a_budget_buys_the_most():
    pooled = spec(prompt_cache_slots=None, kv_pages=32)
    p = two_stages(pooled, SHAPE, (1 * MB, 1 * MB))
    assert p.prompt_cache_slots == MAX_BUDGET_SLOTS
    assert [s.prompt_cache_slot_bytes for s in p.stages] == [0, 0]
    for s in p.stages:  # the pool, whatever the slots: 100 bytes x 32 pages a layer
        assert s.memory.kv_bytes == (s.layer_range[1] - s.layer_range[0]) * 100 * 32 * PAGE
    assert any(f"prompt cache: {MAX_BUDGET_SLOTS} kept slot(s) (the most a budget buys), "
               "bought by the default budget, a share of each node's usable memory: under a "
               "pool of 32 pages (2048 positions) a kept slot's KV is the pool's" in line
               for line in p.why)
    # A budget of 0 still keeps none.
    none = two_stages(dataclasses.replace(pooled, prompt_cache_bytes=0), SHAPE, (0, 0))
    assert none.prompt_cache_slots == 0
    # Without the pool the same budgets buy one slot (n1's six layers hold 0.6 MB of it).
    assert two_stages(spec(prompt_cache_slots=None), SHAPE, (1 * MB, 1 * MB)
                      ).prompt_cache_slots == 1


def test_the_search_charges_a_dense_models_budget_nothing_under_a_pool():
    pooled = spec(prompt_cache_slots=None, kv_pages=32)
    alone = stage_memory(SHAPE, ExecutionShape(1000, 2, 100, kv_pages=32), (0, 8), True)
    one = [dataclasses.replace(node("n0", 1), usable_memory_bytes=alone.total_bytes,
                               prompt_cache_budget_bytes=100 * MB)]
    p = place(pooled, SHAPE, one)
    assert p.prompt_cache_slots == MAX_BUDGET_SLOTS
    assert p.stages[0].memory.total_bytes == alone.total_bytes
    with pytest.raises(DoesNotFit, match="the prompt cache's budget"):
        place(dataclasses.replace(pooled, kv_pages=0), SHAPE, one)


def test_a_hybrids_kept_slot_costs_its_recurrent_states_under_a_pool():
    shape = hybrid(8)  # layers 3 and 7 full attention, the other six DeltaNet
    pooled = spec(prompt_cache_slots=None, prompt_cache_bytes=20 * MB, kv_pages=32)
    # n0 holds 0:2 (two DeltaNet layers, 4 MB a slot), n1 2:8 (four, 8 MB a slot).
    p = two_stages(pooled, shape, (20 * MB, 20 * MB), memory_mb=(500, 800))
    assert [s.prompt_cache_slot_bytes for s in p.stages] == [
        2 * LINEAR.state_bytes_per_slot, 4 * LINEAR.state_bytes_per_slot]
    assert [kept_slot_bytes(shape, 1000, s.layer_range, kv_in_pool=True) for s in p.stages] \
        == [4 * MB, 8 * MB]
    assert p.prompt_cache_slots == 2  # 20 MB // 8 MB on n1
    execution = ExecutionShape(1000, 2, 100, prompt_cache_slots=2, kv_pages=32)
    for s in p.stages:
        assert s.memory == stage_memory(shape, execution, s.layer_range, s.rank == 0)
    assert any("the tightest stage is rank 1 on n1, 8.0 MB per slot (its recurrent states; "
               "its KV is in the pool)" in line for line in p.why)
    with pytest.raises(PlacementError, match=r"buys no kept slot: the tightest stage, rank 1 "
                       r"on n1 \(layers 2:8\), holds 8.0 MB per slot \(its recurrent states; "
                       r"its KV is in the pool\)"):
        two_stages(dataclasses.replace(pooled, prompt_cache_bytes=7 * MB), shape,
                   (7 * MB, 7 * MB), memory_mb=(500, 800))

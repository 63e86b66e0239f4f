"""The prompt cache's byte budget in placement: each stage's budget buys kept slots, the
tightest stage sets the count, the search charges the budget, a count set in fleet.yaml
overrides it, and a budget that buys nothing where one was asked is refused by name."""

from __future__ import annotations

import dataclasses

import pytest

from supervisor.fleet_config import DEFAULT_PROMPT_CACHE_SHARE, ExplicitStage
from supervisor.joint_placement import place_replicas
from supervisor.memory import MAX_BUDGET_SLOTS, ExecutionShape, stage_memory
from supervisor.placement import DoesNotFit, PlacementError, place
from supervisor.planning import prompt_cache_budget
from tests.supervisor.test_placement import MB, SHAPE, mesh, node, spec

# SHAPE: 8 layers of 100 bytes of KV per position; spec(): context 1000, parallel 2. One
# kept slot holds 100 x 1000 bytes per layer.
SLOT_PER_LAYER = 100 * 1000


def budgeted(**overrides):
    return spec(**({"prompt_cache_slots": None} | overrides))


def with_budget(nodes, *budgets):
    return [dataclasses.replace(n, prompt_cache_budget_bytes=b) for n, b in zip(nodes, budgets)]


def two_stages(model, budgets, memory_mb=(500, 500)):
    nodes = with_budget(mesh([node("n0", memory_mb[0]), node("n1", memory_mb[1])]), *budgets)
    explicit = (ExplicitStage("n0", (0, 2)), ExplicitStage("n1", (2, 8)))
    return place(dataclasses.replace(model, placement=explicit), SHAPE, nodes)


def test_the_tightest_stage_sets_the_slots_each_budget_buys():
    # n0 holds 2 layers (200 kB a slot), n1 six (600 kB): 1 MB buys 5 slots on n0, 1 on n1.
    p = two_stages(budgeted(prompt_cache_bytes=1 * MB), (1 * MB, 1 * MB))
    assert p.prompt_cache_slots == 1
    assert [s.prompt_cache_slot_bytes for s in p.stages] == [2 * SLOT_PER_LAYER,
                                                             6 * SLOT_PER_LAYER]
    assert [s.prompt_cache_budget_bytes for s in p.stages] == [1 * MB, 1 * MB]
    # Each stage holds the streams' slots and the kept one: what it is charged once placed.
    execution = ExecutionShape(1000, 2, 100, prompt_cache_slots=1)
    for s in p.stages:
        assert s.memory == stage_memory(SHAPE, execution, s.layer_range, s.rank == 0)
        assert s.memory.kv_bytes == (s.layer_range[1] - s.layer_range[0]) * SLOT_PER_LAYER * 3
    assert any("1 kept slot(s), bought by prompt_cache_bytes" in line and
               "tightest stage is rank 1 on n1" in line for line in p.why)
    # Budgets that differ by node (the default's share of each node's memory): n1's 3 MB
    # buys 5, n0's 1 MB 5 too.
    assert two_stages(budgeted(), (1 * MB, 3 * MB)).prompt_cache_slots == 5
    # Past MAX_BUDGET_SLOTS, a budget buys no more.
    assert two_stages(budgeted(), (10**9, 10**9), (2000, 2000)).prompt_cache_slots \
        == MAX_BUDGET_SLOTS


def test_a_count_in_fleet_yaml_overrides_the_budget():
    p = two_stages(budgeted(prompt_cache_slots=3, prompt_cache_bytes=1), (1, 1))
    assert p.prompt_cache_slots == 3
    assert [s.prompt_cache_budget_bytes for s in p.stages] == [0, 0]
    assert any("3 kept slot(s), as prompt_cache_slots sets, over prompt_cache_bytes" in line
               for line in p.why)


def test_a_budget_that_buys_no_slot_is_refused_where_it_was_asked():
    with pytest.raises(PlacementError, match=r"m: prompt_cache_bytes 0.5 MB buys no kept "
                       r"slot: the tightest stage, rank 1 on n1 \(layers 2:8\), holds 0.6 MB "
                       r"per slot \(1000 positions\)"):
        two_stages(budgeted(prompt_cache_bytes=MB // 2), (MB // 2, MB // 2))
    # The default budget buying none keeps none; so does a budget of 0.
    assert two_stages(budgeted(), (MB // 2, MB // 2)).prompt_cache_slots == 0
    assert two_stages(budgeted(prompt_cache_bytes=0), (0, 0)).prompt_cache_slots == 0


def test_the_search_charges_each_stage_its_budget():
    alone = stage_memory(SHAPE, ExecutionShape(1000, 2, 100), (0, 8), True).total_bytes
    one = [node("n0", alone / MB)]
    assert place(budgeted(), SHAPE, one).prompt_cache_slots == 0  # no budget: it fits
    with pytest.raises(DoesNotFit, match=r"the prompt cache's budget.*prompt cache budget: "
                       r"n0 0.8 MB \(the default"):
        place(budgeted(), SHAPE, with_budget(one, 8 * SLOT_PER_LAYER))
    room = with_budget([node("n0", (alone + 8 * SLOT_PER_LAYER) / MB)], 8 * SLOT_PER_LAYER)
    assert place(budgeted(), SHAPE, room).prompt_cache_slots == 1
    # A count that overrides the budget is charged as slots, not as the budget.
    assert place(budgeted(prompt_cache_slots=0), SHAPE,
                 with_budget(one, 8 * SLOT_PER_LAYER)).prompt_cache_slots == 0


def test_replicas_side_by_side_are_each_charged_their_budget():
    budget = 8 * SLOT_PER_LAYER
    alone = stage_memory(SHAPE, ExecutionShape(1000, 2, 100), (0, 8), True).total_bytes
    nodes = with_budget([node("n0", (2 * alone + budget) / MB)], budget)
    with pytest.raises(DoesNotFit):
        place_replicas(budgeted(), SHAPE, nodes, 2)
    nodes = with_budget([node("n0", 2 * (alone + budget) / MB)], budget)
    assert [p.prompt_cache_slots for p in place_replicas(budgeted(), SHAPE, nodes, 2)] == [1, 1]


def test_a_stage_budget_is_the_spec_bytes_else_a_share_of_the_node():
    usable = 64 * 10**9
    assert prompt_cache_budget(budgeted(), usable) == int(usable * DEFAULT_PROMPT_CACHE_SHARE)
    assert prompt_cache_budget(budgeted(prompt_cache_bytes=4 << 30), usable) == 4 << 30
    assert prompt_cache_budget(budgeted(prompt_cache_slots=2, prompt_cache_bytes=1), usable) == 0

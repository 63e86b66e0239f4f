"""fleetctl's rendering of a plan, and of a replica's prompt cache and KV pool: the supervisor
sends them as JSON, fleetctl draws them."""

from __future__ import annotations

import dataclasses
import json

from rich.console import Console

from supervisor.fleetctl import render_plan
from supervisor.placement import place
from tests.supervisor.test_placement import SHAPE, mesh, node, spec


def test_render_plan_shows_stages_predictions_and_why():
    nodes = mesh([node("gb10", 500, decode=1.0), node("mac", 500, decode=0.2)], rtt_ms=0.5)
    p = place(spec(rank0="gb10"), SHAPE, nodes)
    sent = json.loads(json.dumps(p.to_dict()))  # as it travels from the supervisor
    console = Console(record=True, width=200)
    console.print(render_plan(sent))
    text = console.export_text()
    assert "m: gb10 -> mac -> gb10" in text
    for fragment in ("0:1", "1:8", "torch-cpu", "ms per token at 2 stream(s)", "runner-up:"):
        assert fragment in text
    rank0 = p.stages[0].memory
    assert sent["stages"][0]["memory"]["total_bytes"] == rank0.total_bytes > 0


def test_render_plan_shows_a_hybrids_costs_by_layer_type():
    from supervisor.placement import LayerTypeMs
    from tests.supervisor.test_placement_by_layer_type import hybrid

    a = dataclasses.replace(node("a", 500, decode=1.0), layer_type_ms=(
        LayerTypeMs("full_attention", 0.25, 0.5, 7.0),))
    p = place(spec(), hybrid(8), mesh([a]))
    console = Console(record=True, width=250)
    console.print(render_plan(json.loads(json.dumps(p.to_dict()))))
    text = console.export_text()
    assert "6 linear_attention, 2 full_attention" in text
    assert "a ms per layer (decode 1 row / 2 rows / chunk): linear_attention 1 / 1.5 / 10; " \
           "full_attention 0.25 / 0.5 / 7" in text
    assert "state" in text and f"{p.stages[0].memory.state_bytes / 1e6:.1f} MB" in text


def test_render_plan_shows_what_each_stages_budget_bought():
    from supervisor.fleet_config import ExplicitStage

    nodes = [dataclasses.replace(n, prompt_cache_budget_bytes=1_000_000)
             for n in mesh([node("gb10", 500), node("mac", 500)])]
    explicit = (ExplicitStage("gb10", (0, 2)), ExplicitStage("mac", (2, 8)))
    p = place(spec(prompt_cache_slots=None, placement=explicit), SHAPE, nodes)
    console = Console(record=True, width=250)
    console.print(render_plan(json.loads(json.dumps(p.to_dict()))))
    text = console.export_text()
    # One slot bought (mac's 6 layers take 0.6 MB a slot): 0.2 MB and 0.6 MB held of 1 MB.
    assert "0.2 MB of 1.0 MB" in text and "0.6 MB of 1.0 MB" in text
    assert "prompt cache: 1 kept slot(s), bought by the default budget" in text


def test_plan_and_status_show_the_pool_of_kv_pages():
    from supervisor import lifecycle as lc
    from supervisor.fleetctl import prompt_cache_line
    from supervisor.views import kv_pool

    p = place(spec(prompt_cache_slots=None, kv_pages=32), SHAPE, mesh([node("gb10", 500)]))
    console = Console(record=True, width=250)
    console.print(render_plan(json.loads(json.dumps(p.to_dict()))))
    assert "KV: a pool of 32 pages (2048 positions) on every stage" in console.export_text()
    replica = lc.Replica("m-g1", "m", 1, lc.SERVING, 0.0, "d", prompt_cache_slots=64,
                         kv_pages=32)
    shown = json.loads(json.dumps(replica.to_dict() | {"kv_pool": kv_pool(replica)}))
    assert prompt_cache_line(shown) == (
        "prompt cache: 64 kept slot(s) in a KV pool of 32 pages (2048 positions) a stage "
        "(rank 0 has not reported its figures)")
    reported = {"slots": 64, "held": 2, "hits": 1, "misses": 2, "reused_tokens": 300,
                "stages": [], "kv_pages": {"pool": 32, "in_use": 9, "kept": 5}}
    assert prompt_cache_line(shown | {"prompt_cache": reported}).endswith(
        "2 holding a conversation; 1 hit(s), 2 miss(es), 300 token(s) reused; 9 of 32 KV "
        "pages in use, 5 by kept conversations")
    whole = dataclasses.replace(replica, kv_pages=0)
    assert kv_pool(whole) is None
    assert prompt_cache_line(whole.to_dict() | {"kv_pool": kv_pool(whole)}) == (
        "prompt cache: 64 kept slot(s) (rank 0 has not reported its figures)")

"""Placement of a hybrid model (Qwen3.5: Gated DeltaNet and full-attention layers): the byte
counts per layer type against transformers' own modules, memory charged per type, and the
search by layer ranges equal to a brute force over every boundary."""

from __future__ import annotations

import dataclasses
import random

import pytest

from supervisor.fleet_config import BACKENDS
from supervisor.memory import (
    ExecutionShape,
    LayerType,
    ModelShape,
    model_shape_from_config,
    stage_memory,
)
from supervisor.placement import DoesNotFit, LayerTypeMs, NodeSnapshot, place
from tests.supervisor.test_placement import (
    MB,
    assert_search_equals_brute_force,
    check_valid,
    mesh,
    node,
    spec,
)

LINEAR = LayerType("linear_attention", weight_bytes=6 * MB, state_bytes_per_slot=2 * MB)
FULL = LayerType("full_attention", weight_bytes=9 * MB, kv_bytes_per_position=400)


def hybrid(n_layers: int, interval: int = 4, **changes) -> ModelShape:
    """Every `interval`-th layer full attention, the rest DeltaNet (Qwen3.5's pattern)."""
    fields = dict(embedding_bytes=20 * MB, final_norm_bytes=1000, head_bytes=20 * MB,
                  hidden_size=500, row_bytes=1000, vocab_size=1000)
    layers = tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers))
    return ModelShape(layers=layers, **(fields | changes))


def typed(n: NodeSnapshot, rng: random.Random) -> NodeSnapshot:
    """`n` with its own times for full-attention layers (DeltaNet layers keep its defaults)."""
    return dataclasses.replace(n, layer_type_ms=(LayerTypeMs(
        "full_attention", rng.uniform(0.1, 4.0), rng.uniform(0.2, 6.0), rng.uniform(1.0, 60.0)),))


def random_hybrid_case(rng: random.Random):
    shape = hybrid(rng.randint(1, 9), interval=rng.choice([2, 3, 4]),
                   embedding_bytes=rng.choice([0, 5, 20]) * MB, head_bytes=rng.choice([0, 20]) * MB)
    names = [f"n{i}" for i in range(rng.randint(1, 4))]
    nodes = []
    for name in names:
        peers = {p: (rng.uniform(0.0, 2.0), rng.uniform(1e7, 1e9)) for p in names
                 if p != name and rng.random() < 0.85}
        n = node(name, memory_mb=rng.uniform(10, rng.choice([60, 120])),
                 decode=rng.uniform(0.1, 3.0), batch=rng.uniform(0.2, 5.0),
                 prefill=rng.uniform(1.0, 40.0), peers=peers)
        n = dataclasses.replace(n, head_ms=rng.choice([0.0, rng.uniform(0.0, 6.0)]),
                                head_batch_ms=rng.uniform(0.0, 9.0),  # rank 0's head
                                # host work a round, and a hop's end: none or some
                                round_ms=rng.choice([0.0, rng.uniform(0.0, 3.0)]),
                                hop_ms=rng.choice([0.0, rng.uniform(0.0, 2.0)]))
        nodes.append(typed(n, rng) if rng.random() < 0.8 else n)
    s = spec(context=rng.choice([100, 1000]), parallel=rng.choice([1, 2, 4]),
             chunk=rng.choice([16, 100, 400]), objective=rng.choice(["decode", "prompt"]),
             backends=BACKENDS, rank0=rng.choice([None, None, rng.choice(names)]))
    return s, shape, nodes


@pytest.mark.parametrize("seed", range(6))
def test_search_by_layer_ranges_equals_brute_force_on_random_hybrid_fleets(seed: int):
    rng = random.Random(1000 + seed)
    assert_search_equals_brute_force(random_hybrid_case(rng) for _ in range(50))


def test_the_cut_follows_the_layer_types():
    # Two nodes, each holding at most 5 of 8 layers; "attn" runs full attention 10x faster
    # than "delta" does, and DeltaNet layers a little slower. With layers 3 and 7 full
    # attention, the cheapest decode puts both on "attn": it takes 3:8 (or more), never 0:5.
    defaults = dict(decode=1.0, prefill=10.0)
    cap = stage_memory(hybrid(8), ExecutionShape(1000, 2, 100), (3, 8), False).total_bytes
    attn = dataclasses.replace(node("attn", cap / MB + 0.001, **defaults), layer_type_ms=(
        LayerTypeMs("full_attention", 0.1, 0.1, 1.0), LayerTypeMs("linear_attention", 1.2, 1.2, 12.0)))
    delta = dataclasses.replace(node("delta", 500, **defaults), layer_type_ms=(
        LayerTypeMs("full_attention", 1.0, 1.0, 10.0),))
    p = place(spec(rank0="delta"), hybrid(8), mesh([delta, attn]))
    assert [(st.node, st.layer_range) for st in p.stages] == [("delta", (0, 3)), ("attn", (3, 8))]
    assert dict(p.stages[1].layer_type_counts) == {"linear_attention": 3, "full_attention": 2}
    assert p.stages[1].decode_ms == pytest.approx(2 * 0.1 + 3 * 1.2)


def test_memory_is_charged_per_layer_type():
    execution = ExecutionShape(context=1000, parallel=4, chunk=100)
    shape = hybrid(8)  # full attention at 3 and 7
    only_delta = stage_memory(shape, execution, (0, 3), False)
    assert (only_delta.weights_bytes, only_delta.kv_bytes) == (3 * 6 * MB, 0)
    assert only_delta.state_bytes == 3 * 2 * MB * 4  # one state per stream, whatever the context
    both = stage_memory(shape, execution, (2, 4), False)
    assert both.kv_bytes == 400 * 1000 * 4 and both.state_bytes == 2 * MB * 4
    longer = stage_memory(shape, ExecutionShape(8000, 4, 100), (0, 3), False)
    assert longer.state_bytes == only_delta.state_bytes and longer.kv_bytes == 0
    assert both.total_bytes == both.weights_bytes + both.kv_bytes + both.state_bytes \
        + both.staging_bytes


def test_a_hybrid_shortfall_is_exact():
    execution = ExecutionShape(1000, 2, 100)
    shape = hybrid(8)
    whole = stage_memory(shape, execution, (0, 8), True).total_bytes
    nodes = [node("a", whole * 0.5 / MB), node("b", whole * 0.3 / MB)]
    with pytest.raises(DoesNotFit) as caught:
        place(spec(), shape, mesh(nodes))
    err = caught.value
    assert "recurrent state" in str(err) and "linear_attention x6" in str(err)

    def grown(extra: int):
        return mesh([dataclasses.replace(n, usable_memory_bytes=n.usable_memory_bytes + extra)
                     if n.name == err.node else n for n in nodes])

    place(spec(), shape, grown(err.shortfall_bytes))
    with pytest.raises(DoesNotFit):
        place(spec(), shape, grown(err.shortfall_bytes - 1))


def test_a_dense_shape_is_one_layer_type():
    shape = ModelShape.uniform(4, 10 * MB, 100, embedding_bytes=0, final_norm_bytes=0,
                               head_bytes=0, hidden_size=8, row_bytes=16, vocab_size=10)
    assert shape.is_uniform and [t.name for t in shape.types] == ["full_attention"]
    assert shape.type_counts((1, 3)) == {"full_attention": 2}


# --- byte counts against transformers' own Qwen3.5 modules

TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=300, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
            linear_conv_kernel_dim=4, full_attention_interval=3)


def transformers_counts(tie: bool, conditional: bool) -> tuple[dict, list[int], dict]:
    """config.json as transformers writes it, each decoder layer's parameter count, and the
    text model's other counts, from modules built on the meta device."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5TextConfig
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    text = Qwen3_5TextConfig(**TEXT, tie_word_embeddings=tie)
    with torch.device("meta"):
        if conditional:
            config = Qwen3_5Config(text_config=text.to_dict(), tie_word_embeddings=tie,
                                   vision_config=dict(depth=1, hidden_size=32, num_heads=2,
                                                      intermediate_size=32, out_hidden_size=64))
            model = m.Qwen3_5ForConditionalGeneration(config)
            lm = model.model.language_model
        else:
            config = text
            model = m.Qwen3_5ForCausalLM(config)
            lm = model.model
    layers = [sum(p.numel() for p in layer.parameters()) for layer in lm.layers]
    head = 0 if tie else model.lm_head.weight.numel()
    return (config.to_dict(), layers, dict(embedding=lm.embed_tokens.weight.numel(),
                                           norm=lm.norm.weight.numel(), head=head))


@pytest.mark.parametrize("conditional", [False, True])
@pytest.mark.parametrize("tie", [False, True])
def test_hybrid_byte_counts_match_transformers(tie: bool, conditional: bool):
    config, layers, rest = transformers_counts(tie, conditional)
    shape = model_shape_from_config(config, 2)
    assert [layer.weight_bytes for layer in shape.layers] == [2 * n for n in layers]
    assert [layer.name for layer in shape.layers] == ["linear_attention", "linear_attention",
                                                      "full_attention"] * 2
    assert shape.embedding_bytes == 2 * rest["embedding"]
    assert (shape.final_norm_bytes, shape.head_bytes) == (2 * rest["norm"], 2 * rest["head"])
    full, linear = shape.layers[2], shape.layers[0]
    assert full.kv_bytes_per_position == 2 * 2 * 16 * 2 and full.state_bytes_per_slot == 0
    # conv window (kernel - 1) x (2 key + 1 value widths) in the weights' dtype, and the
    # delta-rule state value heads x key dim x value dim, counted in float32; twice, since
    # each slot also keeps the prompt cache's saved copy of both (docs/prompt-cache.md); and
    # where the model drafts, once more after each row but the last of a verify entry, 8
    # rows (docs/exactness.md)
    one = 3 * (2 * 16 + 48) * 2 + 4 * 8 * 12 * 4
    assert linear.kv_bytes_per_position == 0
    assert linear.state_bytes_per_slot == 2 * one
    drafting = model_shape_from_config(config, 2, drafting=True)
    assert drafting.layers[0].state_bytes_per_slot == (2 + 7) * one
    assert drafting.layers[2].kv_bytes_per_position == full.kv_bytes_per_position


def test_sixty_four_hybrid_layers_on_many_nodes_runs():
    # Qwen3.5-27B's pattern (every 4th layer full attention) over 64 layers.
    rng = random.Random(64)
    shape = dataclasses.replace(hybrid(64), layers=tuple(
        dataclasses.replace(layer, weight_bytes=layer.weight_bytes // 3)
        for layer in hybrid(64).layers))
    nodes = mesh([typed(node(f"n{i}", rng.uniform(80, 240), decode=rng.uniform(0.2, 2.0),
                             prefill=rng.uniform(2.0, 20.0)), rng) for i in range(6)])
    p = place(spec(objective="decode"), shape, nodes)
    check_valid(p, spec(objective="decode"), shape, nodes)
    assert p.why[0].startswith("searched 1956 ring orders over 6 node(s)")
    s = spec(objective="prompt", context=4000)
    p = place(s, shape, nodes[:4])
    check_valid(p, s, shape, nodes[:4])


def test_the_pruned_prompt_search_reports_what_searching_every_ring_would():
    from supervisor.placement import _rings
    from supervisor.ring_cost import RingCosts, search_rings

    def answers(results):
        results = sorted(results, key=lambda r: r.rank)
        best = results[0]
        same = (best.nodes[0], frozenset(best.nodes))
        runner = next((r.objective_ms for r in results
                       if (r.nodes[0], frozenset(r.nodes)) != same), None)
        names = {n for r in results for n in r.nodes} - set(best.nodes)
        left_out = {n: next(r.objective_ms for r in results if n in r.nodes) for n in names}
        return best.objective_ms, runner, left_out

    rng = random.Random(77)
    compared = 0
    for _ in range(40):
        s, shape, nodes = random_hybrid_case(rng)
        s = dataclasses.replace(s, objective="prompt", rank0=None)
        problem = RingCosts(s, shape, nodes, s.context)
        rings = list(_rings([n.name for n in nodes], [n.name for n in nodes]))
        every = [r for ring in rings if (r := problem.ring_result(ring)) is not None]
        pruned, fitting = search_rings(problem, rings)
        assert fitting == len(every)
        if not every:
            continue
        compared += 1
        best, runner, left_out = answers(every)
        got = answers(pruned)
        assert got[0] == pytest.approx(best) and got[2].keys() == left_out.keys()
        assert (got[1] is None) == (runner is None) and (runner is None
                                                         or got[1] == pytest.approx(runner))
        assert all(got[2][n] == pytest.approx(ms) for n, ms in left_out.items())
    assert compared >= 10

"""Placement: equal to a brute force over every subset, order and boundary on random fleets;
memory, rank 0's extras and preference, the two objectives, shortfalls, explicit placements,
the byte counts from config.json, and the plan table."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest

from engine.checkpoint.maker import CheckpointSpec, config_json, tensor_plan
from engine.pipeline.round_builder import decode_groups
from supervisor.fleet_config import BACKENDS, CheckpointPaths, ExplicitStage, ModelSpec
from supervisor.memory import (
    ExecutionShape,
    ModelShape,
    ShapeError,
    layers_that_fit,
    model_shape_from_config,
    stage_memory,
)
from supervisor.placement import (
    DoesNotFit,
    LinkSnapshot,
    NodeSnapshot,
    Placement,
    PlacementError,
    place,
)

MB = 1_000_000
SHAPE = ModelShape.uniform(n_layers=8, layer_weight_bytes=10 * MB,
                           kv_bytes_per_position_per_layer=100, embedding_bytes=20 * MB,
                           final_norm_bytes=1000, head_bytes=20 * MB, hidden_size=500,
                           row_bytes=1000, vocab_size=1000)


def with_layers(shape: ModelShape, n_layers: int, **changes) -> ModelShape:
    """`shape` with `n_layers` layers of its first layer's type."""
    return dataclasses.replace(shape, layers=shape.layers[:1] * n_layers, **changes)


def spec(**overrides) -> ModelSpec:
    fields = dict(id="m", checkpoint=CheckpointPaths(all_nodes="/m"), backends=BACKENDS,
                  context=1000, parallel=2, chunk=100, objective="decode",
                  prompt_cache_slots=0)  # the figures by hand count streams' slots only
    return ModelSpec(**(fields | overrides))


def node(name: str, memory_mb: float, decode: float = 1.0, prefill: float = 10.0,
         peers: dict[str, tuple[float, float]] | None = None, batch: float | None = None,
         backend: str = "torch-cpu") -> NodeSnapshot:
    """peers: name -> (rtt ms, bandwidth bytes/s)."""
    links = tuple(LinkSnapshot(p, rtt, bw) for p, (rtt, bw) in (peers or {}).items())
    return NodeSnapshot(name, int(memory_mb * MB), backend, decode, batch or decode * 1.5,
                        prefill, links)


def mesh(nodes: list[NodeSnapshot], rtt_ms: float = 0.2, bandwidth: float = 1e9):
    """Every node linked to every other."""
    names = [n.name for n in nodes]
    return [dataclasses.replace(n, links=tuple(LinkSnapshot(p, rtt_ms, bandwidth)
                                               for p in names if p != n.name)) for n in nodes]


# --- brute force: every rank 0, subset, order and boundary, costed straight from the design


def ms(node: NodeSnapshot, shape: ModelShape, layer_range: tuple[int, int], what: str) -> float:
    """A stage's time, layer by layer: the node's time for each layer's type, else its own."""
    by_type = {t.layer_type: t for t in node.layer_type_ms}
    return sum(getattr(by_type.get(layer.name, node), what)
               for layer in shape.layers[layer_range[0]:layer_range[1]])


def brute_force(s: ModelSpec, shape: ModelShape, nodes: list[NodeSnapshot],
                prompt_tokens: int | None = None) -> float | None:
    execution = ExecutionShape(s.context, s.parallel, s.chunk, s.prompt_cache_slots or 0)
    chunks = math.ceil((prompt_tokens or s.context) / s.chunk)
    by_name = {n.name: n for n in nodes}
    candidates = [n.name for n in nodes
                  if n.backend in s.backends and s.checkpoint.path_for(n.name) is not None]

    def link(a, b):
        for src, dst in ((a, b), (b, a)):
            for lk in by_name[src].links:
                if lk.peer == dst:
                    return lk
        return None

    def hops(ring, rows):
        if len(ring) == 1:
            return []
        out = []
        for a, b in zip(ring, ring[1:] + ring[:1]):
            lk = link(a, b)
            if lk is None:
                return None
            out.append(lk.rtt_ms / 2 + rows * shape.row_bytes / lk.bandwidth_bytes_per_s * 1e3
                       + (by_name[a].hop_ms + by_name[b].hop_ms) / 2)  # each end's host work
        return out

    best = None
    for r0 in candidates if s.rank0 is None else [n for n in candidates if n == s.rank0]:
        others = [n for n in candidates if n != r0]
        for size in range(len(others) + 1):
            for perm in itertools.permutations(others, size):
                ring = (r0, *perm)
                hops_decode, hops_chunk = hops(ring, s.parallel), hops(ring, s.chunk)
                if hops_decode is None:
                    continue
                for cuts in itertools.combinations(range(1, shape.n_layers), len(ring) - 1):
                    bounds = (0, *cuts, shape.n_layers)
                    ranges = list(itertools.pairwise(bounds))
                    if any(stage_memory(shape, execution, r, i == 0).total_bytes
                           > by_name[n].usable_memory_bytes
                           for i, (n, r) in enumerate(zip(ring, ranges))):
                        continue
                    decode = decode_period(s, shape, [by_name[n] for n in ring], ranges,
                                           lambda rows, ring=ring: hops(ring, rows))
                    stages = [ms(by_name[n], shape, r, "prefill_ms_per_layer")
                              for n, r in zip(ring, ranges)]
                    prompt = (sum(stages) + sum(hops_chunk) + by_name[r0].head_ms
                              + (chunks - 1) * max(stages + hops_chunk))
                    cost = decode if s.objective == "decode" else prompt
                    best = cost if best is None else min(best, cost)
    return best


def at_rows(single: float, batch: float, parallel: int, rows: int) -> float:
    """A figure timed at 1 and `parallel` rows, at `rows` rows: on the line through them."""
    if rows == 1 or parallel == 1:
        return single
    return single + (batch - single) * (rows - 1) / (parallel - 1)


def decode_period(s: ModelSpec, shape: ModelShape, ring: list[NodeSnapshot],
                  ranges: list[tuple[int, int]], hops) -> float:
    """A stream's ms per token with `parallel` streams, straight from the design: the rounds
    in flight are the lane host's groups (one round per stage), and a token comes as often
    as the slowest of the largest group's trip, a stage's work over every group, a link's."""
    groups = decode_groups(s.parallel, len(ring))

    def stage(node, r, rows):
        return at_rows(ms(node, shape, r, "decode_ms_per_layer"),
                       ms(node, shape, r, "decode_batch_ms_per_layer"), s.parallel, rows)

    def head(rows):
        return at_rows(ring[0].head_ms, ring[0].head_batch_ms, s.parallel, rows)

    big = max(groups)
    # Every stage pays its host work once a round, on the trip and in its work per group.
    trip = (sum(stage(n, r, big) + n.round_ms for n, r in zip(ring, ranges)) + sum(hops(big))
            + head(big))
    work = [sum(stage(n, r, rows) + n.round_ms + (head(rows) if i == 0 else 0.0)
                for rows in groups)
            for i, (n, r) in enumerate(zip(ring, ranges))]
    links = [sum(hops(rows)[k] for rows in groups) for k in range(len(hops(big)))]
    return max([trip, *work, *links])


def random_case(rng: random.Random):
    n_layers = rng.randint(1, 9)
    shape = with_layers(SHAPE, n_layers,
                        embedding_bytes=rng.choice([0, 5, 20]) * MB,
                        head_bytes=rng.choice([0, 20]) * MB)
    names = [f"n{i}" for i in range(rng.randint(1, 4))]
    most_mb = rng.choice([70, 140])  # tight fleets need more stages
    nodes = []
    for name in names:
        peers = {p: (rng.uniform(0.0, 2.0), rng.uniform(1e7, 1e9)) for p in names
                 if p != name and rng.random() < 0.85}
        decode = rng.choice([rng.uniform(0.1, 3.0), 1.0])  # sometimes equal: ties
        nodes.append(dataclasses.replace(
            node(name, memory_mb=rng.uniform(5, most_mb), decode=decode,
                 batch=rng.uniform(0.2, 5.0), prefill=rng.uniform(1.0, 40.0),
                 peers=peers, backend=rng.choice(["torch-cpu", "torch-cpu", "mlx-cpu"])),
            # rank 0's head: none (a calibration from before it was timed) or a few layers'
            head_ms=rng.choice([0.0, rng.uniform(0.0, 6.0)]), head_batch_ms=rng.uniform(0.0, 9.0),
            # host work a round and a hop's end: none (a calibration from before them) or some
            round_ms=rng.choice([0.0, rng.uniform(0.0, 3.0)]),
            hop_ms=rng.choice([0.0, rng.uniform(0.0, 2.0)])))
    s = spec(context=rng.choice([100, 1000, 3000]), parallel=rng.choice([1, 2, 4]),
             prompt_cache_slots=rng.choice([0, 2, 8]),
             chunk=rng.choice([16, 100, 400]), objective=rng.choice(["decode", "prompt"]),
             backends=rng.choice([BACKENDS, ("torch-cpu",)]),
             rank0=rng.choice([None, None, rng.choice(names)]))
    if rng.random() < 0.2:  # a node without a checkpoint path
        s = dataclasses.replace(s, checkpoint=CheckpointPaths(by_node=tuple(
            (n, "/m") for n in names[:-1] or names)))
    return s, shape, nodes


def check_valid(p: Placement, s: ModelSpec, shape: ModelShape, nodes: list[NodeSnapshot]):
    by_name = {n.name: n for n in nodes}
    assert p.stages[0].layer_range[0] == 0 and p.stages[-1].layer_range[1] == shape.n_layers
    for a, b in zip(p.stages, p.stages[1:]):
        assert a.layer_range[1] == b.layer_range[0]
    assert len({st.node for st in p.stages}) == len(p.stages)
    for st in p.stages:
        assert st.layer_range[1] - st.layer_range[0] >= 1
        assert st.memory.total_bytes <= by_name[st.node].usable_memory_bytes
        assert st.backend in s.backends and s.checkpoint.path_for(st.node) is not None
        assert (st.memory.embedding_bytes > 0) == (st.rank == 0 and shape.embedding_bytes > 0)
    if s.rank0:
        assert p.stages[0].node == s.rank0


def assert_search_equals_brute_force(cases) -> None:
    """`place` finds brute force's best objective on every (spec, shape, nodes) case, or
    refuses exactly where brute force finds nothing."""
    fits = 0
    for s, shape, nodes in cases:
        expected = brute_force(s, shape, nodes)
        try:
            p = place(s, shape, nodes)
        except DoesNotFit:
            assert expected is None, (s, shape, nodes)
            continue
        fits += 1
        assert expected is not None
        assert p.objective_ms == pytest.approx(expected, rel=1e-9, abs=1e-9), (s, shape, nodes)
        check_valid(p, s, shape, nodes)
    assert fits >= 10  # the generator must exercise the search, not only the refusals


@pytest.mark.parametrize("seed", range(8))
def test_search_equals_brute_force_on_random_fleets(seed: int):
    rng = random.Random(seed)
    assert_search_equals_brute_force(random_case(rng) for _ in range(60))


def test_search_equals_brute_force_with_a_long_prompt():
    rng = random.Random(99)
    for _ in range(40):
        s, shape, nodes = random_case(rng)
        s = dataclasses.replace(s, objective="prompt")
        expected = brute_force(s, shape, nodes, prompt_tokens=5000)
        try:
            p = place(s, shape, nodes, prompt_tokens=5000)
        except DoesNotFit:
            assert expected is None
            continue
        assert p.prompt_tokens == 5000
        assert p.prompt_ms == pytest.approx(expected, rel=1e-9, abs=1e-9)


def test_memory_caps_the_fast_node():
    # The fast node holds at most 3 layers (it also pays rank 0's 40 MB extras).
    fast = node("fast", memory_mb=40 + 3 * 10.2 + 1, decode=0.1)
    slow = node("slow", memory_mb=500, decode=1.0)
    p = place(spec(rank0="fast"), SHAPE, mesh([fast, slow]))
    assert [(st.node, st.layer_range) for st in p.stages] == [("fast", (0, 3)), ("slow", (3, 8))]
    assert p.stages[0].memory.total_bytes <= p.stages[0].usable_memory_bytes


def test_rank0_extras_are_charged_to_rank0_only():
    # "big" holds all 8 layers but not with the embeddings and head as well, so rank 0 must
    # be "small", which then holds as few layers as it can.
    execution = ExecutionShape(1000, 2, 100)
    layers = stage_memory(SHAPE, execution, (0, 8), is_rank0=False).total_bytes
    big = node("big", memory_mb=layers / MB + 1, decode=0.5)
    small = node("small", memory_mb=100, decode=2.0)
    p = place(spec(), SHAPE, mesh([big, small]))
    assert [st.node for st in p.stages] == ["small", "big"]
    rank0, follower = p.stages[0].memory, p.stages[1].memory
    assert (rank0.embedding_bytes, rank0.head_bytes, rank0.final_norm_bytes) == (20 * MB,
                                                                                 20 * MB, 1000)
    assert rank0.staging_bytes > follower.staging_bytes  # rank 0 also keeps the logits
    assert follower.rank0_extras_bytes == 0
    assert layers_that_fit(SHAPE, execution, big.usable_memory_bytes, True) < 8
    assert layers_that_fit(SHAPE, execution, big.usable_memory_bytes, False) == 8


def test_rank0_preference_is_honoured_even_when_slower():
    a, b = node("a", 500, decode=0.5), node("b", 500, decode=2.0)
    assert place(spec(), SHAPE, mesh([a, b])).ring == ("a",)
    p = place(spec(rank0="b"), SHAPE, mesh([a, b]))
    assert p.ring[0] == "b"
    assert "rank 0 is b, as rank0 asks" in p.why


def test_rank0_preference_on_a_missing_node_does_not_fit():
    with pytest.raises(DoesNotFit, match="rank0 gone cannot hold rank 0: not among the live"):
        place(spec(rank0="gone"), SHAPE, mesh([node("a", 500)]))


def test_prompt_and_decode_objectives_choose_differently():
    # "gpu" prefills fast and decodes slowly; "mac" the other way round. Alone, each is
    # best at one objective; the hop between them makes a split lose for decode.
    gpu = node("gpu", 500, decode=2.0, prefill=5.0)
    mac = node("mac", 500, decode=1.0, prefill=40.0)
    nodes = mesh([gpu, mac], rtt_ms=1.0)
    decode = place(spec(objective="decode"), SHAPE, nodes)
    prompt = place(spec(objective="prompt"), SHAPE, nodes)
    assert decode.ring == ("mac",) and prompt.ring == ("gpu",)
    assert decode.decode_ms_per_token < prompt.decode_ms_per_token
    assert prompt.prompt_ms < decode.prompt_ms


def test_prompt_objective_balances_stages_for_many_chunks():
    # Two equal nodes: with many chunks, the pipeline pays the slowest stage per chunk,
    # so the prompt objective splits evenly where decode of one stream keeps one node (a
    # second stage only adds its hop to a lone stream's trip).
    a, b = node("a", 500, prefill=10.0), node("b", 500, prefill=10.0)
    nodes = mesh([a, b], rtt_ms=0.01, bandwidth=1e12)
    p = place(spec(objective="prompt", context=4000), SHAPE, nodes)
    assert [st.layer_range for st in p.stages] == [(0, 4), (4, 8)]
    assert place(spec(objective="decode", parallel=1), SHAPE, nodes).ring == ("a",)


def test_two_streams_on_two_equal_nodes_split_evenly_one_group_on_each():
    # A round of both streams on one node: 8 layers x 1.5 ms = 12 ms a token. Split, rank 0
    # keeps one stream's round on each stage: every layer at one row, 8 x 1.0 ms a trip, and
    # each stage runs both groups' 4 layers, 8 ms: 8 ms a token, at an even cut only.
    a, b = node("a", 500, decode=1.0, batch=1.5), node("b", 500, decode=1.0, batch=1.5)
    nodes = mesh([a, b], rtt_ms=0.0, bandwidth=1e15)
    p = place(spec(objective="decode", parallel=2), SHAPE, nodes)
    assert [st.layer_range for st in p.stages] == [(0, 4), (4, 8)]
    assert p.decode_ms_per_token == pytest.approx(8.0, rel=1e-6)
    assert p.decode_ms_per_token_single == pytest.approx(8.0, rel=1e-6)


def test_a_slow_node_is_left_out_and_explained():
    fast, slow = node("fast", 500, decode=0.5), node("slow", 500, decode=5.0)
    p = place(spec(), SHAPE, mesh([fast, slow]))
    assert p.ring == ("fast",)
    assert any(line.startswith("slow unused: the best ring with it is") for line in p.why)
    assert p.runner_up is not None and p.runner_up.objective_ms > p.objective_ms


def test_a_missing_link_rules_out_that_neighbour():
    a = node("a", 100, decode=1.0, peers={"b": (0.2, 1e9)})
    b = node("b", 100, decode=1.0, peers={"a": (0.2, 1e9)})
    c = node("c", 60, decode=0.1)  # fastest, but nobody has measured a link to it
    p = place(spec(), SHAPE, [a, b, c])
    assert set(p.ring) == {"a", "b"}


def test_excluded_nodes_are_named():
    mac = node("mac", 500, backend="mlx-metal")
    cpu = node("cpu", 500)
    p = place(spec(backends=("torch-cpu",)), SHAPE, mesh([mac, cpu]))
    assert p.ring == ("cpu",)
    assert "excluded mac: backend mlx-metal is not among torch-cpu" in p.why
    with pytest.raises(DoesNotFit, match="no node can hold a stage: mac"):
        place(spec(backends=("torch-cpu",)), SHAPE, [mac])


def grown(nodes: list[NodeSnapshot], name: str, extra_bytes: int) -> list[NodeSnapshot]:
    return mesh([dataclasses.replace(n, usable_memory_bytes=n.usable_memory_bytes + extra_bytes)
                 if n.name == name else n for n in nodes])


@pytest.mark.parametrize("a_mb,b_mb,expected", [
    # Rank 0 on b (too small for the extras) with a holding 5 layers beats rank 0 on a.
    (60, 40, "rank 0 on b, places 5 of 8 layers and leaves 30.8 MB short on b"),
    # Neither can be rank 0; a as rank 0 with b holding 4 layers is the nearest.
    (30, 45, "rank 0 on a, places 4 of 8 layers and leaves 51.0 MB short on a"),
])
def test_does_not_fit_names_the_shortfall(a_mb, b_mb, expected):
    nodes = [node("a", a_mb), node("b", b_mb)]
    with pytest.raises(DoesNotFit) as caught:
        place(spec(), SHAPE, mesh(nodes))
    err = caught.value
    assert str(err).startswith("m needs 122.0 MB for weights, KV and rank 0's extras across "
                               "2 node(s), which have ")
    assert f"the largest fit, {expected} (rank 0 extras: embeddings 20.0 MB" in str(err)
    # Adding what is missing, on the node it names, makes it fit; a byte less does not.
    place(spec(), SHAPE, grown(nodes, err.node, err.shortfall_bytes))
    with pytest.raises(DoesNotFit):
        place(spec(), SHAPE, grown(nodes, err.node, err.shortfall_bytes - 1))


def test_explicit_placement_is_validated_not_searched():
    stages = (ExplicitStage("a", (0, 2)), ExplicitStage("b", (2, 8)))
    nodes = mesh([node("a", 500, decode=0.5), node("b", 500, decode=2.0)])
    p = place(spec(placement=stages), SHAPE, nodes)
    assert p.explicit and [st.layer_range for st in p.stages] == [(0, 2), (2, 8)]
    assert p.runner_up is not None and p.runner_up.ring == ("a",)
    assert "auto would choose a 0:8" in p.why[1]
    with pytest.raises(DoesNotFit, match=r"b \(6 layers\) needs .* short"):
        place(spec(placement=stages), SHAPE, mesh([node("a", 500), node("b", 30)]))
    with pytest.raises(PlacementError, match="ends at layer 8, but the model has 9"):
        place(spec(placement=stages), with_layers(SHAPE, 9), nodes)
    with pytest.raises(DoesNotFit, match="not among the live nodes"):
        place(spec(placement=stages), SHAPE, nodes[:1])
    with pytest.raises(PlacementError, match="asks backend mlx-cpu"):
        place(spec(placement=(ExplicitStage("a", (0, 8), "mlx-cpu"),)), SHAPE, nodes)


def test_six_nodes_sixty_four_layers_runs():
    rng = random.Random(64)
    shape = dataclasses.replace(SHAPE, layers=(dataclasses.replace(SHAPE.layers[0],
                                                                   weight_bytes=2 * MB),) * 64)
    nodes = mesh([node(f"n{i}", rng.uniform(40, 120), decode=rng.uniform(0.2, 2.0),
                       prefill=rng.uniform(2.0, 20.0)) for i in range(6)])
    for objective in ("decode", "prompt"):
        p = place(spec(objective=objective), shape, nodes)
        check_valid(p, spec(objective=objective), shape, nodes)
        assert p.why[0].startswith("searched 1956 ring orders over 6 node(s)")


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("dtype,dtype_bytes", [("float32", 4), ("bfloat16", 2)])
def test_model_shape_matches_the_checkpoint_makers_tensors(family, tie, dtype, dtype_bytes):
    cs = CheckpointSpec(family=family, hidden_size=48, intermediate_size=100,
                        num_attention_heads=6, num_key_value_heads=2, head_dim=10,
                        num_hidden_layers=3, vocab_size=300, dtype=dtype, tie_word_embeddings=tie)
    shape = model_shape_from_config(config_json(cs), dtype_bytes)
    sizes: dict[str, int] = {}
    for t in tensor_plan(cs):
        part = t.name.split(".")[2] if t.name.startswith("model.layers.") else t.name
        sizes[part] = sizes.get(part, 0) + t.element_count * dtype_bytes
    assert [sizes[str(i)] for i in range(3)] == [layer.weight_bytes for layer in shape.layers]
    assert shape.embedding_bytes == sizes["model.embed_tokens.weight"]
    assert shape.final_norm_bytes == sizes["model.norm.weight"]
    assert shape.head_bytes == sizes.get("lm_head.weight", 0)
    assert {layer.kv_bytes_per_position for layer in shape.layers} == {2 * 2 * 10 * dtype_bytes}
    assert shape.row_bytes == 48 * dtype_bytes and shape.n_layers == 3


def test_stage_memory_by_hand():
    execution = ExecutionShape(context=1000, parallel=2, chunk=100)
    follower = stage_memory(SHAPE, execution, (0, 3), is_rank0=False)
    assert follower.weights_bytes == 3 * 10 * MB
    assert follower.kv_bytes == 3 * 100 * 1000 * 2
    # The prompt cache's kept slots hold a whole context of KV each, and nothing else grows.
    kept = stage_memory(SHAPE, dataclasses.replace(execution, prompt_cache_slots=3), (0, 3),
                        is_rank0=False)
    assert kept.kv_bytes == 3 * 100 * 1000 * (2 + 3)
    assert (kept.weights_bytes, kept.staging_bytes) == (follower.weights_bytes,
                                                         follower.staging_bytes)
    assert follower.staging_bytes == 2 * 100 * 1000  # a chunk of rows in, one out
    rank0 = stage_memory(SHAPE, execution, (0, 3), is_rank0=True)
    assert rank0.staging_bytes == follower.staging_bytes + 2 * 1000 * 4  # float32 logits
    assert rank0.total_bytes - follower.total_bytes == 40 * MB + 1000 + 2 * 1000 * 4
    assert layers_that_fit(SHAPE, execution, rank0.total_bytes, True) == 3
    assert layers_that_fit(SHAPE, execution, rank0.total_bytes - 1, True) == 2


def test_model_shape_of_qwen3_8b():
    shape = model_shape_from_config(dict(
        model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        tie_word_embeddings=False), 2)
    assert shape.total_weight_bytes == 8_190_735_360 * 2  # Qwen3-8B's published parameter count
    assert shape.layers[0].kv_bytes_per_position == 4096 and shape.is_uniform


def test_model_shape_refuses_bad_input():
    with pytest.raises(ShapeError, match="missing field"):
        model_shape_from_config({"model_type": "llama"}, 2)
    with pytest.raises(ShapeError, match="dtype_bytes"):
        model_shape_from_config({}, 0)

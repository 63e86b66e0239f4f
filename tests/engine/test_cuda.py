"""The PyTorch backend on CUDA against transformers on CUDA (skipped without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from engine.backends.base import StageSpec, load_stage
from engine.rounds import Op, RoundPlan, StreamEntry
from tests.engine.conftest import poison_torch_kv_past, stage_driver

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_cuda_logits_match_transformers_on_cuda(make_model, family):
    model_dir = make_model(family)
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = ref.to("cuda").eval()
    stage = load_stage(StageSpec(model_dir, (0, 3), "torch-cuda", 2, 128, 64))
    driver = stage_driver(stage)
    ids = np.random.default_rng(0).integers(0, 300, 40).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy()
    for pos, token in enumerate(ids):
        got = driver.round({0: [token]})[0]
        # Both sides run cuBLAS and SDPA kernels of their own choosing on the GPU.
        np.testing.assert_allclose(got, expected[pos], atol=1e-3, rtol=0)


def test_cuda_graph_decode_matches_eager_decode(make_model):
    """Decode rounds replayed as graphs (masked attention up to the live length's bucket)
    against eager ones (attention over the positions so far): the same tokens, logits
    within float32 noise."""
    model_dir = make_model("qwen3", num_hidden_layers=3)
    prompts = {s: np.random.default_rng(s).integers(0, 300, 9 + s).tolist() for s in range(3)}

    def run(cuda_graphs: bool):
        stage = load_stage(StageSpec(model_dir, (0, 3), "torch-cuda", 4, 128, 64, cuda_graphs))
        driver = stage_driver(stage)
        tokens = driver.greedy(prompts, 24)
        logits = driver.round({s: [t[-1]] for s, t in tokens.items()})
        return tokens, logits, stage

    graph_tokens, graph_logits, stage = run(True)
    eager_tokens, eager_logits, _ = run(False)
    assert stage.graphs.captured  # the decode rounds did replay graphs
    assert graph_tokens == eager_tokens
    for slot in graph_logits:
        np.testing.assert_allclose(graph_logits[slot], eager_logits[slot], atol=1e-4, rtol=0)


def test_graphs_of_several_runs_share_one_pool_and_replay_in_any_order(make_model):
    """Every decode graph of a stage draws from one memory pool; runs of slots captured in
    one order and replayed in others still give eager decoding's logits."""
    model_dir = make_model("llama", num_hidden_layers=3)
    prompts = {s: np.random.default_rng(10 + s).integers(0, 300, 5 + 3 * s).tolist()
               for s in range(4)}
    orders = [(0, 1, 2, 3), (0, 1), (2, 3), (1, 2), (0, 1, 2, 3), (2, 3), (0, 1), (1, 2, 3)]

    def run(cuda_graphs: bool):
        stage = load_stage(StageSpec(model_dir, (0, 3), "torch-cuda", 4, 128, 64, cuda_graphs))
        driver = stage_driver(stage)
        logits = driver.round(prompts)
        tokens = {s: int(np.argmax(row)) for s, row in logits.items()}
        out = []
        for slots in orders * 2:
            logits = driver.round({s: [tokens[s]] for s in slots})
            tokens.update({s: int(np.argmax(logits[s])) for s in slots})
            out.extend(logits[s] for s in slots)
        return out, stage

    graph_rows, stage = run(True)
    eager_rows, _ = run(False)
    # (0, 4), (0, 2), (2, 4), (1, 3), (1, 4), one row a slot, each reading keys up to the
    # context, 128
    assert sorted(stage.graphs.captured) == [((0, 2), 2, 128, 1), ((0, 4), 4, 128, 1),
                                             ((1, 3), 2, 128, 1), ((1, 4), 3, 128, 1),
                                             ((2, 4), 2, 128, 1)]
    assert {c.graph.pool() for c in stage.graphs.captured.values()} == {stage.graphs.pool}
    for got, want in zip(graph_rows, eager_rows, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_a_first_range_embeds_eagerly_then_replays_its_layers(make_model):
    """A first range's graph captures its layers only (the embedding runs eagerly before
    it): its rows match eager rows within float32 noise."""
    model_dir = make_model("qwen3", num_hidden_layers=3)
    ids = [[7, 8, 9], [3, 4]]

    def run(cuda_graphs: bool) -> list[torch.Tensor]:
        stage = load_stage(StageSpec(model_dir, (0, 1), "torch-cuda", 2, 64, 64, cuda_graphs))
        out = [stage.forward(RoundPlan(1, (StreamEntry(0, Op.OPEN, 0, 3, 0, 0, 0),
                                           StreamEntry(1, Op.OPEN, 0, 2, 0, 0, 0))),
                             None, ids[0] + ids[1])]
        for r, pos in enumerate(range(2, 6)):
            plan = RoundPlan(2 + r, (StreamEntry(0, Op.CONTINUE, pos + 1, 1, 1 if r else 3, 0, 0),
                                     StreamEntry(1, Op.CONTINUE, pos, 1, 1 if r else 2, 0, 0)))
            out.append(stage.forward(plan, None, [11 + r, 21 + r]).cpu())
        assert (stage.graphs is not None) == cuda_graphs and (
            not cuda_graphs or list(stage.graphs.captured) == [((0, 2), 2, 64, 1)])
        return out

    for got, want in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(got.cpu(), want.cpu(), atol=1e-5, rtol=0)


def graph_conversation(model_dir, context: int, steps: int, *, live_keys: bool = True,
                       poison_from: int | None = None):
    """Three streams of unequal prompts decoded greedily with graphs; with `poison_from`,
    NaN fills every slot's K and V from that position on first (an injected fault: a NaN
    read, even under a mask, poisons the output)."""
    stage = load_stage(StageSpec(model_dir, (0, 3), "torch-cuda", 3, context, 64,
                                 live_keys=live_keys))
    if poison_from is not None:
        poison_torch_kv_past(stage.model.cache, poison_from)
    prompts = {s: np.random.default_rng(20 + s).integers(0, 300, 6 + 5 * s).tolist()
               for s in range(3)}
    driver = stage_driver(stage)
    tokens = driver.greedy(prompts, steps)
    return tokens, driver.round({s: [t[-1]] for s, t in tokens.items()}), stage


def test_graphs_read_the_live_bucket_so_any_context_gives_the_same_bytes(make_model):
    """A short conversation's captured steps read 256 keys under a 32768-position context
    as under a 256-position one: the same graphs' keys, the same bytes, and nothing past
    position 256 is read (NaN there changes nothing)."""
    model_dir = make_model("qwen3", num_hidden_layers=3, seed=43)
    small_tokens, small_logits, small = graph_conversation(model_dir, 256, 20)
    large_tokens, large_logits, large = graph_conversation(model_dir, 32768, 20,
                                                           poison_from=256)
    assert {keys for _, _, keys, _ in large.graphs.captured} == {256}
    assert set(large.graphs.captured) == set(small.graphs.captured)
    assert large_tokens == small_tokens
    for slot, row in small_logits.items():
        assert large_logits[slot].tobytes() == row.tobytes(), slot


def test_the_whole_context_path_reads_what_nobody_wrote(make_model, monkeypatch):
    """The probe above can fail: graphs that read the whole context (the path before
    buckets, kept for the benchmark) under SDPA's mask come out NaN over the same poisoned
    cache. (The Triton decode kernel reads no key past a row's length, whatever the bound.)"""
    monkeypatch.setenv("FLEET_DECODE_ATTENTION", "sdpa")
    model_dir = make_model("qwen3", num_hidden_layers=3, seed=43)
    _, logits, stage = graph_conversation(model_dir, 4096, 4, live_keys=False,
                                          poison_from=256)
    assert {keys for _, _, keys, _ in stage.graphs.captured} == {4096}
    assert all(np.isnan(row).all() for row in logits.values())


def test_graphs_move_to_the_next_bucket_as_the_conversation_grows(make_model):
    """Crossing 256 positions, decode captures the next bucket (320) and stays within
    float32 noise of eager decoding, which reads exactly the live keys."""
    model_dir = make_model("qwen3", num_hidden_layers=3, seed=43)
    steps = 300 - 16  # the longest prompt (16) then decode past 256 and 288
    graph_tokens, graph_logits, stage = graph_conversation(model_dir, 4096, steps,
                                                           poison_from=320)
    assert {keys for _, _, keys, _ in stage.graphs.captured} == {256, 320}
    eager = load_stage(StageSpec(model_dir, (0, 3), "torch-cuda", 3, 4096, 64, False))
    prompts = {s: np.random.default_rng(20 + s).integers(0, 300, 6 + 5 * s).tolist()
               for s in range(3)}
    driver = stage_driver(eager)
    eager_tokens = driver.greedy(prompts, steps)
    eager_logits = driver.round({s: [t[-1]] for s, t in eager_tokens.items()})
    assert graph_tokens == eager_tokens
    for slot in graph_logits:
        np.testing.assert_allclose(graph_logits[slot], eager_logits[slot], atol=1e-4, rtol=0)


def test_captured_graphs_are_bounded_least_recently_replayed_first(make_model):
    """With room for two graphs, four runs of slots keep the two replayed last, and
    decoding recaptures what it needs again: logits still eager decoding's."""
    model_dir = make_model("llama", num_hidden_layers=3)
    prompts = {s: np.random.default_rng(30 + s).integers(0, 300, 5 + 2 * s).tolist()
               for s in range(4)}
    orders = [(0, 1, 2, 3), (0, 1), (2, 3), (1, 2), (0, 1, 2, 3), (0, 1)]

    def run(cuda_graphs: bool):
        stage = load_stage(StageSpec(model_dir, (0, 3), "torch-cuda", 4, 128, 64, cuda_graphs))
        if cuda_graphs:
            stage.graphs.max_graphs = 2
        driver = stage_driver(stage)
        logits = driver.round(prompts)
        tokens = {s: int(np.argmax(row)) for s, row in logits.items()}
        out = []
        for slots in orders:
            logits = driver.round({s: [tokens[s]] for s in slots})
            tokens.update({s: int(np.argmax(logits[s])) for s in slots})
            out.extend(logits[s] for s in slots)
            assert not cuda_graphs or len(stage.graphs.captured) <= 2
        return out, stage

    graph_rows, stage = run(True)
    eager_rows, _ = run(False)
    assert list(stage.graphs.captured) == [((0, 4), 4, 128, 1), ((0, 2), 2, 128, 1)]
    for got, want in zip(graph_rows, eager_rows, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)

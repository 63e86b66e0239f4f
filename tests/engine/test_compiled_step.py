"""The compiled decode step (FLEET_COMPILE): when a stage uses it, and that it computes
what the eager layers do.

The compiled layer is Inductor's on the CPU here (CUDA only adds capture around the same
graph): its greedy tokens must equal the eager stage's and its logits agree within the
dtype's rounding; its eager form must give the captured path's bytes exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config as inductor_config

from engine.backends.base import BackendError, StageSpec, load_stage
from engine.backends.pytorch.compiled_step import compiles, inductor_cache_dir
from engine.backends.pytorch.kv_cache import decode_index
from engine.config import ModelConfig
from engine.harness.local_pipeline import model_config
from engine.kv_pages import PAGE_POSITIONS, pages_for
from tests.engine.conftest import layout_of, stage_driver, teacher_forced_agreement

PROMPTS = {0: [5, 17, 9, 250, 3, 77, 41], 1: [8, 8, 120, 64], 2: [33] * 13}
STEPS = 12
CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def config_of(make_model, family: str) -> ModelConfig:
    return model_config(make_model(family))


@pytest.mark.parametrize(("mode", "device", "graphs", "expected"), [
    ("auto", CUDA, True, True),  # where fused kernels pay: inside the decode graphs
    ("auto", CUDA, False, False),
    ("auto", CPU, True, False),  # the CPU's path stays eager
    ("on", CPU, False, True),
    ("off", CUDA, True, False),
])
def test_when_a_dense_stage_compiles(make_model, mode, device, graphs, expected):
    assert compiles(mode, device, config_of(make_model, "qwen3"), False, graphs) is expected


def test_auto_leaves_hybrids_and_packed_weights_eager_and_on_refuses_them(make_model):
    hybrid, dense = config_of(make_model, "qwen3_5"), config_of(make_model, "qwen3")
    assert not compiles("auto", CUDA, hybrid, False, True)
    assert not compiles("auto", CUDA, dense, True, True)
    with pytest.raises(BackendError, match="FLEET_COMPILE=on: a hybrid's layers"):
        compiles("on", CPU, hybrid, False, False)
    with pytest.raises(BackendError, match="FLEET_COMPILE=on: packed weights"):
        compiles("on", CPU, dense, True, False)


def test_the_inductor_cache_survives_reboots_unless_the_user_chose(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    assert inductor_cache_dir() == tmp_path / "ringfleet" / "inductor"  # not torch's /tmp
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert inductor_cache_dir() == tmp_path / "ringfleet" / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert inductor_cache_dir() == tmp_path / "mine"


def whole_pages(keys: int) -> int:
    """Keys [0, keys) rounded up to whole pages: what `run_decode` reads."""
    return pages_for(keys) * PAGE_POSITIONS


def make_stage(model_dir, compile_mode: str):
    layers = model_config(model_dir).num_hidden_layers
    return load_stage(StageSpec(model_dir, (0, layers), "torch-cpu", 3, 256, 64,
                                compile=compile_mode))


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_the_eager_decode_block_gives_the_captured_paths_bytes(make_model, family):
    """`run_decode` with the plain layer (what the compiler traces) against `run_layers`
    over a decode index (what the graphs captured before), over a conversation's cache;
    mistral's sliding window cuts into the keys read."""
    stage = make_stage(make_model(family, seed=43), "off")
    stage_driver(stage).greedy(PROMPTS, STEPS)
    positions = torch.tensor([len(p) + STEPS for p in PROMPTS.values()])
    rows = torch.randn(3, stage.hidden_size, generator=torch.Generator().manual_seed(1))
    keys = whole_pages(int(positions.max()) + 1)  # what run_decode reads, as a bucket is
    window = stage.config.sliding_window
    with torch.inference_mode():
        before = stage.model.run_layers(rows, decode_index(positions, (0, 3), keys, window))
        k_before = stage.model.cache.k.clone()
        decoded = stage.model.run_decode(rows, positions, (0, 3), keys)
    assert torch.equal(decoded, before)
    assert torch.equal(stage.model.cache.k, k_before)  # it wrote the same K


@pytest.mark.parametrize(("family", "dtype", "tolerance"), [
    ("qwen3", "float32", 1e-4),  # q/k norms, GQA 4:1
    ("mistral", "bfloat16", 0.1),  # a sliding window, bfloat16 rounding
])
def test_compiled_stage_decodes_the_eager_stages_tokens(make_model, family, dtype, tolerance):
    """Teacher-forced with the eager stage's tokens, every round's logits agree within the
    dtype's rounding, and so does the greedy token wherever the eager logits' top two are
    further apart than that (in bfloat16 a tiny random model has exact ties, which a
    rounding either way breaks differently)."""
    model_dir = make_model(family, dtype=dtype, seed=43)
    eager, compiled = make_stage(model_dir, "off"), make_stage(model_dir, "on")
    assert eager.decode_step is None and compiled.decode_step is not None
    # Inductor chooses launches without timing them (compiled_step._prepare), so two
    # processes compiling the step keep the same ones and give the same bits.
    assert inductor_config.deterministic
    drivers = (stage_driver(eager), stage_driver(compiled))
    decided = teacher_forced_agreement(drivers, PROMPTS, STEPS + 1, tolerance)
    assert decided >= len(PROMPTS) * STEPS * 3 // 4  # ties are rare: most tokens compared


def test_verify_rows_take_the_decode_path_with_each_rows_own_slot(make_model):
    """A verify entry's rows as decode rows (RowLayout.of): several rows of
    one slot, each reading keys up to its own position, the layer given each row's slot.
    The plain layer gives the captured path's bytes, and both agree with the prompt-chunk
    path those rows took before."""
    from engine.backends.pytorch.kv_cache import RoundIndex
    from engine.rounds import Op, RoundPlan, RowLayout, StreamEntry

    stage = make_stage(make_model("qwen3", seed=43), "off")
    stage_driver(stage).greedy(PROMPTS, STEPS)
    at = [len(p) + STEPS for p in PROMPTS.values()]  # each slot's next position
    plan = RoundPlan(1, (StreamEntry(0, Op.CONTINUE, at[0], 3, 1, 0, 0),
                         StreamEntry(1, Op.CONTINUE, at[1], 1, 1, 0, 0),
                         StreamEntry(2, Op.CONTINUE, at[2], 4, 1, 0, 0)))
    layout = RowLayout.of(plan)
    assert layout.single_span == (0, 3) and not layout.spans
    positions = torch.tensor(layout.single_positions)
    offsets = torch.tensor(layout.single_slots)
    rows = torch.randn(8, stage.hidden_size, generator=torch.Generator().manual_seed(2))
    keys, window = whole_pages(layout.single_keys), stage.config.sliding_window
    cache = stage.model.cache.k.clone(), stage.model.cache.v.clone()
    with torch.inference_mode():
        captured = stage.model.run_layers(rows, decode_index(positions, (0, 3), keys, window,
                                                             offsets))
        decoded = stage.model.run_decode(rows, positions, (0, 3), keys, offsets=offsets)
        # The same rows as prompt chunks (slot 1's decode row first, then the two spans).
        spans = layout_of([(1, at[1])], [(0, at[0], at[0] + 3), (2, at[2], at[2] + 4)])
        order = torch.tensor([3, 0, 1, 2, 4, 5, 6, 7])
        as_spans = torch.empty_like(rows)
        as_spans[order] = stage.model.run_layers(rows[order],
                                                 RoundIndex.build(spans, stage.device, window))
    assert torch.equal(decoded, captured)
    torch.testing.assert_close(decoded, as_spans, atol=1e-5, rtol=1e-5)
    assert not torch.equal(stage.model.cache.k, cache[0])  # the rounds wrote their K


def test_one_compile_serves_every_row_count_whatever_came_first(make_model):
    """The compiled halves take the row count as a symbol from their first call: chunks of
    64, 8, 1 and 17 rows share one graph (automatic dynamic shapes compiled the first
    count static, then a second graph, so a round's kernels, and on CUDA its bits, hung
    on which shapes the process had seen), and each agrees with the eager halves."""
    from torch._dynamo.utils import counters

    from engine.backends.pytorch.compiled_step import compiled_layer_parts
    from engine.backends.pytorch.llama import attention_inputs, layer_output

    stage = make_stage(make_model("qwen3", seed=44, hidden_size=72), "off")
    model, config = stage.model, stage.config
    w = model.layers[0]
    parts = compiled_layer_parts()
    generator = torch.Generator().manual_seed(3)
    graphs = counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        for rows in (64, 8, 1, 17):
            x = torch.randn(rows, stage.hidden_size, generator=generator)
            positions = torch.arange(rows) + 5
            q, k, v = parts.inputs(x, w, config, model.rope.cos, model.rope.sin, positions)
            expected = attention_inputs(x, w, config, model.rope.cos, model.rope.sin, positions)
            for got, want in zip((q, k, v), expected, strict=True):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(parts.output(x, q, w, config),
                                       layer_output(x, q, w, config), atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] - graphs == 2  # one a half, for all four

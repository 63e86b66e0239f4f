"""The Qwen3.5 hybrid on the MLX backend against mlx-lm's `qwen3_5` model, float32.

Checkpoints come from our maker (`--family qwen3_5`, both layouts, tied and untied) and,
as a check of our loading that does not go through our own writer, from transformers
itself (`Qwen3_5ForCausalLM`, `Qwen3_5ForConditionalGeneration`) with random weights. The
real layer pattern (three Gated DeltaNet layers, then full attention) over 8 layers puts
a DeltaNet layer before one cut of the pipeline test and an attention layer before the
other.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.requirements import require

mx = require("mlx.core")
torch = require("torch")
transformers = require("transformers")
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen3_5 as mlx_lm_qwen3_5

from engine.backends.base import StageSpec, load_stage
from engine.checkpoint.maker import CheckpointSpec, make_checkpoint
from engine.config import FULL_ATTENTION, LINEAR_ATTENTION
from engine.link.errors import BadEntry
from engine.rounds import Op, RoundPlan, StreamEntry
from tests.engine.conftest import stage_driver
from tests.engine.logits_at_every_position import check_logits_at_every_position

LAYERS = 8
LAYER_TYPES = [FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(LAYERS)]
SHAPE = dict(vocab_size=300, hidden_size=32, intermediate_size=56, num_hidden_layers=LAYERS,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=16, linear_conv_kernel_dim=4)
# Head dims of 8 make a random model ill-conditioned: a head whose read S q nearly cancels is
# scaled up by the gated RMSNorm, so float32 noise grows (seed 13: mlx-lm and we both sit
# 1.2e-3 from a float64 transformers; seeds 11-16: we differ from mlx-lm by up to 2.4e-4).
# At 16 we agree with mlx-lm within 2e-5 over the same seeds.
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
              patch_size=4, num_position_embeddings=16)
SEED = 11
PROMPT_LENGTH = 96  # long enough for the recurrent state to matter, short enough for 2 cores
CASES = [("maker", "text", False), ("maker", "text", True), ("maker", "conditional", False),
         ("maker", "conditional", True), ("transformers", "text", False),
         ("transformers", "conditional", True)]


def _randomize(model, seed: int) -> None:
    """Weights at scales that keep activations and logits O(1), every norm away from its start."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("A_log"):  # decay rates exp(A_log) around 1, as the maker's
                p.copy_(0.5 * noise)
            elif p.ndim == 1:  # norms (1 + w, or w for the gated norm) and dt_bias
                p.copy_((1.0 if name.endswith("linear_attn.norm.weight") else 0.0) + 0.2 * noise)
            elif "conv1d" in name:
                p.copy_(0.5 * noise)
            elif "embed_tokens" in name:  # as the maker scales it: O(1) logits when tied
                p.copy_(noise * p.shape[-1] ** -0.5)
            else:
                p.copy_(noise * p.shape[-1] ** -0.5)


def _transformers_checkpoint(out: Path, layout: str, tie: bool, seed: int,
                             tokenizer: Path) -> Path:
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForCausalLM,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5TextConfig,
    )

    text = Qwen3_5TextConfig(**SHAPE, layer_types=LAYER_TYPES, tie_word_embeddings=tie,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.25})
    if layout == "text":
        model = Qwen3_5ForCausalLM(text)
    else:
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(
            text_config=text.to_dict(), vision_config=VISION, tie_word_embeddings=tie))
    _randomize(model, seed)
    model.save_pretrained(out)
    shutil.copy(tokenizer, out / "tokenizer.json")
    return out


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory):
    """(source, layout, tie) -> a float32 checkpoint directory, its seed its own (not the
    order tests ran in)."""
    made: dict[tuple[str, str, bool], Path] = {}
    seeds = {case: SEED + i for i, case in enumerate(CASES)}

    def make(source: str = "maker", layout: str = "text", tie: bool = False) -> Path:
        key = (source, layout, tie)
        if key not in made:
            out = tmp_path_factory.mktemp("-".join(("qwen3_5", source, layout, str(tie))))
            spec = CheckpointSpec(family="qwen3_5", **SHAPE, tie_word_embeddings=tie,
                                  multimodal=layout == "conditional", seed=seeds[key])
            if source == "maker":
                made[key] = make_checkpoint(out / "model", spec)
            else:
                tokenizer = make("maker", "text", False) / "tokenizer.json"
                made[key] = _transformers_checkpoint(out, layout, tie, seeds[key], tokenizer)
        return made[key]

    return make


def mlx_lm_model(model_dir: Path):
    """mlx-lm's qwen3_5 model of the checkpoint (it maps no `qwen3_5_text` type to a module)."""
    config = json.loads((model_dir / "config.json").read_text())
    model = mlx_lm_qwen3_5.Model(mlx_lm_qwen3_5.ModelArgs.from_dict(config))
    weights = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        weights.update(mx.load(str(path)))
    model.load_weights(list(model.sanitize(weights).items()))
    mx.eval(model.parameters())
    return model


def mlx_stage(model_dir: Path, layers: tuple[int, int] | None = None, *, parallel: int = 4,
              drafting: bool = False):
    return load_stage(StageSpec(model_dir, layers or (0, LAYERS), "mlx-cpu",
                                parallel, 256, 64, drafting=drafting))


def prompt_batch(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 300, n).tolist() for n in (PROMPT_LENGTH, 37, 5)]


def whole_prompt_logits(model, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))  # [positions, vocab]


@pytest.mark.parametrize(("source", "layout", "tie"), CASES)
def test_logits_match_mlx_lm_at_every_position(hybrid_model, source, layout, tie):
    model_dir = hybrid_model(source, layout, tie)
    ref = mlx_lm_model(model_dir)
    batch = prompt_batch(1)
    expected = [whole_prompt_logits(ref, ids) for ids in batch]
    driver = stage_driver(mlx_stage(model_dir))
    # One row a stream a round: decode rows of three slots at unrelated positions.
    check_logits_at_every_position(driver, batch, expected)
    # Whole prompts as chunks in one round, into the slots just released: a reused slot
    # starts clean, or these logits would carry the previous streams' state.
    driver.close(list(range(len(batch))))
    got = driver.round({0: batch[1], 1: batch[2], 2: batch[0]})
    for slot, ids in enumerate((batch[1], batch[2], batch[0])):
        np.testing.assert_allclose(got[slot], expected[(1, 2, 0)[slot]][-1], atol=1e-4, rtol=0)
    # Chunks and decode rows in one round, from states a previous round left.
    driver.close(list(range(len(batch))))
    driver.round({0: batch[0][:40], 1: batch[1][:2], 2: batch[2][:1]})
    got = driver.round({0: [batch[0][40]], 1: batch[1][2:30], 2: batch[2][1:4]})
    for slot, pos in ((0, 40), (1, 29), (2, 3)):
        np.testing.assert_allclose(got[slot], expected[slot][pos], atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", ["text", "conditional"])
def test_greedy_generation_matches_mlx_lm(hybrid_model, layout):
    model_dir = hybrid_model("maker", layout)
    ref = mlx_lm_model(model_dir)
    prompt = prompt_batch(2)[1]
    expected = [int(t) for t, _ in generate_step(mx.array(prompt), ref, max_tokens=24)]
    driver = stage_driver(mlx_stage(model_dir))
    got = driver.greedy({1: prompt}, 24)[1]
    assert got == expected
    assert len(set(got)) > 3, "a degenerate model would make this test meaningless"


@pytest.mark.parametrize("cut", [2, 4], ids=["after-deltanet", "after-attention"])
def test_two_stages_give_the_whole_models_bits(hybrid_model, cut):
    """On one backend a pipeline gives the same bits as one process (DESIGN, Exactness)."""
    assert LAYER_TYPES[cut - 1] == (LINEAR_ATTENTION if cut == 2 else FULL_ATTENTION)
    model_dir = hybrid_model()
    whole = mlx_stage(model_dir)
    first, last = mlx_stage(model_dir, (0, cut)), mlx_stage(model_dir, (cut, LAYERS))
    ids = prompt_batch(3)[1]  # 37 tokens
    # A 20-row chunk, a 9-row chunk, decode rows: (op, first position, rows, accepted).
    steps = [(Op.OPEN, 0, 20, 0), (Op.CONTINUE, 20, 9, 20)]
    steps += [(Op.CONTINUE, p, 1, 9 if p == 29 else 1) for p in range(29, 37)]
    for round_no, (op, first_pos, rows, accepted) in enumerate(steps, start=1):
        plan = RoundPlan(round_no, (StreamEntry(2, op, first_pos, rows, accepted, 0, 0),))
        chunk = ids[first_pos:first_pos + rows]
        want = whole.logits(whole.forward(plan, None, chunk))
        sent = first.rows_to_bytes(first.forward(plan, None, chunk))
        back = last.forward(plan, last.rows_from_bytes(sent, rows), None)
        got = first.logits(first.rows_from_bytes(last.rows_to_bytes(back), 1))
        assert got.tobytes() == want.tobytes(), f"round {round_no}"


def test_a_rollback_is_refused_by_name_and_changes_nothing(hybrid_model):
    stage = mlx_stage(hybrid_model())
    ids = prompt_batch(4)[0]
    stage.forward(RoundPlan(1, (StreamEntry(0, Op.OPEN, 0, 8, 0, 0, 0),)), None, ids[:8])
    before = stage.slots.snapshot()
    keep = RoundPlan(2, (StreamEntry(0, Op.CONTINUE, 6, 1, 6, 0, 0),))  # keep 6 of 8 rows
    with pytest.raises(BadEntry, match="state cannot be trimmed"):
        stage.forward(keep, None, ids[6:7])
    assert stage.slots.snapshot() == before


def test_state_counts_both_layer_types(hybrid_model):
    stage = mlx_stage(hybrid_model(), (2, 5), parallel=3)
    c = stage.config
    kv = 3 * 256 * 2 * c.kv_width * 4  # one attention layer (3) in 2:5, float32
    recurrent = 2 * 3 * c.recurrent_state_elements() * 4  # two DeltaNet layers (2, 4)
    assert stage.state_nbytes == kv + recurrent
    # A stage of a model that drafts keeps each verify row's state too: 7 copies more.
    drafting = mlx_stage(hybrid_model(), (2, 5), parallel=3, drafting=True)
    per_copy = 2 * 3 * (c.linear_conv_width * (c.linear_conv_kernel_dim - 1)
                        + c.linear_num_value_heads * c.linear_key_head_dim
                        * c.linear_value_head_dim) * 4
    assert drafting.state_nbytes - stage.state_nbytes == 7 * per_copy


@pytest.mark.parametrize("layers", [(0, 2), (2, 5), (4, 8)])
def test_a_range_reads_only_its_own_text_tensors(hybrid_model, monkeypatch, layers):
    """Range-only loading holds for the hybrid: never the vision tower, MTP or other layers."""
    from engine.backends.mlx import stage as mlx_stage_module

    model_dir = hybrid_model("maker", "conditional")
    read: list[str] = []
    real = mlx_stage_module.load_range_tensors

    def spy(checkpoint, shapes, dtype, quant=None):
        read.extend(shapes)
        return real(checkpoint, shapes, dtype, quant)

    monkeypatch.setattr(mlx_stage_module, "load_range_tensors", spy)
    stage = mlx_stage(model_dir, layers)
    prefix = "model.language_model."
    assert all(n.startswith(prefix) or n == "lm_head.weight" for n in read), read
    read_layers = {int(n.removeprefix(prefix + "layers.").split(".")[0]) for n in read
                   if n.startswith(prefix + "layers.")}
    assert read_layers == set(range(*layers))
    assert (prefix + "embed_tokens.weight" in read) == (layers[0] == 0) == stage.is_first
    deltanet = [LAYER_TYPES[i] for i in range(*layers)].count(LINEAR_ATTENTION)
    assert len(stage.model.cache.recurrent.delta) == deltanet
    assert len(stage.model.cache.kv.k) == layers[1] - layers[0] - deltanet


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_logits_and_greedy_match_mlx_lm(hybrid_model, tmp_path, bits):
    """mlx-lm's affine format (our writer): MLX computes with the packed weights, as mlx-lm."""
    from mlx import nn

    from engine.checkpoint.quantize import quantize_checkpoint

    model_dir = quantize_checkpoint(hybrid_model("maker", "conditional"), tmp_path / "q",
                                    bits, 32)
    config = json.loads((model_dir / "config.json").read_text())
    ref = mlx_lm_qwen3_5.Model(mlx_lm_qwen3_5.ModelArgs.from_dict(config))
    weights = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        weights.update(mx.load(str(path)))
    weights = ref.sanitize(weights)
    nn.quantize(ref, group_size=32, bits=bits,
                class_predicate=lambda path, _module: f"{path}.scales" in weights)
    ref.load_weights(list(weights.items()))
    batch = prompt_batch(6)
    expected = [whole_prompt_logits(ref, ids) for ids in batch]
    stage = mlx_stage(model_dir)
    assert type(stage.model.layers[0].qkv).__name__ == "QuantizedWeight"
    driver = stage_driver(stage)
    check_logits_at_every_position(driver, batch, expected)
    driver.close(list(range(len(batch))))
    want = [int(t) for t, _ in generate_step(mx.array(batch[1]), ref, max_tokens=16)]
    assert driver.greedy({0: batch[1]}, 16)[0] == want

"""The Qwen3.5 hybrid on the MLX backend against mlx-lm's `qwen3_5` model, float32.

Checkpoints are written by transformers itself (`Qwen3_5ForCausalLM` and the vision +
text `Qwen3_5ForConditionalGeneration`) with random weights, every norm away from its
(1 + 0) start so the norm convention is exercised. The layer pattern puts a Gated DeltaNet
layer and a full-attention layer on each side of the cuts the pipeline test makes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen3_5 as mlx_lm_qwen3_5

from engine.backends.base import StageSpec, load_stage
from engine.link.errors import BadEntry
from engine.rounds import Op, RoundPlan, StreamEntry
from tests.engine.conftest import stage_driver
from tests.engine.logits_at_every_position import check_logits_at_every_position

# mlx-lm reads the pattern from full_attention_interval alone (every 2nd layer full here).
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
TEXT = dict(vocab_size=300, hidden_size=32, intermediate_size=56, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=12, linear_conv_kernel_dim=4, layer_types=LAYER_TYPES, full_attention_interval=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.25})
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
              patch_size=4, num_position_embeddings=16)
PROMPT_LENGTH = 96  # long enough for the recurrent state to matter, short enough for 2 cores


def _randomize(model, seed: int) -> None:
    """Weights at scales that keep activations O(1) and make every part of the model count."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("A_log"):
                p.copy_(torch.log(1 + 3 * torch.rand(p.shape, generator=gen)))
            elif p.ndim == 1:  # norms (1 + w, or w for the gated norm) and dt_bias
                p.copy_((1.0 if name.endswith("linear_attn.norm.weight") else 0.0) + 0.2 * noise)
            elif "conv1d" in name:
                p.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * p.shape[-1] ** -0.5)


@pytest.fixture(scope="module")
def hybrid_model(make_model, tmp_path_factory):
    """(layout, tie) -> a checkpoint directory transformers wrote."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForCausalLM,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5TextConfig,
    )

    tokenizer = make_model("qwen3") / "tokenizer.json"
    made: dict[tuple[str, bool], Path] = {}

    def make(layout: str = "text", tie: bool = False) -> Path:
        if (layout, tie) in made:
            return made[(layout, tie)]
        out = tmp_path_factory.mktemp(f"qwen3_5-{layout}-{'tied' if tie else 'untied'}")
        text = Qwen3_5TextConfig(**TEXT, tie_word_embeddings=tie)
        if layout == "text":
            model = Qwen3_5ForCausalLM(text)
        else:
            model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(
                text_config=text.to_dict(), vision_config=VISION, tie_word_embeddings=tie))
        _randomize(model, seed=len(made) + 11)
        model.save_pretrained(out)
        shutil.copy(tokenizer, out / "tokenizer.json")
        made[(layout, tie)] = out
        return out

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


def mlx_stage(model_dir: Path, layers: tuple[int, int] | None = None, *, parallel: int = 4):
    return load_stage(StageSpec(model_dir, layers or (0, len(LAYER_TYPES)), "mlx-cpu",
                                parallel, 256, 64))


def prompt_batch(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 300, n).tolist() for n in (PROMPT_LENGTH, 37, 5)]


def whole_prompt_logits(model, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))  # [positions, vocab]


@pytest.mark.parametrize(("layout", "tie"), [("text", False), ("text", True),
                                             ("conditional", False), ("conditional", True)])
def test_logits_match_mlx_lm_at_every_position(hybrid_model, layout, tie):
    model_dir = hybrid_model(layout, tie)
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
    model_dir = hybrid_model(layout)
    ref = mlx_lm_model(model_dir)
    prompt = prompt_batch(2)[1]
    expected = [int(t) for t, _ in generate_step(mx.array(prompt), ref, max_tokens=24)]
    driver = stage_driver(mlx_stage(model_dir))
    got = driver.greedy({1: prompt}, 24)[1]
    assert got == expected
    assert len(set(got)) > 3, "a degenerate model would make this test meaningless"


@pytest.mark.parametrize("cut", [1, 2], ids=["after-deltanet", "after-attention"])
def test_two_stages_give_the_whole_models_bits(hybrid_model, cut):
    """On one backend a pipeline gives the same bits as one process (DESIGN, Exactness)."""
    model_dir = hybrid_model("text")
    whole = mlx_stage(model_dir)
    first, last = mlx_stage(model_dir, (0, cut)), mlx_stage(model_dir, (cut, len(LAYER_TYPES)))
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
    stage = mlx_stage(hybrid_model("text"))
    ids = prompt_batch(4)[0]
    stage.forward(RoundPlan(1, (StreamEntry(0, Op.OPEN, 0, 8, 0, 0, 0),)), None, ids[:8])
    before = stage.slots.snapshot()
    keep = RoundPlan(2, (StreamEntry(0, Op.CONTINUE, 6, 1, 6, 0, 0),))  # keep 6 of 8 rows
    with pytest.raises(BadEntry, match="recurrent state cannot be trimmed"):
        stage.forward(keep, None, ids[6:7])
    assert stage.slots.snapshot() == before


def test_state_counts_both_layer_types(hybrid_model):
    stage = mlx_stage(hybrid_model("text"), (0, 3), parallel=3)
    c = stage.config
    kv = 3 * 256 * 2 * c.kv_width * 4  # one attention layer in 0:3
    recurrent = 2 * 3 * c.recurrent_state_elements() * 4  # two DeltaNet layers
    assert stage.state_nbytes == kv + recurrent

"""The MLX backend against mlx-lm on generated float32 checkpoints, dense and quantized."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.requirements import require

mx = require("mlx.core")
mlx_lm_utils = require("mlx_lm.utils")
from mlx_lm.convert import convert
from mlx_lm.generate import generate_step

from engine.backends.base import BackendError, StageSpec, load_stage
from engine.rounds import Op, RoundPlan, StreamEntry
from tests.conftest import FAMILY_SPECS
from tests.engine.conftest import stage_driver
from tests.engine.logits_at_every_position import check_logits_at_every_position, prompts

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
WINDOW = FAMILY_SPECS["mistral"]["sliding_window"]
# mlx-lm's qwen2 module ignores config.json's head_dim and uses hidden_size // heads (as
# every published Qwen2 does); FAMILY_SPECS' odd head_dim 8 (36 / 6 = 6) is checked against
# our torch backend and transformers instead.
MLX_LM_SHAPES = {"qwen2": {"head_dim": 6}}


def mlx_stage(model_dir: Path, *, parallel: int = 4, context: int = 256, chunk: int = 64):
    n_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    return load_stage(StageSpec(model_dir, (0, n_layers), "mlx-cpu", parallel, context, chunk))


def reference(model_dir: Path, *, honour_window: bool = True):
    """mlx-lm's model of the checkpoint.

    mlx-lm loads `mistral` as its `llama` module, which applies a sliding window only to
    layers that `layer_types` marks "sliding_attention"; Mistral's config.json has no
    `layer_types`, so stock mlx-lm attends over the whole context where transformers (and
    we) stop at the window. `honour_window` marks every layer sliding, which is what the
    checkpoint means. It is done on the built model because mlx-lm refuses a `layer_types`
    without one "full_attention" layer.
    """
    model, _tokenizer = mlx_lm_utils.load(str(model_dir))
    if honour_window and getattr(model.model, "sliding_window", None):
        for layer in model.layers:
            layer.use_sliding = True  # sliding mask, and a RotatingKVCache in make_cache
        model.model.swa_idx = 0
    return model


def whole_prompt_logits(model, ids: list[int]) -> np.ndarray:
    logits = model(mx.array([ids]))[0].astype(mx.float32)  # [positions, vocab]
    return np.array(logits)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_mlx_lm_at_every_position(make_model, family, tie):
    model_dir = make_model(family, tie=tie, **MLX_LM_SHAPES.get(family, {}))
    ref = reference(model_dir)
    batch = prompts(1)
    expected = [whole_prompt_logits(ref, ids) for ids in batch]
    driver = stage_driver(mlx_stage(model_dir))
    check_logits_at_every_position(driver, batch, expected)
    # Whole prompts as chunks in one round: the last position of each.
    driver.close(list(range(len(batch))))
    got = driver.round(dict(enumerate(batch)))
    for slot in range(len(batch)):
        np.testing.assert_allclose(got[slot], expected[slot][-1], atol=1e-4, rtol=0)
    # Chunks and decode rows in one round: slot 0 decodes while 1 and 2 run 3-row chunks.
    driver.close(list(range(len(batch))))
    driver.round({0: batch[0][:4], 1: batch[1][:2], 2: batch[2][:9]})
    got = driver.round({0: [batch[0][4]], 1: batch[1][2:5], 2: batch[2][9:12]})
    for slot, pos in ((0, 4), (1, 4), (2, 11)):
        np.testing.assert_allclose(got[slot], expected[slot][pos], atol=1e-4, rtol=0)


def test_stock_mlx_lm_ignores_mistral_sliding_window(make_model):
    """What is true today: stock mlx-lm agrees with us inside the window, not past it."""
    model_dir = make_model("mistral")
    stock = reference(model_dir, honour_window=False)
    ids = prompts(1)[1]  # 23 positions, window 9
    expected = whole_prompt_logits(stock, ids)
    driver = stage_driver(mlx_stage(model_dir))
    diffs = []
    for pos, token in enumerate(ids):
        diffs.append(float(np.abs(driver.round({0: [token]})[0] - expected[pos]).max()))
    assert max(diffs[:WINDOW]) < 1e-4
    assert min(diffs[WINDOW:]) > 1e-3, "mlx-lm now honours Mistral's window: drop the override"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_mlx_lm(make_model, family):
    model_dir = make_model(family, **MLX_LM_SHAPES.get(family, {}))
    ref = reference(model_dir)
    prompt = prompts(2)[1]
    expected = [int(token) for token, _ in generate_step(mx.array(prompt), ref, max_tokens=32)]
    driver = stage_driver(mlx_stage(model_dir))
    got = driver.greedy({0: prompt}, 32)[0]
    assert got == expected
    assert len(set(got)) > 3, "a degenerate model would make this test meaningless"


# mlx-lm's affine quantization (`mlx_lm.convert -q`) of generated checkpoints. Group size 32
# packs what it divides and leaves the rest dense (qwen3: q, k, v, gate, up, embeddings and
# head packed; o and down, 72 and 88 wide, dense), so every case mixes the two.
QUANTIZED = {
    "qwen3-4bit": dict(family="qwen3", bits=4),
    "qwen3-8bit-tied": dict(family="qwen3", bits=8, tie=True),
    "qwen3-mixed-3-6": dict(family="qwen3", bits=4, recipe="mixed_3_6"),  # per-path overrides
    "qwen2-4bit": dict(family="qwen2", bits=4, hidden_size=64, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, intermediate_size=96),
}


@pytest.fixture(scope="session")
def quantized_model(make_model, tmp_path_factory):
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            shape = dict(QUANTIZED[name])
            family, bits = shape.pop("family"), shape.pop("bits")
            recipe = shape.pop("recipe", None)
            out = tmp_path_factory.mktemp(name) / "model"
            convert(str(make_model(family, **shape)), str(out), quantize=True, q_group_size=32,
                    q_bits=bits, quant_predicate=recipe)
            made[name] = out
        return made[name]

    return make


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_quantized_logits_and_greedy_match_mlx_lm(quantized_model, name):
    model_dir = quantized_model(name)
    ref = reference(model_dir)
    batch = prompts(1)
    expected = [whole_prompt_logits(ref, ids) for ids in batch]
    driver = stage_driver(mlx_stage(model_dir))
    assert type(driver.stage.model.layers[0].q).__name__ == "QuantizedWeight"
    check_logits_at_every_position(driver, batch, expected)
    driver.close(list(range(len(batch))))
    prompt = batch[1]
    want = [int(token) for token, _ in generate_step(mx.array(prompt), ref, max_tokens=16)]
    got = driver.greedy({0: prompt}, 16)[0]
    assert got == want


def test_quantized_ranges_give_the_whole_models_bits(quantized_model):
    """On one backend a pipeline gives the same bits as one process (DESIGN, Exactness)."""
    model_dir = quantized_model("qwen3-mixed-3-6")
    whole = mlx_stage(model_dir)
    first = load_stage(StageSpec(model_dir, (0, 1), "mlx-cpu", 4, 256, 64))
    last = load_stage(StageSpec(model_dir, (1, 3), "mlx-cpu", 4, 256, 64))
    assert first.model.head is not None and last.model.embed is None
    ids = prompts(3)[1]  # 23 tokens
    # A 9-row chunk, a 5-row chunk, a decode row: (op, first position, rows, accepted).
    steps = [(Op.OPEN, 0, 9, 0), (Op.CONTINUE, 9, 5, 9), (Op.CONTINUE, 14, 1, 5)]
    for round_no, (op, first_pos, rows, accepted) in enumerate(steps, start=1):
        plan = RoundPlan(round_no, (StreamEntry(0, op, first_pos, rows, accepted, 0, 0),))
        chunk = ids[first_pos:first_pos + rows]
        want = whole.logits(whole.forward(plan, None, chunk))
        sent = first.rows_to_bytes(first.forward(plan, None, chunk))
        back = last.forward(plan, last.rows_from_bytes(sent, rows), None)
        got = first.logits(first.rows_from_bytes(last.rows_to_bytes(back),
                                                 len(plan.returned_rows())))
        assert got.tobytes() == want.tobytes()


def test_a_non_affine_quantization_is_refused_by_name(make_model, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(make_model("qwen3"), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(BackendError, match="mxfp4"):
        mlx_stage(model_dir)

"""A synthetic range checkpoint holds exactly one range's tensors, as a real stage loads them."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors import safe_open

from engine.backends.base import StageSpec, load_stage
from engine.checkpoint.synthetic import FILE_NAME, write_range
from engine.config import ModelConfig
from engine.family import layer_tensor_shapes

DENSE = dict(model_type="qwen3", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
             torch_dtype="float32")
QUANT = {"group_size": 32, "bits": 4, "mode": "affine"}


def stored(directory) -> dict[str, np.ndarray]:
    with safe_open(str(directory / FILE_NAME), "numpy") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def test_only_the_range_is_written_and_a_stage_loads_it(tmp_path):
    checkpoint = write_range(tmp_path, DENSE, (1, 3))
    config = ModelConfig.from_dict(DENSE)
    expected = {**layer_tensor_shapes(config, 1), **layer_tensor_shapes(config, 2)}
    tensors = stored(tmp_path)
    assert {n: t.shape for n, t in tensors.items()} == expected
    assert all(t.dtype == np.float16 for t in tensors.values())
    norm = tensors["model.layers.1.input_layernorm.weight"]
    assert (norm == 1).all()
    q = tensors["model.layers.2.self_attn.q_proj.weight"].astype(np.float32)
    assert 0.015 < q.std() < 0.025 and abs(q.mean()) < 0.005
    stage = load_stage(StageSpec(tmp_path, (1, 3), "torch-cpu", 2, 64, 16),
                       checkpoint=checkpoint)
    assert not stage.is_first and not stage.is_last and len(stage.model.layers) == 2


def test_a_quantized_shape_is_stored_packed_as_mlx_lm_packs_it(tmp_path):
    write_range(tmp_path, dict(DENSE, quantization=QUANT), (1, 2))
    tensors = stored(tmp_path)
    words = tensors["model.layers.1.mlp.down_proj.weight"]
    assert words.dtype == np.uint32 and words.shape == (64, 96 * 4 // 32)
    assert tensors["model.layers.1.mlp.down_proj.scales"].shape == (64, 96 // 32)
    assert tensors["model.layers.1.input_layernorm.weight"].dtype == np.float16


@pytest.mark.parametrize("layer_range", [(0, 2), (2, 4), (3, 2)])
def test_a_range_with_embeddings_or_head_is_refused(tmp_path, layer_range):
    with pytest.raises(ValueError, match="strictly inside"):
        write_range(tmp_path, DENSE, layer_range)


@pytest.mark.parametrize("tie", [True, False])
def test_rank0s_range_with_its_ends_loads_as_rank0_and_samples(tmp_path, tie):
    """With `ends`, the range from layer 0 holds the embeddings, final norm and head (a tied
    head is the embedding table), and the stage it loads samples returned rows."""
    from engine.family import end_tensor_shapes
    from engine.sampling import RowDraw, SamplingBatch, SamplingParams

    raw = dict(DENSE, tie_word_embeddings=tie)
    checkpoint = write_range(tmp_path, raw, (0, 1), ends=True)
    config = ModelConfig.from_dict(raw)
    assert {n: t.shape for n, t in stored(tmp_path).items()} == {
        **layer_tensor_shapes(config, 0), **end_tensor_shapes(config)}
    assert ("lm_head.weight" in stored(tmp_path)) == (not tie)
    stage = load_stage(StageSpec(tmp_path, (0, 1), "torch-cpu", 2, 64, 16),
                       checkpoint=checkpoint)
    assert stage.is_first and not stage.is_last
    rows = stage.rows_from_bytes(bytes(2 * 64 * 4), 2)
    batch = SamplingBatch.of([RowDraw(i, SamplingParams(), 0.5) for i in range(2)])
    assert len(stage.sample(rows, batch).token_ids) == 2
    with pytest.raises(ValueError, match="start at layer 0"):
        write_range(tmp_path, raw, (1, 2), ends=True)

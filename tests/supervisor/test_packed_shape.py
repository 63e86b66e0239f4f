"""Placement charges a quantized checkpoint at what its backends hold (supervisor.memory):
packed where every backend of the model runs it packed, dense where one dequantizes."""

from __future__ import annotations

import json
from pathlib import Path

from engine.checkpoint.maker import PRESETS, config_json
from supervisor.checkpoints import read_shape
from supervisor.fleet_config import CheckpointPaths, ModelSpec
from supervisor.memory import ExecutionShape, layers_that_fit, model_shape_from_config

QUANT = {"group_size": 64, "bits": 4, "mode": "affine"}


def raw_config(dtype: str, **quant) -> dict:
    raw = config_json(PRESETS["8b"]) | {"dtype": dtype, "torch_dtype": dtype}
    if quant:
        raw |= {"quantization": quant, "quantization_config": quant}
    return raw


def shape_of(tmp_path: Path, raw: dict, backends: tuple[str, ...]):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    shape = read_shape(ModelSpec("m", CheckpointPaths(all_nodes=str(tmp_path)), backends, 256))
    assert not isinstance(shape, str), shape
    return shape


def test_an_8b_4bit_bfloat16_model_is_charged_packed_on_torch_and_mlx(tmp_path):
    dense = shape_of(tmp_path, raw_config("bfloat16"), ("torch-cuda", "mlx-metal"))
    packed = shape_of(tmp_path, raw_config("bfloat16", **QUANT), ("torch-cuda", "mlx-metal"))
    layer, dense_layer = packed.layers[0].weight_bytes, dense.layers[0].weight_bytes
    # 4 bits and a bfloat16 scale and bias per 64 weights: 4.5 of 16 bits, norms aside.
    assert abs(layer / dense_layer - 4.5 / 16) < 0.01, layer / dense_layer
    assert packed.embedding_bytes == dense.embedding_bytes * 4.5 / 16  # looked up as stored
    assert packed.head_bytes == dense.head_bytes * 4.5 / 16  # 128,256 rows: no padding
    assert packed.layers[0].kv_bytes_per_position == dense.layers[0].kv_bytes_per_position
    # So a 24 GB node holds 2.6x the layers it would hold dense.
    execution = ExecutionShape(4096, 4, 256)
    fits = [layers_that_fit(s, execution, 24 * 10**9, False) for s in (dense, packed)]
    assert fits[1] > 2.5 * fits[0], fits


def test_one_backend_that_dequantizes_charges_dense_for_the_model(tmp_path):
    """float32 stays dense on torch-cpu (quant_policy): the one shape is charged dense."""
    raw = raw_config("float32", **QUANT)
    with_torch = shape_of(tmp_path, raw, ("torch-cpu", "mlx-cpu"))
    mlx_only = shape_of(tmp_path, raw, ("mlx-cpu",))
    dense = model_shape_from_config(raw_config("float32"), 4)
    assert with_torch.layers[0].weight_bytes == dense.layers[0].weight_bytes
    assert mlx_only.layers[0].weight_bytes < dense.layers[0].weight_bytes / 5


def test_a_layer_type_is_charged_at_its_widest_layer(tmp_path):
    """mlx-lm's mixed recipes pack some layers wider: the type costs its largest layer."""
    quant = dict(QUANT, **{"model.layers.3.mlp.down_proj": {"group_size": 64, "bits": 8}})
    mixed = shape_of(tmp_path, raw_config("bfloat16", **quant), ("mlx-metal",))
    plain = shape_of(tmp_path, raw_config("bfloat16", **QUANT), ("mlx-metal",))
    hidden, inter = 4096, 14336
    extra = hidden * inter * 4 // 8  # four more bits a weight for one down_proj
    assert mixed.layers[0].weight_bytes == plain.layers[0].weight_bytes + extra


def test_a_tied_table_is_charged_once_where_the_triton_kernels_read_it_as_stored(tmp_path):
    """On CUDA our Triton kernels run the head's matmul from the bytes its lookups read (one
    copy, as MLX holds it); torch-cpu holds those bytes and its int4 layout besides."""
    raw = raw_config("bfloat16", **QUANT) | {"tie_word_embeddings": True}
    cuda = shape_of(tmp_path, raw, ("torch-cuda",))
    cpu = shape_of(tmp_path, raw, ("torch-cpu",))
    mlx = shape_of(tmp_path, raw, ("mlx-metal",))
    assert cuda.embedding_bytes == mlx.embedding_bytes
    assert cpu.embedding_bytes == 2 * mlx.embedding_bytes  # 128,256 rows: no padding
    assert cuda.layers[0].weight_bytes == mlx.layers[0].weight_bytes

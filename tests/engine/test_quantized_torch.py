"""Quantized checkpoints: our writer against mlx-lm's, and PyTorch's dequantized load against MLX.

The writer (`engine.checkpoint.quantize`) must produce mlx-lm's affine format exactly, and
the PyTorch stage held dense (`FLEET_QUANT=dense`) must see, after dequantizing its range at
load, the very values `mx.dequantize` gives for the same packed tensors (bit for bit, float32
and bfloat16). The packed path (the default) is held to mlx-lm in test_packed_exactness.py;
the closeness test below runs both.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.requirements import require

mx = require("mlx.core")
mlx_lm_utils = require("mlx_lm.utils")
from mlx_lm.convert import convert
from safetensors.numpy import save_file

from engine.backends.base import BackendError, StageSpec, load_stage
from engine.checkpoint import reader
from engine.checkpoint.quant_config import AFFINE_BITS, QuantConfigError
from engine.checkpoint.quantize import (
    affine_quantize,
    pack_bits,
    quantize_checkpoint,
    unpack_bits,
)
from engine.config import ModelConfig
from engine.family import end_tensor_shapes, layer_tensor_shapes
from tests.engine.conftest import stage_driver

# LayerWeights field -> the projection's path inside a layer.
PROJECTIONS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
               "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
               "down": "mlp.down_proj"}
# hidden 64 and intermediate 96 let group size 32 pack every projection, the embeddings and
# the head; head_dim 18 makes q and o 72 wide, so o_proj (input 72) stays dense at group 32.
# The seed is fixed so the measured figures below do not depend on which tests ran first.
SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=1, head_dim=18, seed=5)
GROUP = 32


def stage(model_dir: Path, backend: str, layers: tuple[int, int] | None = None,
          quant: str = "packed"):
    n_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    return load_stage(StageSpec(model_dir, layers or (0, n_layers), backend, 2, 256, 64,
                                quant=quant))


def all_tensors(model_dir: Path) -> dict:
    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        out |= mx.load(str(path))
    return out


def raw_bits(array) -> np.ndarray:
    """An MLX array's or a torch tensor's values as their unsigned bit patterns."""
    if isinstance(array, torch.Tensor):
        width = {4: torch.int32, 2: torch.int16}[array.element_size()]
        return array.contiguous().view(width).numpy().view(f"<u{array.element_size()}")
    return np.array(array.view({4: mx.uint32, 2: mx.uint16}[array.itemsize]))


@pytest.fixture(scope="session")
def quantized(make_model, tmp_path_factory):
    """(family, dtype, bits, shards) -> a checkpoint our writer quantized, made once."""
    made: dict[tuple, Path] = {}

    def make(family: str = "qwen3", dtype: str = "float32", bits: int = 4, shards: int = 1,
             **shape) -> Path:
        key = (family, dtype, bits, shards, tuple(sorted(shape.items())))
        if key not in made:
            source = make_model(family, dtype=dtype, shards=shards, **(shape or SHAPE))
            out = tmp_path_factory.mktemp(f"q{bits}-{family}-{dtype}") / "model"
            made[key] = quantize_checkpoint(source, out, bits, GROUP)
        return made[key]

    return make


# --- the writer ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("bits", AFFINE_BITS)
def test_numpy_quantizer_is_mx_quantize_bit_for_bit(dtype, bits):
    rng = np.random.default_rng(bits)
    w = rng.standard_normal((24, 256)).astype(np.float32) * 0.05
    w[0, :32] = 0.0  # a constant group: scale eps, bias 0
    w[1, 32:64] = 0.3  # a constant non-zero group
    w[2] = np.abs(w[2])  # groups whose larger edge is the maximum
    values = mx.array(w).astype(getattr(mx, dtype))
    for group_size in (32, 64, 128):
        want_w, want_s, want_b = mx.quantize(values, group_size=group_size, bits=bits)
        got_w, got_s, got_b = affine_quantize(np.array(values.astype(mx.float32)), group_size,
                                              bits)
        assert np.array_equal(got_w, np.array(want_w))
        # Scales and biases as the model dtype rounds them (MLX casts with round-to-nearest).
        cast = getattr(mx, dtype)
        assert np.array_equal(raw_bits(mx.array(got_s).astype(cast)), raw_bits(want_s))
        assert np.array_equal(raw_bits(mx.array(got_b).astype(cast)), raw_bits(want_b))
        codes = unpack_bits(got_w, bits)
        assert codes.max() < 2**bits and np.array_equal(pack_bits(codes, bits), got_w)


@pytest.mark.parametrize(("dtype", "bits", "shards"),
                         [("float32", 4, 1), ("bfloat16", 8, 3), ("float16", 3, 1)])
def test_our_checkpoint_is_byte_for_byte_mlx_lms(make_model, quantized, tmp_path, dtype, bits,
                                                 shards):
    source = make_model("qwen3", dtype=dtype, shards=shards, **SHAPE)
    theirs = tmp_path / "mlx-lm"
    convert(str(source), str(theirs), quantize=True, q_group_size=GROUP, q_bits=bits)
    ours_dir = quantized("qwen3", dtype, bits, shards)
    ours, want = all_tensors(ours_dir), all_tensors(theirs)
    assert sorted(ours) == sorted(want)
    assert "model.layers.0.self_attn.q_proj.scales" in ours  # packed
    assert "model.layers.0.self_attn.o_proj.scales" not in ours  # 72 wide: left dense
    for name, value in want.items():
        assert ours[name].dtype == value.dtype and ours[name].shape == value.shape, name
        assert np.array_equal(raw_bits(ours[name]), raw_bits(value)), name
    config, their_config = (json.loads((d / "config.json").read_text()) for d in (ours_dir, theirs))
    for key in ("quantization", "quantization_config"):
        assert config[key] == their_config[key] == {"group_size": GROUP, "bits": bits,
                                                    "mode": "affine"}
    # Shards keep their files, so a range still opens only the files its tensors live in.
    assert len(list(ours_dir.glob("*.safetensors"))) == shards


def test_our_quantized_checkpoint_gives_mlx_lms_logits(quantized):
    """The brief's check of meaning: our MLX stage and mlx-lm on our file, float32, 1e-4."""
    model_dir = quantized("qwen3", "float32", 4)
    model, _ = mlx_lm_utils.load(str(model_dir))
    ids = np.random.default_rng(5).integers(0, 300, 24).tolist()
    want = np.array(model(mx.array([ids]))[0].astype(mx.float32))  # [positions, vocab]
    driver = stage_driver(stage(model_dir, "mlx-cpu"))
    got = np.stack([driver.round({0: [token]})[0] for token in ids])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_the_writer_refuses_what_mlx_lm_cannot_pack(make_model, quantized, tmp_path):
    with pytest.raises(QuantConfigError, match="bits 7"):
        quantize_checkpoint(make_model("qwen3"), tmp_path / "a", 7, GROUP)
    with pytest.raises(QuantConfigError, match="group_size 48"):
        quantize_checkpoint(make_model("qwen3"), tmp_path / "b", 4, 48)
    with pytest.raises(reader.CheckpointError, match="already quantized"):
        quantize_checkpoint(quantized(), tmp_path / "c", 4, GROUP)


# --- PyTorch's dequantized load ----------------------------------------------------------

def packed_paths(model_dir: Path, layers: range, config: ModelConfig) -> dict[str, str]:
    """Dense weight name -> the torch stage attribute holding it, for the packed ones."""
    out = {}
    stored = all_tensors(model_dir)
    for layer in layers:
        for attr, path in PROJECTIONS.items():
            out[f"model.layers.{layer}.{path}.weight"] = f"{layer}.{attr}"
    out["model.embed_tokens.weight"] = "embed"
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = "head"
    return {name: attr for name, attr in out.items() if stored[name].dtype == mx.uint32}


def torch_tensor(torch_stage, attr: str) -> torch.Tensor:
    model = torch_stage.model
    if "." not in attr:
        return getattr(model, attr)
    layer, field = attr.split(".")
    return getattr(model.layers[int(layer) - model.layer_range[0]], field)


def assert_dequantized_like_mlx(model_dir: Path, layers: tuple[int, int]) -> int:
    """Every packed weight of the torch stage's range equals `mx.dequantize`, bit for bit."""
    raw = json.loads((model_dir / "config.json").read_text())
    config = ModelConfig.from_dict(raw)
    quant = raw["quantization"]
    torch_stage = stage(model_dir, "torch-cpu", layers, quant="dense")
    stored = all_tensors(model_dir)
    dtype = getattr(mx, config.dtype)
    packed = packed_paths(model_dir, range(*layers), config)
    if layers[0] != 0:
        packed = {n: a for n, a in packed.items() if n.startswith("model.layers.")}
    for name, attr in packed.items():
        path = name.removesuffix(".weight")
        entry = quant.get(path) or quant
        want = mx.dequantize(stored[name], stored[path + ".scales"].astype(dtype),
                             stored[path + ".biases"].astype(dtype),
                             group_size=entry["group_size"], bits=entry["bits"])
        got = torch_tensor(torch_stage, attr)
        assert got.dtype == {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.dtype]
        assert np.array_equal(raw_bits(got), raw_bits(want)), f"{name} differs from MLX's"
    return len(packed)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bits", [4, 8])
def test_dequantized_range_is_mx_dequantize_bit_for_bit(quantized, dtype, bits):
    model_dir = quantized("qwen3", dtype, bits)
    # 3 layers x 6 packed projections + embeddings + head; then a range without the ends.
    assert assert_dequantized_like_mlx(model_dir, (0, 3)) == 3 * 6 + 2
    assert assert_dequantized_like_mlx(model_dir, (1, 3)) == 2 * 6


def test_mlx_lm_mixed_recipe_dequantizes_like_mlx(make_model, tmp_path):
    """Per-path entries of 3 and 6 bits (mlx-lm's mixed_3_6 recipe) on bfloat16."""
    out = tmp_path / "mixed"
    convert(str(make_model("qwen3", dtype="bfloat16", **SHAPE)), str(out), quantize=True,
            q_group_size=GROUP, q_bits=4, quant_predicate="mixed_3_6")
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert {v["bits"] for v in quant.values() if isinstance(v, dict)} >= {3, 6}
    assert assert_dequantized_like_mlx(out, (0, 3)) == 3 * 6 + 2


def test_per_path_override_and_false_entries(quantized, make_model, tmp_path):
    """A per-path dict (8 bits, group 64) and a `false` entry (left dense), as MLX reads them."""
    source = make_model("qwen3", **SHAPE)
    model_dir = tmp_path / "model"
    shutil.copytree(quantized("qwen3", "float32", 4), model_dir)
    tensors = {k: np.array(v) for k, v in all_tensors(model_dir).items()}
    dense = {k: np.array(v) for k, v in all_tensors(source).items()}
    override, left_dense = "model.layers.1.mlp.up_proj", "model.layers.2.self_attn.k_proj"
    tensors[override + ".weight"], tensors[override + ".scales"], tensors[override + ".biases"] = \
        affine_quantize(dense[override + ".weight"], 64, 8)
    for part in (".scales", ".biases"):
        del tensors[left_dense + part]
    tensors[left_dense + ".weight"] = dense[left_dense + ".weight"]
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "mlx"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization"] |= {override: {"group_size": 64, "bits": 8}, left_dense: False}
    config["quantization_config"] = config["quantization"]
    (model_dir / "config.json").write_text(json.dumps(config))

    assert assert_dequantized_like_mlx(model_dir, (0, 3)) == 3 * 6 + 2 - 1
    torch_stage, mlx_stage = stage(model_dir, "torch-cpu", quant="dense"), stage(model_dir,
                                                                                 "mlx-cpu")
    assert np.array_equal(torch_tensor(torch_stage, "2.k").numpy(), dense[left_dense + ".weight"])
    assert type(mlx_stage.model.layers[2].k).__name__ == "array"  # MLX also left it dense
    assert mlx_stage.model.layers[1].up.bits == 8


# Float32: the weights are the same bits on both backends (above), so only the matmuls'
# accumulation order differs (MLX's quantized_matmul sums per group in float32 SIMD lanes,
# torch's BLAS in its own blocking): the same 1e-4 the dense float32 comparison allows,
# against logits of magnitude ~5 (measured: about 4e-6).
# Bfloat16: MLX's quantized_matmul forms each weight in float32 and never rounds it to
# bfloat16, where torch holds bfloat16 weights, and bfloat16 keeps 8 significant bits
# (logits of ~4 step by 1/32), so the two drift by rounding, not by a fault; bounded by
# mean KL 1e-2 and max |diff| 1.0 (measured: about 5e-4 and 0.16; top-1 94-97 %).
# Packed (PyTorch's int4 kernels) adds one rounding to the weights, zero = bias + 8 * scale
# in the model dtype: in float32 an ulp, inside the same bounds (measured 4e-6 at 4 bits,
# 1e-5 at 8, whose two int4 passes add their outputs).
@pytest.mark.parametrize("quant", ["packed", "dense"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bits", [4, 8])
def test_torch_stage_on_a_quantized_checkpoint_is_close_to_mlx(quantized, dtype, bits, quant):
    model_dir = quantized("qwen3", dtype, bits)
    ids = np.random.default_rng(bits).integers(0, 300, 48).tolist()
    logits = []
    for backend in ("torch-cpu", "mlx-cpu"):
        driver = stage_driver(stage(model_dir, backend, quant=quant))
        prompt = driver.round({0: ids[:16]})[0]  # a 16-row chunk, then decode rows
        logits.append(np.stack([prompt] + [driver.round({0: [t]})[0] for t in ids[16:]]))
    got, want = logits
    diff = np.abs(got - want).max()
    if dtype == "float32":
        assert diff < 1e-4
        assert (got.argmax(-1) == want.argmax(-1)).all()
    else:
        p = torch.softmax(torch.from_numpy(want).double(), -1)
        kl = (p * (p.log() - torch.log_softmax(torch.from_numpy(got).double(), -1))).sum(-1)
        assert diff < 1.0 and kl.mean() < 1e-2, (diff, kl.mean())


def test_a_quantized_range_reads_only_its_tensors(quantized, monkeypatch):
    model_dir = quantized("qwen3", "float32", 4, shards=3)
    config = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    read: list[str] = []
    real = reader.Checkpoint.load_tensors

    def spy(self, names, framework="pt", device=None):
        read.extend(names)
        return real(self, names, framework, device)

    monkeypatch.setattr(reader.Checkpoint, "load_tensors", spy)
    stored = set(all_tensors(model_dir))
    for layers in [(0, 1), (1, 3)]:
        read.clear()
        stage(model_dir, "torch-cpu", layers)
        want = [n for layer in range(*layers) for n in layer_tensor_shapes(config, layer)]
        if layers[0] == 0:
            want += list(end_tensor_shapes(config))
        expanded = [f"{n.removesuffix('.weight')}{part}" for n in want
                    for part in (".weight", ".scales", ".biases")
                    if f"{n.removesuffix('.weight')}{part}" in stored]
        assert sorted(read) == sorted(set(expanded) | set(want))


@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4"])
def test_a_non_affine_mode_is_refused_by_name(quantized, tmp_path, mode):
    model_dir = tmp_path / "model"
    shutil.copytree(quantized(), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization"] = config["quantization_config"] = {"group_size": 32, "bits": 4,
                                                              "mode": mode}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(BackendError, match=mode):
        stage(model_dir, "torch-cpu")

"""Placement's byte estimate of a stage is exactly what the stage loads, for every family.

A checkpoint made by the repo's maker, one range loaded by a real torch-cpu and mlx-cpu
stage: the weight bytes the stage holds (counted tensor by tensor, a tied table once) must
equal `supervisor.memory`'s charge for that range, and its KV and recurrent state the
charge for state, whole windows or a pool of pages. Also the checkpoint's own bytes, layer by layer, from its safetensors
headers: what the memory model charges per layer is what is on disk for it. The families:
dense with and without a tied head, every dense model type, the Qwen3.5 hybrid in both
layouts, odd shapes, and mlx-lm 4-bit checkpoints of both kinds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from pathlib import Path

import pytest

from engine.backends.base import StageSpec, load_stage
from engine.checkpoint.maker import CheckpointSpec, make_checkpoint
from engine.checkpoint.quantize import quantize_checkpoint
from engine.config import ConfigError, ModelConfig
from engine.family import end_tensor_shapes, layer_tensor_shapes
from engine.row_format import RowFormat
from supervisor.memory import ExecutionShape, ShapeError, model_shape_from_config, stage_memory
from tests.requirements import require

# A context the PyTorch KV cache holds as it is (it aligns a slot's positions up to 64).
EXECUTION = ExecutionShape(context=64, parallel=3, chunk=16)
# Odd shapes: head_dim unrelated to hidden / heads, GQA 5:1, widths no power of two.
ODD = dict(hidden_size=40, intermediate_size=70, num_attention_heads=5, num_key_value_heads=1,
           head_dim=14, vocab_size=301, num_hidden_layers=3)
HYBRID = dict(family="qwen3_5", hidden_size=32, intermediate_size=72, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_hidden_layers=4, vocab_size=300,
              full_attention_interval=2, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=12)
CASES = {
    "llama-untied": dict(family="llama", num_hidden_layers=3, vocab_size=300),
    "llama-tied-bf16": dict(family="llama", num_hidden_layers=3, vocab_size=300,
                            tie_word_embeddings=True, dtype="bfloat16"),
    "mistral-odd": dict(family="mistral", sliding_window=9, **ODD),
    "qwen2-odd-tied": dict(family="qwen2", tie_word_embeddings=True, **ODD),
    "qwen3-odd": dict(family="qwen3", **ODD),
    "qwen3_5-untied": dict(HYBRID),
    "qwen3_5-multimodal-tied-bf16": dict(HYBRID, multimodal=True, tie_word_embeddings=True,
                                         dtype="bfloat16"),
}
BACKENDS = ("torch-cpu", "mlx-cpu")


def needs_backend(backend: str) -> None:
    if backend.startswith("mlx-"):
        require("mlx.core")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    out: dict[str, Path] = {}

    def make(case: str) -> Path:
        if case not in out:
            quantized = case.endswith("-4bit")
            fields = CASES[case.removesuffix("-4bit")]
            path = make_checkpoint(tmp_path_factory.mktemp(case), CheckpointSpec(seed=3, **fields))
            out[case] = (quantize_checkpoint(path, tmp_path_factory.mktemp(case + "-q"), 4, 32)
                         if quantized else path)
        return out[case]

    return make


def charged(model_dir: Path, backend: str, layers: tuple[int, int],
            execution: ExecutionShape = EXECUTION):
    raw = json.loads((model_dir / "config.json").read_text())
    dtype_bytes = RowFormat.of(ModelConfig.from_dict(raw)).itemsize
    shape = model_shape_from_config(raw, dtype_bytes, (backend,))
    return stage_memory(shape, execution, layers, layers[0] == 0)


def ranges(n_layers: int) -> list[tuple[int, int]]:
    """The whole model (rank 0 with every layer), a first and a last stage, one middle layer."""
    cut = n_layers // 2
    return [(0, n_layers), (0, cut), (cut, n_layers), (1, 2)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", [*CASES, "qwen3-odd-4bit", "qwen3_5-untied-4bit"])
def test_a_stage_loads_exactly_the_bytes_placement_charges(made, case, backend):
    needs_backend(backend)
    model_dir = made(case)
    raw = json.loads((model_dir / "config.json").read_text())
    n_layers = ModelConfig.from_dict(raw).num_hidden_layers  # nested in the multimodal layout
    for layers in ranges(n_layers):
        stage = load_stage(StageSpec(model_dir, layers, backend, EXECUTION.parallel,
                                     EXECUTION.context, EXECUTION.chunk))
        memory = charged(model_dir, backend, layers)
        assert stage.weights_nbytes == memory.weights_bytes + memory.rank0_extras_bytes, layers
        assert stage.state_nbytes == memory.kv_bytes + memory.state_bytes, layers


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["llama-untied", "qwen3-odd", "qwen3_5-untied"])
def test_a_stage_in_a_pool_of_pages_holds_what_placement_charges(made, case, backend):
    """FLEET_KV_PAGES: a stage's KV is its pool (2 pages here, fewer than its three slots'
    whole windows), its recurrent states still one a slot, on either backend."""
    needs_backend(backend)
    model_dir = made(case)
    pooled = dataclasses.replace(EXECUTION, kv_pages=2)
    n_layers = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text())
                                     ).num_hidden_layers
    for layers in ranges(n_layers):
        stage = load_stage(StageSpec(model_dir, layers, backend, pooled.slots,
                                     pooled.context, pooled.chunk, kv_pages=pooled.kv_pages))
        memory = charged(model_dir, backend, layers, pooled)
        assert stage.state_nbytes == memory.kv_bytes + memory.state_bytes, layers
        assert memory.kv_bytes < charged(model_dir, backend, layers).kv_bytes \
            or memory.kv_bytes == 0, layers  # a DeltaNet-only range holds no KV


def safetensors_sizes(model_dir: Path) -> dict[str, int]:
    """Every tensor's bytes on disk, from the safetensors headers alone."""
    sizes = {}
    for path in model_dir.glob("*.safetensors"):
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        sizes.update({name: end - start for name, entry in header.items()
                      if name != "__metadata__" for start, end in [entry["data_offsets"]]})
    return sizes


@pytest.mark.parametrize("case", list(CASES))
def test_each_layer_is_charged_the_bytes_the_checkpoint_holds_for_it(made, case):
    model_dir = made(case)
    raw = json.loads((model_dir / "config.json").read_text())
    config = ModelConfig.from_dict(raw)
    on_disk = safetensors_sizes(model_dir)
    shape = model_shape_from_config(raw, RowFormat.of(config).itemsize)
    for layer in range(config.num_hidden_layers):
        names = layer_tensor_shapes(config, layer)
        assert shape.layers[layer].weight_bytes == sum(on_disk[n] for n in names), layer
    ends = {n: on_disk[n] for n in end_tensor_shapes(config)}
    assert shape.embedding_bytes + shape.final_norm_bytes + shape.head_bytes == sum(ends.values())
    # Nothing of the text model is left uncharged: every other tensor is the vision tower's
    # or the MTP head's, which a text stage never reads.
    layer_names = {n for i in range(config.num_hidden_layers)
                   for n in layer_tensor_shapes(config, i)}
    rest = set(on_disk) - layer_names - set(ends)
    assert all(n.startswith(("model.visual.", "mtp.")) for n in rest), sorted(rest)[:5]


@pytest.mark.parametrize("flags", [dict(mlp_bias=True), dict(attention_bias=True)])
def test_biases_no_backend_applies_are_refused_not_charged(made, flags):
    """transformers' Llama biases its MLP with mlp_bias and o_proj with attention_bias; no
    backend applies those, so such a model is refused, by the engine and by placement."""
    raw = json.loads((made("llama-untied") / "config.json").read_text()) | flags
    with pytest.raises(ConfigError, match="not supported"):
        ModelConfig.from_dict(raw)
    with pytest.raises(ShapeError, match="not supported"):
        model_shape_from_config(raw, 4)


def test_qwen2_attention_bias_is_charged_and_loaded_without_an_o_proj_bias(made):
    """Qwen2's q/k/v biases are charged (and loaded); o_proj has none, whatever the flag."""
    raw = json.loads((made("qwen2-odd-tied") / "config.json").read_text())
    config = ModelConfig.from_dict(raw)
    names = layer_tensor_shapes(config, 0)
    assert {n.rsplit(".", 2)[-2] for n in names if n.endswith(".bias")} == \
        {"q_proj", "k_proj", "v_proj"}
    assert model_shape_from_config(raw, 4).layers[0].weight_bytes == \
        4 * sum(math.prod(shape) for shape in names.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank0s_draft_head_is_charged_the_bytes_it_holds(tmp_path, backend):
    """`drafter: mtp`: rank 0 loads the checkpoint's MTP head (weights, and its KV for every
    slot) and placement charges exactly that there, and nothing on another stage."""
    needs_backend(backend)
    model_dir = make_checkpoint(tmp_path / "mtp", CheckpointSpec(**HYBRID, mtp=True))
    raw = json.loads((model_dir / "config.json").read_text())
    shape = model_shape_from_config(raw, 4, drafting=True, draft_head=True)
    stage = load_stage(StageSpec(model_dir, (0, 2), backend, EXECUTION.slots, EXECUTION.context,
                                 EXECUTION.chunk, drafting=True, draft_head=True))
    charged = stage_memory(shape, EXECUTION, (0, 2), is_rank0=True)
    assert stage.draft_head.nbytes == charged.draft_head_bytes > 0
    assert stage_memory(shape, EXECUTION, (2, 4), is_rank0=False).draft_head_bytes == 0
    plain = model_shape_from_config(raw, 4, drafting=True)
    assert (stage_memory(shape, EXECUTION, (0, 2), is_rank0=True).total_bytes
            - stage_memory(plain, EXECUTION, (0, 2), is_rank0=True).total_bytes
            == charged.draft_head_bytes)

"""A stage holds only its own layers (plus the ends on rank 0), read from any shard layout."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.backends.base import BackendError, StageSpec, load_stage
from engine.checkpoint.reader import CheckpointError, open_checkpoint

ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2}


def held_bytes(stage) -> dict[str, int]:
    """Bytes of every weight tensor the stage keeps, by owner."""
    model = stage.model
    layers = sum(t.nbytes for w in model.layers for t in dataclasses.astuple(w)
                 if isinstance(t, torch.Tensor))
    ends = {id(t): t.nbytes for t in (model.embed, model.norm, model.head) if t is not None}
    return {"layers": layers, "ends": sum(ends.values())}


def checkpoint_bytes(model_dir, names) -> int:
    ckpt = open_checkpoint(model_dir)
    total = 0
    for name in names:
        count = 1
        for dim in ckpt.tensor_shape(name):
            count *= dim
        total += count * ITEMSIZE[ckpt.tensor_dtype(name)]
    return total


@pytest.mark.parametrize("layers", [(0, 2), (1, 3), (3, 5)])
def test_a_stage_holds_only_its_range(make_model, layers):
    model_dir = make_model("qwen3", num_hidden_layers=5, shards=3)
    stage = load_stage(StageSpec(model_dir, layers, "torch-cpu", 2, 64, 16))
    ckpt = open_checkpoint(model_dir)
    own = [n for layer in range(*layers) for n in ckpt.layer_tensor_names(layer)]
    held = held_bytes(stage)
    assert held["layers"] == checkpoint_bytes(model_dir, own)
    assert len(stage.model.layers) == layers[1] - layers[0]
    if layers[0] == 0:  # rank 0 also holds embeddings, final norm and head
        ends = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        assert held["ends"] == checkpoint_bytes(model_dir, ends)
    else:
        assert held["ends"] == 0


def test_a_range_outside_the_model_is_refused(make_model):
    model_dir = make_model("qwen3", num_hidden_layers=5)
    with pytest.raises(BackendError, match="outside the model's 5 layers"):
        load_stage(StageSpec(model_dir, (3, 7), "torch-cpu", 2, 64, 16))


def test_a_damaged_checkpoint_names_the_file_and_tensor(make_model, tmp_path):
    import shutil

    source = make_model("llama", num_hidden_layers=2)
    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_stage(StageSpec(broken, (0, 2), "torch-cpu", 2, 64, 16))


def test_a_shape_that_disagrees_with_config_names_the_tensor(make_model, tmp_path):
    import json
    import shutil

    source = make_model("llama", num_hidden_layers=2)
    odd = tmp_path / "odd"
    shutil.copytree(source, odd)
    config = json.loads((odd / "config.json").read_text())
    config["intermediate_size"] += 4
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"mlp\.gate_proj\.weight has shape"):
        load_stage(StageSpec(odd, (0, 2), "torch-cpu", 2, 64, 16))

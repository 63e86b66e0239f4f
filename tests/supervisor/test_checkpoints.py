"""The supervisor reads a checkpoint's shape with the engine's dtype rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.checkpoint.maker import PRESETS, config_json
from supervisor.checkpoints import read_shape
from supervisor.fleet_config import CheckpointPaths, ModelSpec
from supervisor.memory import model_shape_from_config


def spec_for(directory: Path) -> ModelSpec:
    return ModelSpec("m", CheckpointPaths(all_nodes=str(directory)), ("torch-cpu",), 256)


@pytest.mark.parametrize(("keys", "dtype_bytes"), [
    ({"dtype": "float32"}, 4),  # transformers 5 writes only `dtype`
    ({"torch_dtype": "bfloat16"}, 2),
    ({"dtype": "float16", "torch_dtype": "float16"}, 2),
    ({}, 4),  # no dtype at all: the engine loads float32
])
def test_weights_are_counted_in_the_dtype_the_engine_loads(tmp_path: Path, keys: dict,
                                                           dtype_bytes: int) -> None:
    raw = {k: v for k, v in config_json(PRESETS["tiny"]).items()
           if k not in ("dtype", "torch_dtype")} | keys
    (tmp_path / "config.json").write_text(json.dumps(raw))
    shape = read_shape(spec_for(tmp_path))
    assert not isinstance(shape, str), shape
    assert shape == model_shape_from_config(raw, dtype_bytes)


def test_a_dtype_the_engine_cannot_load_is_named(tmp_path: Path) -> None:
    raw = config_json(PRESETS["tiny"]) | {"dtype": "int8", "torch_dtype": "int8"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    reason = read_shape(spec_for(tmp_path))
    assert isinstance(reason, str) and "int8" in reason and "config.json" in reason


def test_drafting_with_an_mtp_head_a_checkpoint_lacks_is_named(tmp_path: Path) -> None:
    from dataclasses import replace

    from engine.checkpoint.maker import CheckpointSpec

    (tmp_path / "config.json").write_text(json.dumps(config_json(PRESETS["tiny"])))
    reason = read_shape(replace(spec_for(tmp_path), drafter="mtp"))
    assert isinstance(reason, str) and "mtp_num_hidden_layers is 0" in reason
    hybrid = config_json(CheckpointSpec(family="qwen3_5", mtp=True))
    (tmp_path / "config.json").write_text(json.dumps(hybrid))
    shape = read_shape(replace(spec_for(tmp_path), drafter="mtp"))
    assert not isinstance(shape, str) and shape.draft_head_weight_bytes > 0

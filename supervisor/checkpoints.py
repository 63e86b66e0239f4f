"""A model's shape, read from its checkpoint's config.json where the supervisor can read it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.backend_names import HEAD_DRAFTERS, drafts
from engine.config import ConfigError, ModelConfig
from engine.row_format import RowFormat
from supervisor.fleet_config import ModelSpec
from supervisor.memory import ModelShape, ShapeError, model_shape_from_config


def read_shape(spec: ModelSpec) -> ModelShape | str:
    """The model's shape from its checkpoint's config.json, read where the supervisor can."""
    found = read_config(spec)
    return found if isinstance(found, str) else found[1]


def read_config(spec: ModelSpec) -> tuple[dict[str, Any], ModelShape] | str:
    """The checkpoint's config.json and the shape it gives, or why there is none."""
    paths = [spec.checkpoint.all_nodes] if spec.checkpoint.all_nodes else []
    paths += [p for _, p in spec.checkpoint.by_node]
    for path in dict.fromkeys(paths):
        config_path = Path(path) / "config.json"
        try:
            raw = json.loads(config_path.read_text())
        except (OSError, ValueError):
            continue
        try:
            # The dtype the engine will load (`dtype` as transformers 5 writes it, or
            # `torch_dtype`), by the engine's own rule, so a float32 checkpoint counts 4 bytes;
            # a quantized one's packed weights as the model's backends will hold them.
            config = ModelConfig.from_dict(raw)
            dtype_bytes = RowFormat.of(config).itemsize
            if spec.drafter in HEAD_DRAFTERS and not config.family.draft_head_tensors(config):
                # Said here, at apply, not by rank 0 failing to load after placement.
                return (f"{config_path}: drafter: {spec.drafter} drafts with the checkpoint's "
                        f"MTP head, and this one has none (mtp_num_hidden_layers is "
                        f"{config.mtp_num_hidden_layers}, model_type {config.model_type})")
            # A drafting hybrid's stages keep a recurrent state per verify row too.
            return raw, model_shape_from_config(raw, dtype_bytes, spec.backends,
                                                drafting=drafts(spec.drafter),
                                                draft_head=spec.drafter in HEAD_DRAFTERS)
        except (ShapeError, ConfigError, TypeError) as exc:
            return f"{config_path}: {exc}"
    return (f"no checkpoint path of {spec.id} has a readable config.json on the supervisor's "
            f"machine ({', '.join(dict.fromkeys(paths))})")

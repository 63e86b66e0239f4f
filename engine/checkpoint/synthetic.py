"""A checkpoint of random weights holding one layer range only: what calibration loads.

Calibration times a real stage (the same classes, CUDA graphs, compiled step and packed
kernels that serve), and a stage loads from a checkpoint; this writes the smallest one
that stage can load: the range's layers of a family shape, neither the first layer nor the
last (so no embeddings, final norm or head), in Hugging Face's safetensors layout; or, for
timing rank 0's head, a first range with the embeddings, final norm and head. A
quantized shape's weights are stored packed as mlx-lm packs them (its rule for which
weights pack), so the stage holds and runs them as it would a real 4-bit checkpoint.

Values are N(0, std) (norm weights 1) drawn from one small block repeated: a kernel's time
does not depend on the values, and drawing a 27B layer's hundreds of millions afresh would
cost more than timing it. Dense tensors are stored as float16 whatever the model's dtype
(numpy has no bfloat16; a stage casts to its own dtype as it loads), half float32's bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from engine.checkpoint.quant_config import QuantConfig, packed_params
from engine.checkpoint.quantize import affine_quantize
from engine.checkpoint.reader import Checkpoint
from engine.config import ModelConfig
from engine.family import end_tensor_shapes, layer_tensor_shapes

FILE_NAME = "model.safetensors"
_BLOCK_VALUES = 1 << 20  # the repeated block of random values


def write_range(out_dir: Path, raw_config: dict[str, Any], layer_range: tuple[int, int],
                std: float = 0.02, seed: int = 0, *, ends: bool = False) -> Checkpoint:
    """Write layers [start, end) of `raw_config`'s family shape into `out_dir` (created);
    with `ends`, a range from layer 0 and rank 0's embeddings, final norm and head with it
    (what the timer of rank 0's head loads)."""
    config = ModelConfig.from_dict(raw_config)
    start, end = layer_range
    if ends and not 0 == start < end <= config.num_hidden_layers:
        raise ValueError(f"layer range {start}:{end}: with the embeddings and head it must "
                         f"start at layer 0 and end within {config.num_hidden_layers} layers")
    if not ends and not 0 < start < end < config.num_hidden_layers:
        raise ValueError(f"layer range {start}:{end} must lie strictly inside the model's "
                         f"{config.num_hidden_layers} layers (no embeddings, no head)")
    quant = QuantConfig.from_config(raw_config)
    block = np.random.default_rng(seed).standard_normal(_BLOCK_VALUES, dtype=np.float32)
    block *= np.float32(std)
    tensors: dict[str, np.ndarray] = {}
    shapes = [layer_tensor_shapes(config, layer) for layer in range(start, end)]
    for names in [*shapes, end_tensor_shapes(config) if ends else {}]:
        for name, shape in names.items():
            values = (np.ones(shape, np.float32) if name.endswith("norm.weight")
                      else np.resize(block, shape))
            params = packed_params(quant, name, shape)
            if params is None:
                tensors[name] = values.astype(np.float16)
                continue
            words, scales, biases = affine_quantize(values, params.group_size, params.bits)
            path = name.removesuffix(".weight")
            tensors[name] = words
            tensors[path + ".scales"] = scales.astype(np.float16)
            tensors[path + ".biases"] = biases.astype(np.float16)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / FILE_NAME), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(raw_config, indent=1))
    return Checkpoint(out_dir, raw_config, {name: FILE_NAME for name in tensors})

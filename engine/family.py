"""A layer range's weights, for any backend: the family's tensors by name, loaded and grouped.

Which tensors a layer holds, and their shapes, is the family's description's to say
(`engine.families`): the Llama-style layers are all alike; the Qwen3.5 hybrid has two kinds
(Gated DeltaNet and gated full attention), so names and shapes are decided per layer by its
kind. A range reads only its own layers' tensors (never a vision tower's or an MTP head's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from engine.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from engine.families import tensor_name

W = TypeVar("W")  # a backend's weight: a torch.Tensor, an mx.array, a packed MLX weight


def layer_tensor_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape that config.json implies, for one decoder layer."""
    return {tensor_name(config, t, layer): t.shape
            for t in config.family.layer_tensors(config, layer)}


def end_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Embeddings, final norm and (untied) head: what rank 0 holds besides its layers."""
    return {tensor_name(config, t): t.shape for t in config.family.end_tensors(config)}


def _by_field(config: ModelConfig, tensors: dict[str, W], layer: int) -> dict[str, W]:
    """A layer's loaded tensors by their weights' field."""
    return {t.field: tensors[tensor_name(config, t, layer)]
            for t in config.family.layer_tensors(config, layer)}


@dataclass
class LayerWeights(Generic[W]):
    """One decoder layer's weights, named for what they are, in a backend's weight type."""

    input_norm: W
    # Projections may be packed (mlx-lm's affine quantization); norms never are. q, k, v,
    # gate and up are None where a backend stacked them (qkv, gate_up below).
    q: W | None
    k: W | None
    v: W | None
    o: W
    post_norm: W
    gate: W | None
    up: W | None
    down: W
    q_bias: W | None = None
    k_bias: W | None = None
    v_bias: W | None = None
    q_norm: W | None = None
    k_norm: W | None = None
    # q, k and v (and their biases), and gate and up, stacked by output into one weight each
    # by a backend that runs them as one matmul (engine/backends/pytorch/stacked.py).
    qkv: W | None = None
    qkv_bias: W | None = None
    gate_up: W | None = None


@dataclass
class DeltaNetWeights(Generic[W]):
    """One Gated DeltaNet layer's weights (the hybrid's linear-attention layer type)."""

    input_norm: W
    # The four projections of the layer's input are None where a backend stacked them
    # (inputs, below), as are gate and up (gate_up).
    qkv: W | None  # [2 x key width + value width, hidden]: q, k and v in one projection
    z: W | None  # [value width, hidden]: the output gate of the gated RMSNorm
    b: W | None  # [value heads, hidden]: the write strength, through a sigmoid
    a: W | None  # [value heads, hidden]: the decay's input, with dt_bias and A_log
    conv: W  # [conv width, 1, kernel]: depthwise causal convolution
    dt_bias: W
    a_log: W
    norm: W  # [value head dim]: the gated RMSNorm's weight (plain, not 1 + w)
    out: W
    post_norm: W
    gate: W | None
    up: W | None
    down: W
    # qkv, z, b and a, and gate and up, stacked by output into one weight each by a backend
    # that runs them as one matmul (engine/backends/pytorch/stacked.py).
    inputs: W | None = None
    gate_up: W | None = None


# Each layer kind's weights type, by config.json's layer type name.
WEIGHTS: dict[str, type] = {FULL_ATTENTION: LayerWeights, LINEAR_ATTENTION: DeltaNetWeights}


def layer_weights(config: ModelConfig, tensors: dict[str, W],
                  layer: int) -> LayerWeights[W] | DeltaNetWeights[W]:
    """A loaded layer's tensors as the weights of its kind, by the fields the family's
    description names them by."""
    return WEIGHTS[config.layer_type(layer)](**_by_field(config, tensors, layer))


def load_range(config: ModelConfig, layer_range: tuple[int, int],
               load: Callable[[dict[str, tuple[int, ...]]], dict[str, W]],
               on_layer: Callable[[int], None] | None = None,
               ) -> tuple[list[LayerWeights[W] | DeltaNetWeights[W]], tuple]:
    """A range's weights, layer by layer, through a backend's `load`.

    Returns the layers and (embeddings, final norm, head), which only the range starting at
    layer 0 holds (all None elsewhere); a tied head is the embedding table itself.
    """
    start, end = layer_range
    layers = []
    for layer in range(start, end):
        layers.append(layer_weights(config, load(layer_tensor_shapes(config, layer)), layer))
        if on_layer:
            on_layer(layer)
    if start != 0:
        return layers, (None, None, None)
    loaded = load(end_tensor_shapes(config))
    ends = {t.field: loaded[tensor_name(config, t)] for t in config.family.end_tensors(config)}
    return layers, (ends["embed"], ends["norm"], ends.get("head", ends["embed"]))


@dataclass
class DraftHeadWeights(Generic[W]):
    """A checkpoint's draft head (Qwen3.5's MTP head): the fc over [embedding; hidden], its
    two input norms, its decoder layers (full attention) and its output norm."""

    fc: W  # [hidden, 2 x hidden]
    embed_norm: W
    hidden_norm: W
    layers: list[LayerWeights[W]]
    norm: W


def load_draft_head(config: ModelConfig,
                    load: Callable[[dict[str, tuple[int, ...]]], dict[str, W]],
                    ) -> DraftHeadWeights[W]:
    """The draft head's weights through a backend's `load`; a CheckpointError from `load`
    names a missing tensor, and a ValueError says the family or config has no head."""
    tensors = config.family.draft_head_tensors(config)
    if not tensors:
        raise ValueError(f"{config.model_type} checkpoint has no draft head "
                         f"(config.json: mtp_num_hidden_layers is {config.mtp_num_hidden_layers})")
    loaded = load({t.name: t.shape for t in tensors})
    by_field = {t.field: loaded[t.name] for t in tensors}
    layers = []
    for layer in range(config.mtp_num_hidden_layers):
        prefix = f"layer{layer}."
        layers.append(LayerWeights(**{f[len(prefix):]: w for f, w in by_field.items()
                                      if f.startswith(prefix)}))
    return DraftHeadWeights(by_field["fc"], by_field["embed_norm"], by_field["hidden_norm"],
                            layers, by_field["norm"])

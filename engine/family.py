"""The Llama-style family's tensors, for any backend: names, shapes, a layer's weights, loading."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from engine.config import ModelConfig

W = TypeVar("W")  # a backend's weight: a torch.Tensor, an mx.array, a packed MLX weight


def layer_tensor_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape that config.json implies, for one decoder layer."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    p = f"model.layers.{layer}."
    shapes = {
        p + "input_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (config.q_width, h),
        p + "self_attn.k_proj.weight": (config.kv_width, h),
        p + "self_attn.v_proj.weight": (config.kv_width, h),
        p + "self_attn.o_proj.weight": (h, config.q_width),
        p + "post_attention_layernorm.weight": (h,),
        p + "mlp.gate_proj.weight": (i, h),
        p + "mlp.up_proj.weight": (i, h),
        p + "mlp.down_proj.weight": (h, i),
    }
    if config.attention_bias:
        shapes[p + "self_attn.q_proj.bias"] = (config.q_width,)
        shapes[p + "self_attn.k_proj.bias"] = (config.kv_width,)
        shapes[p + "self_attn.v_proj.bias"] = (config.kv_width,)
    if config.qk_norm:
        shapes[p + "self_attn.q_norm.weight"] = (d,)
        shapes[p + "self_attn.k_norm.weight"] = (d,)
    return shapes


def end_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Embeddings, final norm and (untied) head: what rank 0 holds besides its layers."""
    shapes = {
        "model.embed_tokens.weight": (config.vocab_size, config.hidden_size),
        "model.norm.weight": (config.hidden_size,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    return shapes


# A decoder layer's weights by their LayerWeights field.
LAYER_FIELDS = {
    "input_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "post_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
}
OPTIONAL_LAYER_FIELDS = {  # Qwen2's biases, Qwen3's q/k norms
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
}


@dataclass
class LayerWeights(Generic[W]):
    """One decoder layer's weights, named for what they are, in a backend's weight type."""

    input_norm: W
    q: W  # projections may be packed (mlx-lm's affine quantization); norms never are
    k: W
    v: W
    o: W
    post_norm: W
    gate: W
    up: W
    down: W
    q_bias: W | None = None
    k_bias: W | None = None
    v_bias: W | None = None
    q_norm: W | None = None
    k_norm: W | None = None

    @classmethod
    def of_layer(cls, tensors: dict[str, W], layer: int) -> LayerWeights[W]:
        """A layer's loaded tensors by field (absent optional ones are None)."""
        p = f"model.layers.{layer}."
        fields = {f: tensors[p + name] for f, name in LAYER_FIELDS.items()}
        fields.update({f: tensors.get(p + name) for f, name in OPTIONAL_LAYER_FIELDS.items()})
        return cls(**fields)


def load_range(config: ModelConfig, layer_range: tuple[int, int],
               load: Callable[[dict[str, tuple[int, ...]]], dict[str, W]],
               on_layer: Callable[[int], None] | None = None,
               ) -> tuple[list[LayerWeights[W]], tuple]:
    """A range's weights, layer by layer, through a backend's `load`.

    Returns the layers and (embeddings, final norm, head), which only the range starting at
    layer 0 holds (all None elsewhere); a tied head is the embedding table itself.
    """
    start, end = layer_range
    layers = []
    for layer in range(start, end):
        layers.append(LayerWeights.of_layer(load(layer_tensor_shapes(config, layer)), layer))
        if on_layer:
            on_layer(layer)
    if start != 0:
        return layers, (None, None, None)
    ends = load(end_tensor_shapes(config))
    embed = ends["model.embed_tokens.weight"]
    return layers, (embed, ends["model.norm.weight"], ends.get("lm_head.weight", embed))

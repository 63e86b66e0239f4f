"""The families' tensors, for any backend: names, shapes, a layer's weights, loading.

Llama-style layers are all alike; the Qwen3.5 hybrid has two layer types (Gated DeltaNet and
gated full attention), so names and shapes are decided per layer by its type. A range reads
only its own layers' tensors (never a vision tower's or an MTP head's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from engine.config import LINEAR_ATTENTION, ModelConfig

W = TypeVar("W")  # a backend's weight: a torch.Tensor, an mx.array, a packed MLX weight


def layer_tensor_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape that config.json implies, for one decoder layer."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    p = layer_prefix(config, layer)
    if config.layer_type(layer) == LINEAR_ATTENTION:
        return _deltanet_tensor_shapes(config, p)
    # A gated attention's q_proj yields each head's query and then its gate: twice the width.
    q_out = 2 * config.q_width if config.attn_output_gate else config.q_width
    shapes = {
        p + "input_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (q_out, h),
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


def layer_prefix(config: ModelConfig, layer: int) -> str:
    return f"{config.weight_prefix}layers.{layer}."


def _deltanet_tensor_shapes(config: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    h, i = config.hidden_size, config.intermediate_size
    heads, conv = config.linear_num_value_heads, config.linear_conv_width
    a = p + "linear_attn."
    return {
        p + "input_layernorm.weight": (h,),
        a + "in_proj_qkv.weight": (conv, h),
        a + "in_proj_z.weight": (config.linear_value_width, h),
        a + "in_proj_b.weight": (heads, h),
        a + "in_proj_a.weight": (heads, h),
        a + "conv1d.weight": (conv, 1, config.linear_conv_kernel_dim),
        a + "dt_bias": (heads,),
        a + "A_log": (heads,),
        a + "norm.weight": (config.linear_value_head_dim,),
        a + "out_proj.weight": (h, config.linear_value_width),
        p + "post_attention_layernorm.weight": (h,),
        p + "mlp.gate_proj.weight": (i, h),
        p + "mlp.up_proj.weight": (i, h),
        p + "mlp.down_proj.weight": (h, i),
    }


def end_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Embeddings, final norm and (untied) head: what rank 0 holds besides its layers."""
    shapes = {
        f"{config.weight_prefix}embed_tokens.weight": (config.vocab_size, config.hidden_size),
        f"{config.weight_prefix}norm.weight": (config.hidden_size,),
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
    def of_layer(cls, tensors: dict[str, W], layer: int,
                 prefix: str = "model.") -> LayerWeights[W]:
        """A layer's loaded tensors by field (absent optional ones are None)."""
        p = f"{prefix}layers.{layer}."
        fields = {f: tensors[p + name] for f, name in LAYER_FIELDS.items()}
        fields.update({f: tensors.get(p + name) for f, name in OPTIONAL_LAYER_FIELDS.items()})
        return cls(**fields)


# A Gated DeltaNet layer's weights by their DeltaNetWeights field, inside `linear_attn.`.
DELTANET_FIELDS = {
    "qkv": "in_proj_qkv.weight",
    "z": "in_proj_z.weight",
    "b": "in_proj_b.weight",
    "a": "in_proj_a.weight",
    "conv": "conv1d.weight",
    "dt_bias": "dt_bias",
    "a_log": "A_log",
    "norm": "norm.weight",
    "out": "out_proj.weight",
}


@dataclass
class DeltaNetWeights(Generic[W]):
    """One Gated DeltaNet layer's weights (the hybrid's linear-attention layer type)."""

    input_norm: W
    qkv: W  # [2 x key width + value width, hidden]: q, k and v in one projection
    z: W  # [value width, hidden]: the output gate of the gated RMSNorm
    b: W  # [value heads, hidden]: the write strength, through a sigmoid
    a: W  # [value heads, hidden]: the decay's input, with dt_bias and A_log
    conv: W  # [conv width, 1, kernel]: depthwise causal convolution
    dt_bias: W
    a_log: W
    norm: W  # [value head dim]: the gated RMSNorm's weight (plain, not 1 + w)
    out: W
    post_norm: W
    gate: W
    up: W
    down: W

    @classmethod
    def of_layer(cls, tensors: dict[str, W], layer: int, prefix: str) -> DeltaNetWeights[W]:
        p = f"{prefix}layers.{layer}."
        fields = {f: tensors[p + "linear_attn." + name] for f, name in DELTANET_FIELDS.items()}
        for f in ("input_norm", "post_norm", "gate", "up", "down"):
            fields[f] = tensors[p + LAYER_FIELDS[f]]
        return cls(**fields)


def layer_weights(config: ModelConfig, tensors: dict[str, W],
                  layer: int) -> LayerWeights[W] | DeltaNetWeights[W]:
    """A loaded layer's tensors as the weights of its type."""
    if config.layer_type(layer) == LINEAR_ATTENTION:
        return DeltaNetWeights.of_layer(tensors, layer, config.weight_prefix)
    return LayerWeights.of_layer(tensors, layer, config.weight_prefix)


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
    ends = load(end_tensor_shapes(config))
    embed = ends[f"{config.weight_prefix}embed_tokens.weight"]
    return layers, (embed, ends[f"{config.weight_prefix}norm.weight"],
                    ends.get("lm_head.weight", embed))

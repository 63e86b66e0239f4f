"""The Llama-style dense decoder (Llama, Mistral, Qwen2, Qwen3) on MLX, one layer range.

The MLX twin of `engine.backends.pytorch.llama`: the same weight names, the same range
rules (global layer indices; the first range also holds the embeddings, the final norm and
the head) and the same round semantics. Each op is the one mlx-lm's `models/llama.py`,
`qwen2.py` and `qwen3.py` use (`mx.fast.rms_norm`, which normalises in float32 and casts
back, `mx.fast.rope`, `mx.fast.scaled_dot_product_attention`, `addmm` for biased
projections, `x * sigmoid(x)` for SiLU), so float32 logits match mlx-lm closely. RoPE takes
its frequencies from `engine.config.rope_inv_freq` (llama3 scaling included), the one table
every backend starts from. The tensor names and shapes are the checkpoint's, not the
framework's: they, and the range loading that reads them, come from `engine.family`, as
the PyTorch twin's do. Any projection, the embeddings and the head may come packed by
mlx-lm's affine quantization (`quant.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import mlx.core as mx

from engine.backends.mlx.kv_cache import KVCache, RoundIndex, kv_cache
from engine.backends.mlx.quant import QuantizedWeight, Weight
from engine.config import ModelConfig, rope_inv_freq
from engine.family import LayerWeights, load_range
from engine.rounds import RowLayout

if TYPE_CHECKING:
    from engine.backends.base import StageSpec


def linear(x: mx.array, weight: Weight, bias: mx.array | None = None) -> mx.array:
    """x [rows, in] @ weight [out, in].T (+ bias), as mlx.nn.Linear / QuantizedLinear compute it."""
    if isinstance(weight, QuantizedWeight):
        y = weight.matmul(x)
        return y if bias is None else y + bias
    if bias is None:
        return x @ weight.T
    return mx.addmm(bias, x, weight.T)


class Rope:
    """Rotary embedding at per-row positions, with the frequencies of `rope_inv_freq`."""

    def __init__(self, config: ModelConfig) -> None:
        self.dims = config.rotary_dim  # channels past it pass through (a partial rotary)
        # mx.fast.rope takes periods (1 / inverse frequency), as mlx-lm's Llama3RoPE passes.
        self.periods = mx.array([1.0 / f for f in rope_inv_freq(config)], dtype=mx.float32)

    def apply(self, x: mx.array, positions: mx.array) -> mx.array:
        """x: [rows, heads, head_dim]; positions: [rows]."""
        # One batch entry per row, each with its own offset: rows of a round sit at
        # unrelated positions of unrelated slots.
        y = mx.fast.rope(x[:, :, None, :], self.dims, traditional=False, base=None, scale=1.0,
                         offset=positions, freqs=self.periods)  # [rows, heads, 1, head_dim]
        return y[:, :, 0, :]


def attention(x: mx.array, w: LayerWeights, config: ModelConfig, rope: Rope, cache: KVCache,
              layer_slot: int, index: RoundIndex) -> mx.array:
    rows = x.shape[0]
    d = config.head_dim
    q = linear(x, w.q, w.q_bias).reshape(rows, config.num_attention_heads, d)
    k = linear(x, w.k, w.k_bias).reshape(rows, config.num_key_value_heads, d)
    v = linear(x, w.v, w.v_bias).reshape(rows, config.num_key_value_heads, d)
    if w.q_norm is not None:
        q = mx.fast.rms_norm(q, w.q_norm, config.rms_norm_eps)
        k = mx.fast.rms_norm(k, w.k_norm, config.rms_norm_eps)
    q = rope.apply(q, index.positions)
    k = rope.apply(k, index.positions)
    cache.write(layer_slot, index, k, v)
    out = cache.attend(layer_slot, index, q, d**-0.5)  # [rows, heads, head_dim]
    return linear(out.reshape(rows, config.q_width), w.o)


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    # Compiled as mlx-lm's `swiglu` is: one fused elementwise kernel instead of three ops,
    # each of which costs a dispatch on the CPU whatever its size.
    return gate * mx.sigmoid(gate) * up


def mlp(x: mx.array, w: LayerWeights) -> mx.array:
    return linear(swiglu(linear(x, w.gate), linear(x, w.up)), w.down)


def block(x: mx.array, w: LayerWeights, config: ModelConfig, rope: Rope, cache: KVCache,
          layer_slot: int, index: RoundIndex) -> mx.array:
    eps = config.rms_norm_eps
    x = x + attention(mx.fast.rms_norm(x, w.input_norm, eps), w, config, rope, cache,
                      layer_slot, index)
    return x + mlp(mx.fast.rms_norm(x, w.post_norm, eps), w)


class LlamaRange:
    """Layers [start, end) of a Llama-style model, plus the ends when it is the first range."""

    def __init__(self, config: ModelConfig, layer_range: tuple[int, int],
                 load: Callable[[dict[str, tuple[int, ...]]], dict[str, Weight]],
                 cache: KVCache, rope: Rope, on_layer: Callable[[int], None] | None = None):
        self.config = config
        self.layer_range = layer_range
        self.cache = cache
        self.rope = rope
        self.layers, ends = load_range(config, layer_range, load, on_layer)
        self.embed, self.norm, self.head = ends

    def round_index(self, layout: RowLayout) -> RoundIndex:
        """Where a round's rows sit, built once a round for every layer."""
        return RoundIndex.build(layout, self.config.sliding_window)

    def embed_tokens(self, token_ids: mx.array) -> mx.array:
        if isinstance(self.embed, QuantizedWeight):
            return self.embed.rows(token_ids)  # [rows, hidden]
        return self.embed[token_ids]  # [rows, hidden]

    def run_layers(self, x: mx.array, index: RoundIndex) -> mx.array:
        for layer_slot, w in enumerate(self.layers):
            x = block(x, w, self.config, self.rope, self.cache, layer_slot, index)
        return x

    def logits(self, x: mx.array) -> mx.array:
        x = mx.fast.rms_norm(x, self.norm, self.config.rms_norm_eps)
        return linear(x, self.head).astype(mx.float32)  # [rows, vocab]


def build_range(config: ModelConfig, spec: StageSpec,
                load: Callable[[dict[str, tuple[int, ...]]], dict[str, Weight]],
                dtype: mx.Dtype, on_layer: Callable[[int], None] | None = None) -> LlamaRange:
    """The stage's range and its KV cache: this family's entry for the MLX stage."""
    cache = kv_cache(spec.layer_range[1] - spec.layer_range[0], spec.parallel,
                     config.num_key_value_heads, spec.context, config.head_dim, dtype,
                     spec.kv_pages)
    return LlamaRange(config, spec.layer_range, load, cache, Rope(config), on_layer)

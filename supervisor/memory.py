"""The memory model of a stage: a model's byte counts, and what one layer range costs a node.

A dense decoder's layers all have the same shape, so a stage's memory is a count of layers
times one layer's weights and KV, plus what the stage holds besides its layers: every stage
keeps a receive and a send buffer of rows, and rank 0 also holds the embeddings, the final
norm, the head and the logits it samples from. Compute workspace (attention scores, MLP
activations) is not modelled: it must fit in the margin the agent keeps out of "usable".
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from engine.config import ConfigError, ModelConfig

LOGIT_BYTES = 4  # rank 0 samples from float32 logits, whatever the weights' dtype
GB = 1e9


class ShapeError(ValueError):
    """A model shape with a byte count that cannot be right (negative, or zero where it matters)."""


@dataclass(frozen=True)
class ModelShape:
    """What placement needs to know about a model: its layer count and its bytes."""

    n_layers: int
    layer_weight_bytes: int  # one decoder layer's weights (every layer has the same shape)
    kv_bytes_per_position_per_layer: int  # K and V of one cached position in one layer
    embedding_bytes: int
    final_norm_bytes: int
    head_bytes: int  # 0 when the head is tied to the embeddings (rank 0 holds those anyway)
    hidden_size: int
    row_bytes: int  # one hidden row as it travels the ring
    vocab_size: int

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ShapeError(f"ModelShape.{f.name} = {value!r}: expected an integer >= 0")
        for name in ("n_layers", "layer_weight_bytes", "hidden_size", "row_bytes", "vocab_size"):
            if getattr(self, name) == 0:
                raise ShapeError(f"ModelShape.{name} = 0: expected a positive integer")

    @property
    def total_weight_bytes(self) -> int:
        return (self.n_layers * self.layer_weight_bytes + self.embedding_bytes
                + self.final_norm_bytes + self.head_bytes)


@dataclass(frozen=True)
class StageMemory:
    """The bytes one stage needs, by what they are for."""

    weights_bytes: int
    kv_bytes: int
    staging_bytes: int  # rows in and out; on rank 0 also the logits it samples from
    embedding_bytes: int = 0
    final_norm_bytes: int = 0
    head_bytes: int = 0

    @property
    def rank0_extras_bytes(self) -> int:
        return self.embedding_bytes + self.final_norm_bytes + self.head_bytes

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.staging_bytes + self.rank0_extras_bytes


@dataclass(frozen=True)
class ExecutionShape:
    """The model spec's execution shape: what every stage sizes its state and buffers for."""

    context: int  # positions per stream
    parallel: int  # streams served at once
    chunk: int  # prompt rows per round


def layer_bytes(shape: ModelShape, execution: ExecutionShape) -> int:
    """One layer's weights plus its KV for `context` positions of `parallel` streams."""
    kv = shape.kv_bytes_per_position_per_layer * execution.context * execution.parallel
    return shape.layer_weight_bytes + kv


def fixed_bytes(shape: ModelShape, execution: ExecutionShape, is_rank0: bool) -> StageMemory:
    """What a stage holds whatever its layer count (layers themselves left at zero)."""
    rows = max(execution.chunk, execution.parallel)
    staging = 2 * rows * shape.row_bytes  # receive and send buffers of one round
    if not is_rank0:
        return StageMemory(weights_bytes=0, kv_bytes=0, staging_bytes=staging)
    logits = execution.parallel * shape.vocab_size * LOGIT_BYTES
    return StageMemory(weights_bytes=0, kv_bytes=0, staging_bytes=staging + logits,
                       embedding_bytes=shape.embedding_bytes,
                       final_norm_bytes=shape.final_norm_bytes, head_bytes=shape.head_bytes)


def stage_memory(shape: ModelShape, execution: ExecutionShape, layer_count: int,
                 is_rank0: bool) -> StageMemory:
    """Memory of a stage holding `layer_count` layers (and rank 0's extras when it is rank 0)."""
    fixed = fixed_bytes(shape, execution, is_rank0)
    kv = shape.kv_bytes_per_position_per_layer * execution.context * execution.parallel
    return StageMemory(weights_bytes=layer_count * shape.layer_weight_bytes,
                       kv_bytes=layer_count * kv, staging_bytes=fixed.staging_bytes,
                       embedding_bytes=fixed.embedding_bytes,
                       final_norm_bytes=fixed.final_norm_bytes, head_bytes=fixed.head_bytes)


def layers_that_fit(shape: ModelShape, execution: ExecutionShape, usable_memory_bytes: int,
                    is_rank0: bool) -> int:
    """The most layers a node can hold as a stage; 0 when not even its fixed bytes fit."""
    room = usable_memory_bytes - fixed_bytes(shape, execution, is_rank0).total_bytes
    return max(0, room // layer_bytes(shape, execution))


def format_bytes(count: float) -> str:
    """Bytes for people: GB (10^9) above 1 GB, MB below; one decimal."""
    if abs(count) >= GB:
        return f"{count / GB:.1f} GB"
    return f"{count / 1e6:.1f} MB"


def model_shape_from_config(config_json: dict[str, Any], dtype_bytes: int) -> ModelShape:
    """Byte counts of a Llama-style dense decoder from its Hugging Face `config.json`.

    Counts q/k/v/o, gate/up/down, the two norms per layer, q/k/v biases (Qwen2, or any family
    with `attention_bias`, which for Llama and Qwen3 also biases o_proj), MLP biases
    (`mlp_bias`), Qwen3's per-head q/k norms, the embeddings, the final norm, and the head
    unless `tie_word_embeddings`. Every tensor is taken to be `dtype_bytes` per element.
    """
    if not isinstance(dtype_bytes, int) or isinstance(dtype_bytes, bool) or dtype_bytes < 1:
        raise ShapeError(f"dtype_bytes = {dtype_bytes!r}: expected a positive integer")
    try:
        config = ModelConfig.from_dict(config_json)
    except (ConfigError, TypeError) as exc:
        raise ShapeError(str(exc)) from exc
    hidden, inter = config.hidden_size, config.intermediate_size
    q_width, kv_width = config.q_width, config.kv_width
    elements = (hidden * q_width + 2 * hidden * kv_width + q_width * hidden  # q, k, v, o
                + 3 * hidden * inter  # gate, up, down
                + 2 * hidden)  # input and post-attention norms
    if config.attention_bias:
        elements += q_width + 2 * kv_width
        if config.model_type != "qwen2":  # Qwen2 never biases o_proj; the others follow the flag
            elements += hidden
    if config_json.get("mlp_bias"):
        elements += 2 * inter + hidden
    if config.qk_norm:
        elements += 2 * config.head_dim
    embedding = config.vocab_size * hidden * dtype_bytes
    return ModelShape(
        n_layers=config.num_hidden_layers,
        layer_weight_bytes=elements * dtype_bytes,
        kv_bytes_per_position_per_layer=config.kv_bytes_per_position(dtype_bytes),
        embedding_bytes=embedding,
        final_norm_bytes=hidden * dtype_bytes,
        head_bytes=0 if config.tie_word_embeddings else embedding,
        hidden_size=hidden,
        row_bytes=hidden * dtype_bytes,
        vocab_size=config.vocab_size,
    )


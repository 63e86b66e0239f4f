"""The Qwen3.5 hybrid family: Gated DeltaNet layers interleaved with gated full attention."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.families.description import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    ConfigError,
    FamilyDescription,
    ModelTypeTraits,
)
from engine.families.kinds import ATTENTION, DELTANET, end_tensors

if TYPE_CHECKING:
    from engine.config import ModelConfig

# `qwen3_5_text` is the causal LM's config; `qwen3_5` the conditional-generation (vision +
# text) one, whose text part sits in `text_config` and its weights under a prefix.
_TRAITS = dict(qk_norm=True, attn_output_gate=True, norm_adds_one=True,
               flag_biases_o_proj=True)
MODEL_TYPES = {
    "qwen3_5_text": ModelTypeTraits(**_TRAITS),
    "qwen3_5": ModelTypeTraits(**_TRAITS, nested=True),
}
DEFAULT_FULL_ATTENTION_INTERVAL = 4
LINEAR_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim")


def interval_pattern(layers: int, interval: int) -> tuple[str, ...]:
    """Every `interval`-th layer full attention, the rest Gated DeltaNet."""
    return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                 for i in range(layers))


def unnest(raw: dict[str, Any]) -> dict[str, Any]:
    """A conditional-generation config's text model, as a causal LM's config.json would say it.

    The outer file decides the dtype and the tying of the head where it states them; the
    text weights sit under `model.language_model.` beside the vision tower.
    """
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError("config.json: model_type 'qwen3_5' needs a text_config object")
    merged = dict(text, model_type="qwen3_5", weight_prefix="model.language_model.")
    for key in ("tie_word_embeddings", "dtype", "torch_dtype"):
        if raw.get(key) is not None:
            merged[key] = raw[key]
    return merged


def read_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The hybrid's layer pattern and rotary share, from wherever its config.json keeps them."""
    values: dict[str, Any] = {}
    types = raw.get("layer_types")
    if types is None:  # older files state the pattern as an interval
        interval = raw.get("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL)
        types = interval_pattern(raw.get("num_hidden_layers", 0), interval)
    values["layer_types"] = tuple(types)
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    factor = raw.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
    values["partial_rotary_factor"] = float(factor)
    values["weight_prefix"] = raw.get("weight_prefix", "model.")
    # Multimodal RoPE with the same position on every axis (text) is plain RoPE.
    return values


def check_config(config: ModelConfig) -> None:
    if LINEAR_ATTENTION not in config.layer_types:
        return
    for name in LINEAR_FIELDS:
        if getattr(config, name) <= 0:
            raise ConfigError(f"config.json: {name} must be positive, got {getattr(config, name)}")
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise ConfigError(
            f"config.json: linear_num_value_heads {config.linear_num_value_heads} is not "
            f"a multiple of linear_num_key_heads {config.linear_num_key_heads}")


FAMILY = FamilyDescription(
    name="qwen3_5",
    model_types=MODEL_TYPES,
    layer_kinds=(DELTANET, ATTENTION),
    end_tensors=end_tensors,
    backend_module="qwen3_5",
    read_config=read_config,
    unnest=unnest,
    check_config=check_config,
)

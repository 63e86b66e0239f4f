"""The Qwen3.5 hybrid family: Gated DeltaNet layers interleaved with gated full attention."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.families.description import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    ConfigError,
    FamilyDescription,
    ModelTypeTraits,
    Tensor,
)
from engine.families.kinds import ATTENTION, DELTANET, attention_tensors, end_tensors

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


MTP_PREFIX = "mtp."


def mtp_tensors(config: ModelConfig) -> tuple[Tensor, ...]:
    """The multi-token-prediction head, as the Hub's Qwen3.5 checkpoints store it beside the
    text model (and vLLM's Qwen3_5MultiTokenPredictor reads it): `fc` [hidden, 2 x hidden]
    over [pre_fc_norm_embedding(embed(next token)); pre_fc_norm_hidden(hidden)], then
    `mtp_num_hidden_layers` gated full-attention decoder layers (`mtp.layers.N.`, the
    model's own attention layer's tensors), then the norm `mtp.norm`; the embeddings and
    the head are the model's. Fields: `fc`, `embed_norm`, `hidden_norm`, `norm`, and
    `layerN.<the attention layer's field>`."""
    if config.mtp_num_hidden_layers <= 0:
        return ()
    h = config.hidden_size
    p = MTP_PREFIX
    out = [Tensor("fc", p + "fc.weight", (h, 2 * h), absolute=True),
           Tensor("embed_norm", p + "pre_fc_norm_embedding.weight", (h,), absolute=True),
           Tensor("hidden_norm", p + "pre_fc_norm_hidden.weight", (h,), absolute=True)]
    for layer in range(config.mtp_num_hidden_layers):
        out += [Tensor(f"layer{layer}.{t.field}", f"{p}layers.{layer}.{t.name}", t.shape,
                       absolute=True) for t in attention_tensors(config)]
    out.append(Tensor("norm", p + "norm.weight", (h,), absolute=True))
    return tuple(out)


FAMILY = FamilyDescription(
    name="qwen3_5",
    model_types=MODEL_TYPES,
    layer_kinds=(DELTANET, ATTENTION),
    end_tensors=end_tensors,
    backend_module="qwen3_5",
    read_config=read_config,
    unnest=unnest,
    check_config=check_config,
    draft_head_tensors=mtp_tensors,
)

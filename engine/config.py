"""The model's shape, read from a Hugging Face `config.json`: the Llama-style dense families and
the Qwen3.5 hybrid (Gated DeltaNet layers interleaved with gated full attention)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_5_text", "qwen3_5")
# The hybrid: `qwen3_5_text` is the causal LM's config; `qwen3_5` the conditional-generation
# (vision + text) one, whose text part sits in `text_config` and its weights under a prefix.
HYBRID_FAMILIES = ("qwen3_5_text", "qwen3_5")
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"  # a Gated DeltaNet layer
LAYER_TYPES = (FULL_ATTENTION, LINEAR_ATTENTION)


class ConfigError(ValueError):
    """config.json is missing a field, has a bad value, or names an unsupported family."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int = 0  # 0: hidden_size // num_attention_heads, as HF does
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    dtype: str = "float32"
    # The hybrid's fields (dense families keep the defaults: every layer full attention).
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    partial_rotary_factor: float = 1.0  # the share of head_dim that RoPE rotates
    weight_prefix: str = "model."  # where the text model's tensors sit in the checkpoint
    # Derived in __post_init__.
    attention_bias: bool = field(default=False)
    qk_norm: bool = field(default=False)
    attn_output_gate: bool = field(default=False)  # q_proj also yields a sigmoid gate per head
    norm_adds_one: bool = field(default=False)  # RMSNorm scales by (1 + weight), not weight

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_FAMILIES:
            raise ConfigError(
                f"config.json: model_type {self.model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_FAMILIES)})"
            )
        set_ = lambda k, v: object.__setattr__(self, k, v)
        if not self.head_dim:
            set_("head_dim", self.hidden_size // self.num_attention_heads)
        # Qwen2 always carries q/k/v biases; Qwen3 normalises q and k per head.
        set_("attention_bias", self.model_type == "qwen2" or self.attention_bias)
        hybrid = self.model_type in HYBRID_FAMILIES
        set_("qk_norm", self.model_type == "qwen3" or hybrid)
        set_("attn_output_gate", hybrid)
        set_("norm_adds_one", hybrid)
        if not self.layer_types:
            set_("layer_types", (FULL_ATTENTION,) * self.num_hidden_layers)
        set_("layer_types", tuple(self.layer_types))
        self._check_layer_types(hybrid)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config.json: num_attention_heads {self.num_attention_heads} is not a multiple "
                f"of num_key_value_heads {self.num_key_value_heads}"
            )
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: {name} must be positive, got {getattr(self, name)}")

    def _check_layer_types(self, hybrid: bool) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"config.json: layer_types names {len(self.layer_types)} layers, "
                              f"num_hidden_layers is {self.num_hidden_layers}")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ConfigError(f"config.json: layer_types holds {unknown[0]!r} "
                              f"(known: {', '.join(LAYER_TYPES)})")
        if not hybrid and LINEAR_ATTENTION in self.layer_types:
            raise ConfigError(f"config.json: model_type {self.model_type!r} has no "
                              f"{LINEAR_ATTENTION} layers")
        if hybrid and LINEAR_ATTENTION in self.layer_types:
            for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                         "linear_value_head_dim", "linear_conv_kernel_dim"):
                if getattr(self, name) <= 0:
                    raise ConfigError(f"config.json: {name} must be positive, "
                                      f"got {getattr(self, name)}")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ConfigError(
                    f"config.json: linear_num_value_heads {self.linear_num_value_heads} is not "
                    f"a multiple of linear_num_key_heads {self.linear_num_key_heads}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ConfigError(f"config.json: partial_rotary_factor {self.partial_rotary_factor} "
                              f"of head_dim {self.head_dim} is not an even rotary width")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from config.json's dict; unknown keys are ignored."""
        if raw.get("model_type") == "qwen3_5":
            raw = _text_part(raw)
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known and v is not None}
        values["dtype"] = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        # Mistral sets sliding_window directly; Qwen2/3 only honour it with use_sliding_window.
        if raw.get("model_type") in ("qwen2", "qwen3") and not raw.get("use_sliding_window"):
            values.pop("sliding_window", None)
        values["attention_bias"] = bool(raw.get("attention_bias", False))
        for derived in ("qk_norm", "attn_output_gate", "norm_adds_one"):
            values.pop(derived, None)
        if raw.get("model_type") in HYBRID_FAMILIES:
            values.update(_hybrid_values(raw))
        missing = [
            n for n in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "vocab_size") if n not in values
        ]
        if missing:
            raise ConfigError(f"config.json: missing field(s) {', '.join(missing)}")
        values.setdefault("num_key_value_heads", values["num_attention_heads"])
        rope = raw.get("rope_scaling") or raw.get("rope_parameters")
        values["rope_scaling"] = _rope_scaling(rope)
        if rope and "rope_theta" in rope and "rope_theta" not in raw:
            values["rope_theta"] = rope["rope_theta"]
        return cls(**values)

    @property
    def is_hybrid(self) -> bool:
        return self.model_type in HYBRID_FAMILIES

    @property
    def rotary_dim(self) -> int:
        """Leading channels of each head that RoPE rotates; the rest pass through."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer]

    @property
    def linear_key_width(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_width(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_width(self) -> int:
        """Channels of a DeltaNet layer's short convolution: q, k and v side by side."""
        return 2 * self.linear_key_width + self.linear_value_width

    def recurrent_state_elements(self) -> int:
        """Values one DeltaNet layer keeps per slot: the conv window and the delta-rule state."""
        conv = self.linear_conv_width * (self.linear_conv_kernel_dim - 1)
        delta = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
        return conv + delta

    @property
    def q_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def kv_bytes_per_position(self, itemsize: int) -> int:
        """Bytes of K and V one full-attention layer keeps per cached position."""
        return 2 * self.kv_width * itemsize


def _text_part(raw: dict[str, Any]) -> dict[str, Any]:
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


def _hybrid_values(raw: dict[str, Any]) -> dict[str, Any]:
    """The hybrid's layer pattern and rotary share, from wherever its config.json keeps them."""
    values: dict[str, Any] = {}
    layers = raw.get("num_hidden_layers", 0)
    types = raw.get("layer_types")
    if types is None:  # older files state the pattern as an interval
        interval = raw.get("full_attention_interval", 4)
        types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                 for i in range(layers)]
    values["layer_types"] = tuple(types)
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    factor = raw.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
    values["partial_rotary_factor"] = float(factor)
    values["weight_prefix"] = raw.get("weight_prefix", "model.")
    # Multimodal RoPE with the same position on every axis (text) is plain RoPE.
    return values


def _rope_scaling(rope: dict[str, Any] | None) -> dict[str, Any] | None:
    """Keep only scaling we implement; plain (`default`) RoPE needs none."""
    if not rope:
        return None
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind in ("default", "mrope"):
        return None
    if kind != "llama3":
        raise ConfigError(f"config.json: rope_scaling type {kind!r} is not supported (llama3 is)")
    return dict(rope, rope_type="llama3")


def rope_inv_freq(config: ModelConfig) -> list[float]:
    """Inverse frequencies per rotary pair, with llama3 scaling when configured.

    Computed in Python float64 so every backend starts from the same numbers.
    """
    dim = config.rotary_dim
    inv = [1.0 / (config.rope_theta ** (i / dim)) for i in range(0, dim, 2)]
    scaling = config.rope_scaling
    if not scaling:
        return inv
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out

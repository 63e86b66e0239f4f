"""The model's shape, read from a Hugging Face `config.json` (Llama-style dense families)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


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
    # Derived in __post_init__.
    attention_bias: bool = field(default=False)
    qk_norm: bool = field(default=False)

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
        set_("qk_norm", self.model_type == "qwen3")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config.json: num_attention_heads {self.num_attention_heads} is not a multiple "
                f"of num_key_value_heads {self.num_key_value_heads}"
            )
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: {name} must be positive, got {getattr(self, name)}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from config.json's dict; unknown keys are ignored."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known and v is not None}
        values["dtype"] = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        # Mistral sets sliding_window directly; Qwen2/3 only honour it with use_sliding_window.
        if raw.get("model_type") in ("qwen2", "qwen3") and not raw.get("use_sliding_window"):
            values.pop("sliding_window", None)
        values["attention_bias"] = bool(raw.get("attention_bias", False))
        values.pop("qk_norm", None)
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
    def q_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def kv_bytes_per_position(self, itemsize: int) -> int:
        """Bytes of K and V one layer keeps per cached position."""
        return 2 * self.kv_width * itemsize


def _rope_scaling(rope: dict[str, Any] | None) -> dict[str, Any] | None:
    """Keep only scaling we implement; plain (`default`) RoPE needs none."""
    if not rope:
        return None
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return None
    if kind != "llama3":
        raise ConfigError(f"config.json: rope_scaling type {kind!r} is not supported (llama3 is)")
    return dict(rope, rope_type="llama3")


def rope_inv_freq(config: ModelConfig) -> list[float]:
    """Inverse frequencies per rotary pair, with llama3 scaling when configured.

    Computed in Python float64 so every backend starts from the same numbers.
    """
    dim = config.head_dim
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

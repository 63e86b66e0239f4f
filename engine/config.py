"""The model's shape, read from a Hugging Face `config.json`, for whichever family serves its
model type (`engine.families`: the Llama-style dense families and the Qwen3.5 hybrid)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from engine.families import (
    BY_MODEL_TYPE,
    FULL_ATTENTION,
    LAYER_KINDS,
    LINEAR_ATTENTION,
    SUPPORTED_MODEL_TYPES,
    ConfigError,
    FamilyDescription,
    family_of,
)
from engine.families.kinds import KV, RECURRENT

SUPPORTED_FAMILIES = SUPPORTED_MODEL_TYPES  # config.json model types (the old name)
# The model types whose family keeps per-slot recurrent state (the Qwen3.5 hybrid).
HYBRID_FAMILIES = tuple(t for t, f in BY_MODEL_TYPE.items() if f.has_recurrent_state)
LAYER_TYPES = LAYER_KINDS

__all__ = ["FULL_ATTENTION", "HYBRID_FAMILIES", "LAYER_TYPES", "LINEAR_ATTENTION",
           "SUPPORTED_FAMILIES", "ConfigError", "ModelConfig", "rope_inv_freq"]


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
    # Decoder layers of the checkpoint's multi-token-prediction head (`mtp.*`, Qwen3.5):
    # 0 where it has none. Only a drafter reads them (engine.draft_head).
    mtp_num_hidden_layers: int = 0
    # Derived in __post_init__.
    attention_bias: bool = field(default=False)
    qk_norm: bool = field(default=False)
    attn_output_gate: bool = field(default=False)  # q_proj also yields a sigmoid gate per head
    norm_adds_one: bool = field(default=False)  # RMSNorm scales by (1 + weight), not weight

    def __post_init__(self) -> None:
        family = family_of(self.model_type)
        traits = family.model_types[self.model_type]
        if traits.flag_biases_o_proj and self.attention_bias:
            raise ConfigError(f"config.json: attention_bias for model_type {self.model_type!r} "
                              "also biases o_proj, which is not supported")
        set_ = lambda k, v: object.__setattr__(self, k, v)
        if not self.head_dim:
            set_("head_dim", self.hidden_size // self.num_attention_heads)
        set_("attention_bias", traits.attention_bias or self.attention_bias)
        set_("qk_norm", traits.qk_norm)
        set_("attn_output_gate", traits.attn_output_gate)
        set_("norm_adds_one", traits.norm_adds_one)
        if not self.layer_types:
            set_("layer_types", (FULL_ATTENTION,) * self.num_hidden_layers)
        set_("layer_types", tuple(self.layer_types))
        self._check_layer_types(family)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config.json: num_attention_heads {self.num_attention_heads} is not a multiple "
                f"of num_key_value_heads {self.num_key_value_heads}"
            )
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: {name} must be positive, got {getattr(self, name)}")

    def _check_layer_types(self, family: FamilyDescription) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"config.json: layer_types names {len(self.layer_types)} layers, "
                              f"num_hidden_layers is {self.num_hidden_layers}")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ConfigError(f"config.json: layer_types holds {unknown[0]!r} "
                              f"(known: {', '.join(LAYER_TYPES)})")
        own = {kind.name for kind in family.layer_kinds}
        foreign = sorted(set(self.layer_types) - own)
        if foreign:
            raise ConfigError(f"config.json: model_type {self.model_type!r} has no "
                              f"{foreign[0]} layers")
        family.check_config(self)
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ConfigError(f"config.json: partial_rotary_factor {self.partial_rotary_factor} "
                              f"of head_dim {self.head_dim} is not an even rotary width")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from config.json's dict; unknown keys are ignored."""
        # An unknown model type is refused by __post_init__, after the missing fields.
        model_type = raw.get("model_type")
        family = BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
        traits = family.model_types[model_type] if family else None
        if traits and traits.nested:
            raw = family.unnest(raw)
        if raw.get("mlp_bias"):
            raise ConfigError("config.json: mlp_bias (biased MLP projections) is not supported")
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known and v is not None}
        values["dtype"] = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        # Some families honour sliding_window only with a switch (Qwen2/3's).
        if traits and traits.sliding_window_switch and not raw.get(traits.sliding_window_switch):
            values.pop("sliding_window", None)
        values["attention_bias"] = bool(raw.get("attention_bias", False))
        for derived in ("qk_norm", "attn_output_gate", "norm_adds_one"):
            values.pop(derived, None)
        if family:
            values.update(family.read_config(raw))
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
    def family(self) -> FamilyDescription:
        """The one description of this model's family (`engine.families`)."""
        return BY_MODEL_TYPE[self.model_type]

    @property
    def is_hybrid(self) -> bool:
        """Layers of more than one kind, some keeping per-slot recurrent state."""
        return self.family.has_recurrent_state

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

    def recurrent_state_elements(self, drafting: bool = False) -> int:
        """Values one DeltaNet layer keeps per slot: the conv window and the delta-rule state,
        live and as the prompt cache saved them, and where the model drafts, after the rows
        of a verify entry too."""
        return sum(math.prod(t.shape) for t in RECURRENT.held(self, drafting))

    @property
    def q_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def kv_bytes_per_position(self, itemsize: int) -> int:
        """Bytes of K and V one full-attention layer keeps per cached position."""
        return KV.nbytes(self, itemsize)


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

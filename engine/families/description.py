"""What a model family is, as plain data: its config.json model types, layer kinds, tensors and state.

A `FamilyDescription` is the one statement of a family that the rest of the code reads:
`engine.config` (which model types exist and what each implies), `engine.family` (which
tensors a layer range loads), `supervisor.memory` (how many bytes they and the per-stream
state take), the checkpoint maker (which tensors it writes) and the backends (which module
runs the family). It is pure Python (no torch, MLX or numpy), so the supervisor can read it.

Shapes are functions of the parsed config (`engine.config.ModelConfig`, passed in; never
imported here, since the config itself reads these descriptions).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import ModelConfig

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"  # a Gated DeltaNet layer
# Bytes per element of state kept in float32 whatever the weights' dtype.
FLOAT32_BYTES = 4


class ConfigError(ValueError):
    """config.json is missing a field, has a bad value, or names an unsupported family."""


@dataclass(frozen=True)
class Tensor:
    """One checkpoint tensor: the weights' field a backend reads it by, its name, its shape.

    `name` is relative to where the tensor sits: a layer's tensors after `...layers.N.`, the
    ends after the text model's weight prefix (`lm_head.weight` has `absolute` set: it sits
    outside the text model in every layout).
    """

    field: str
    name: str
    shape: tuple[int, ...]
    absolute: bool = False

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class StateTensor:
    """One piece of per-stream state: its elements per unit (a position or a slot), and
    whether it is kept in float32 (else in the model's dtype)."""

    name: str
    shape: tuple[int, ...]
    float32: bool = False
    drafting: bool = False  # held only by a stage whose model drafts (verify rounds)

    def nbytes(self, itemsize: int) -> int:
        return math.prod(self.shape) * (FLOAT32_BYTES if self.float32 else itemsize)


@dataclass(frozen=True)
class StateKind:
    """State a layer keeps for each stream: `per` "position" (KV, grows with the context)
    or "slot" (a fixed recurrent state, whatever the context)."""

    name: str
    per: str
    tensors: Callable[[ModelConfig], tuple[StateTensor, ...]]

    def __post_init__(self) -> None:
        if self.per not in ("position", "slot"):
            raise ValueError(f"StateKind {self.name!r}: per must be 'position' or 'slot'")

    def held(self, config: ModelConfig, drafting: bool = False) -> tuple[StateTensor, ...]:
        """The tensors a stage preallocates: the drafting ones only where its model drafts."""
        return tuple(t for t in self.tensors(config) if drafting or not t.drafting)

    def nbytes(self, config: ModelConfig, itemsize: int, drafting: bool = False) -> int:
        return sum(t.nbytes(itemsize) for t in self.held(config, drafting))


@dataclass(frozen=True)
class LayerKind:
    """A type of decoder layer (config.json's `layer_types` value): its tensors and state."""

    name: str
    tensors: Callable[[ModelConfig], tuple[Tensor, ...]]
    states: tuple[StateKind, ...] = ()

    def weight_elements(self, config: ModelConfig) -> int:
        return sum(t.elements for t in self.tensors(config))

    def state_bytes(self, config: ModelConfig, itemsize: int, per: str,
                    drafting: bool = False) -> int:
        """Bytes of this kind's state per position or per slot (`drafting`: a stage whose
        model drafts, which keeps more)."""
        return sum(s.nbytes(config, itemsize, drafting) for s in self.states if s.per == per)


@dataclass(frozen=True)
class ModelTypeTraits:
    """What one config.json `model_type` of a family implies beyond its fields."""

    attention_bias: bool = False  # q/k/v biased whatever config.json says (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k (Qwen3, Qwen3.5)
    attn_output_gate: bool = False  # q_proj also yields a sigmoid gate per channel
    norm_adds_one: bool = False  # RMSNorm scales by (1 + weight)
    # config.json's key that must be true for `sliding_window` to count; None: it counts.
    sliding_window_switch: str | None = None
    # A nested config (the conditional-generation layout) whose text part is the model.
    nested: bool = False
    # config.json's `attention_bias` also biases o_proj (transformers' Llama, Qwen3, Qwen3.5),
    # which no backend applies: such a config is refused rather than served without it.
    flag_biases_o_proj: bool = False


@dataclass(frozen=True)
class FamilyDescription:
    """One family: the model types it serves, its layer kinds and which layers are which,
    its tensors and state, and the backend module that runs it (`backend_module`, the same
    file name under every backend package)."""

    name: str
    model_types: Mapping[str, ModelTypeTraits]
    layer_kinds: tuple[LayerKind, ...]
    end_tensors: Callable[[ModelConfig], tuple[Tensor, ...]]
    backend_module: str
    # config.json's family-specific fields, as ModelConfig's keyword values (layer pattern).
    read_config: Callable[[dict[str, Any]], dict[str, Any]] = field(default=lambda raw: {})
    # A nested config.json made flat (the conditional-generation layout); identity otherwise.
    unnest: Callable[[dict[str, Any]], dict[str, Any]] = field(default=lambda raw: raw)
    check_config: Callable[[ModelConfig], None] = field(default=lambda config: None)
    # The checkpoint's draft head (Qwen3.5's MTP head, `mtp.*`), absolute names: () where the
    # family or the checkpoint has none. Rank 0 reads it only where the model drafts with it.
    draft_head_tensors: Callable[[ModelConfig], tuple[Tensor, ...]] = field(
        default=lambda config: ())

    def kind(self, name: str) -> LayerKind:
        for kind in self.layer_kinds:
            if kind.name == name:
                return kind
        raise ConfigError(f"family {self.name!r} has no {name!r} layers "
                          f"(it has {', '.join(k.name for k in self.layer_kinds)})")

    def layer_kind(self, config: ModelConfig, layer: int) -> LayerKind:
        return self.kind(config.layer_type(layer))

    def layer_tensors(self, config: ModelConfig, layer: int) -> tuple[Tensor, ...]:
        return self.layer_kind(config, layer).tensors(config)

    @property
    def has_recurrent_state(self) -> bool:
        """Some layer keeps per-slot state, which a keep cannot roll back by an offset."""
        return any(s.per == "slot" for k in self.layer_kinds for s in k.states)


def layer_prefix(config: ModelConfig, layer: int) -> str:
    return f"{config.weight_prefix}layers.{layer}."


def tensor_name(config: ModelConfig, tensor: Tensor, layer: int | None = None) -> str:
    """A tensor's full checkpoint name: in layer `layer`, or an end tensor when None."""
    if tensor.absolute:
        return tensor.name
    if layer is None:
        return config.weight_prefix + tensor.name
    return layer_prefix(config, layer) + tensor.name


def draft_head_bytes(config: ModelConfig, context: int, itemsize: int,
                     parallel: int) -> int:
    """What the draft head adds on rank 0: its weights (the embeddings and head are the
    model's own) and its KV for `context` positions per slot, for `parallel` slots."""
    tensors = config.family.draft_head_tensors(config)
    if not tensors:
        return 0
    kv = config.kv_bytes_per_position(itemsize) * config.mtp_num_hidden_layers
    return sum(t.elements for t in tensors) * itemsize + kv * context * parallel


def slot_state_bytes(config: ModelConfig, layer_range: tuple[int, int], context: int,
                     itemsize: int, drafting: bool = False) -> int:
    """What one slot's state takes on a stage of `layer_range`: each layer's KV for `context`
    positions and its recurrent state (both copies), as the stage preallocates it and
    `supervisor.memory` charges it (tests/supervisor/test_memory_families.py holds the
    three equal)."""
    total = 0
    for layer in range(*layer_range):
        kind = config.family.layer_kind(config, layer)
        total += (kind.state_bytes(config, itemsize, "position") * context
                  + kind.state_bytes(config, itemsize, "slot", drafting))
    return total

"""The registry of model families: each config.json model_type to its one description.

A new family is one module here (its `FAMILY` description, added to `FAMILIES`) plus one
module per backend named by its `backend_module` (docs/families.md).
"""

from __future__ import annotations

from engine.families import llama, qwen3_5
from engine.families.description import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    ConfigError,
    FamilyDescription,
    LayerKind,
    ModelTypeTraits,
    StateKind,
    Tensor,
    layer_prefix,
    tensor_name,
)

FAMILIES: tuple[FamilyDescription, ...] = (llama.FAMILY, qwen3_5.FAMILY)
BY_MODEL_TYPE: dict[str, FamilyDescription] = {
    model_type: family for family in FAMILIES for model_type in family.model_types}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(BY_MODEL_TYPE)
LAYER_KINDS: tuple[str, ...] = tuple(dict.fromkeys(
    kind.name for family in FAMILIES for kind in family.layer_kinds))


def family_of(model_type: str) -> FamilyDescription:
    """The family that serves config.json's `model_type`."""
    try:
        return BY_MODEL_TYPE[model_type]
    except KeyError:
        raise ConfigError(f"config.json: model_type {model_type!r} is not supported "
                          f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})") from None


def traits_of(model_type: str) -> ModelTypeTraits:
    return family_of(model_type).model_types[model_type]


__all__ = [
    "BY_MODEL_TYPE", "FAMILIES", "FULL_ATTENTION", "LAYER_KINDS", "LINEAR_ATTENTION",
    "SUPPORTED_MODEL_TYPES", "ConfigError", "FamilyDescription", "LayerKind",
    "ModelTypeTraits", "StateKind", "Tensor", "family_of", "layer_prefix", "tensor_name",
    "traits_of",
]

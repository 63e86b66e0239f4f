"""Which backend module runs a model's family: the registry, keyed by the family's description.

Every backend package holds one module per family, named by the family's `backend_module`
(`engine.families`), each with a `build_range` that makes the family's layer range and its
per-slot state; a stage asks here instead of branching on the family. A new family is a new
description plus one such module per backend (docs/families.md).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from engine.config import ModelConfig


def family_module(backend_package: str, config: ModelConfig) -> ModuleType:
    """The module of `backend_package` (e.g. "engine.backends.pytorch") for config's family."""
    module = importlib.import_module(f"{backend_package}.{config.family.backend_module}")
    if not hasattr(module, "build_range"):
        raise TypeError(f"{module.__name__} has no build_range: not a family module")
    return module

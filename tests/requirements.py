"""Test dependencies that `make test` always installs."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest


def require(name: str) -> ModuleType:
    """Import `name`; without it, fail: a skip would hide a missing install step, here or on
    a GPU machine (bench/cuda_session.sh carries MLX there as wheels)."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        pytest.fail(f"{name} is not installed ({exc}); `make test` installs it",
                    pytrace=False)

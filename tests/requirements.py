"""Test dependencies that `make test` always installs."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

# Modules a run may lack on purpose, comma-separated: a GPU image without MLX runs its CUDA
# cases (bench/cuda_session.sh sets it). Anywhere else a missing one fails, since a skip
# would hide a missing install step.
MISSING_OK = "RINGFLEET_TESTS_MISSING_OK"


def require(name: str) -> ModuleType:
    """Import `name`; without it, fail, unless the run named it in MISSING_OK (then skip)."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        allowed = {m.strip() for m in os.environ.get(MISSING_OK, "").split(",")}
        if name not in allowed:
            pytest.fail(f"{name} is not installed ({exc}); `make test` installs it, or set "
                        f"{MISSING_OK}={name} to run without it", pytrace=False)
        pytest.skip(f"{name} is not installed, and {MISSING_OK} allows it",
                    allow_module_level=True)

"""Test dependencies that a developer's machine may lack and CI always installs."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def require(name: str) -> ModuleType:
    """Import `name`. Without it a developer's machine skips, but CI fails: CI installs every
    test dependency (`make test`), so a skip there would hide a missing install step."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed, and CI installs it: {exc}", pytrace=False)
        pytest.skip(f"{name} is not installed", allow_module_level=True)

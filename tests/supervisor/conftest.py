"""What the supervisor's end-to-end tests share."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The demo shape (8 layers, llama), made once per test module."""
    from engine.checkpoint.maker import PRESETS, make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("model") / "demo", PRESETS["demo"])

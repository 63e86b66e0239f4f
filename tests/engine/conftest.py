"""Helpers that drive a stage round by round, by hand."""

from __future__ import annotations

from pathlib import Path

from engine.backends.base import StageSpec, load_stage
from engine.harness.driver import RoundDriver
from engine.pipeline.runner import LocalRunner


def whole_stage(model_dir: Path, *, parallel: int = 4, context: int = 256, chunk: int = 64,
                layers: tuple[int, int] | None = None):
    from engine.harness.local_pipeline import model_config

    n_layers = model_config(model_dir).num_hidden_layers  # text_config's, where it is nested
    spec = StageSpec(model_dir, layers or (0, n_layers), "torch-cpu", parallel, context, chunk)
    return load_stage(spec)


def stage_driver(stage) -> RoundDriver:
    """Rounds by hand over a whole-model stage."""
    return RoundDriver(LocalRunner(stage))

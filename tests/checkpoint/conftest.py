"""Checkpoints made once per session for the checkpoint tests, keyed by their spec."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine.checkpoint.maker import CheckpointSpec, Llama3RopeScaling, make_checkpoint

# Tiny and odd on purpose: head_dim is never hidden / heads, GQA is 4:1, 2:1 and 1:1, and
# llama carries Llama 3.1 rope scaling.
FAMILY_SHAPES: dict[str, dict] = {
    "llama": dict(family="llama", hidden_size=32, intermediate_size=72, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=12, num_hidden_layers=2,
                  rope_theta=500000.0, max_position_embeddings=128,
                  rope_scaling=Llama3RopeScaling(factor=4.0, original_max_position_embeddings=16)),
    "mistral": dict(family="mistral", hidden_size=24, intermediate_size=40, num_attention_heads=2,
                    num_key_value_heads=2, head_dim=16, num_hidden_layers=2, sliding_window=5),
    "qwen2": dict(family="qwen2", hidden_size=32, intermediate_size=48, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=6, num_hidden_layers=2),
    "qwen3": dict(family="qwen3", hidden_size=20, intermediate_size=40, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=10, num_hidden_layers=2),
    # A DeltaNet layer then a full-attention one; value heads 2:1 over key heads, and key and
    # value head dims that differ.
    "qwen3_5": dict(family="qwen3_5", hidden_size=32, intermediate_size=48, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, num_hidden_layers=2,
                    full_attention_interval=2, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=8, linear_value_head_dim=6),
}


def family_spec(family: str, /, **overrides) -> CheckpointSpec:
    return CheckpointSpec(**(FAMILY_SHAPES[family] | {"vocab_size": 300} | overrides))


@pytest.fixture(scope="session")
def made(tmp_path_factory) -> Callable[[CheckpointSpec], Path]:
    """Make (once) the checkpoint for a spec and return its directory; treat it as read-only."""
    cache: dict[CheckpointSpec, Path] = {}

    def make(spec: CheckpointSpec) -> Path:
        if spec not in cache:
            cache[spec] = make_checkpoint(tmp_path_factory.mktemp(spec.family), spec)
        return cache[spec]

    return make

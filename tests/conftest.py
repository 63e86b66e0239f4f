"""Checkpoints made once per test session, shared by every test package."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.checkpoint.maker import CheckpointSpec, Llama3RopeScaling, make_checkpoint

# Odd shapes nobody tuned the engine to: head_dim unrelated to hidden / heads, GQA 3:1 and
# 1:1, an intermediate size that is not a power of two.
FAMILY_SPECS = {
    "llama": dict(family="llama", hidden_size=48, intermediate_size=100, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=10, num_hidden_layers=3,
                  rope_theta=500000.0, rope_scaling=Llama3RopeScaling(
                      factor=8.0, original_max_position_embeddings=32)),
    "mistral": dict(family="mistral", hidden_size=40, intermediate_size=72, num_attention_heads=4,
                    num_key_value_heads=4, head_dim=14, num_hidden_layers=3, sliding_window=9),
    "qwen2": dict(family="qwen2", hidden_size=36, intermediate_size=60, num_attention_heads=6,
                  num_key_value_heads=3, head_dim=8, num_hidden_layers=3),
    "qwen3": dict(family="qwen3", hidden_size=32, intermediate_size=88, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=18, num_hidden_layers=3),
    # Layers DeltaNet, attention, DeltaNet, attention; value heads 2:1 over key heads, key and
    # value head dims that differ, 4 of 16 channels rotated.
    "qwen3_5": dict(family="qwen3_5", hidden_size=32, intermediate_size=72, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_hidden_layers=4,
                    full_attention_interval=2, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=8, linear_value_head_dim=12),
}


@pytest.fixture(scope="session")
def make_model(tmp_path_factory):
    made: dict[tuple, Path] = {}

    def make(family: str, *, dtype: str = "float32", tie: bool = False, shards: int = 1,
             **overrides) -> Path:
        key = (family, dtype, tie, shards, tuple(sorted(overrides.items())))
        if key not in made:
            fields = dict(FAMILY_SPECS[family], dtype=dtype, tie_word_embeddings=tie,
                          shards=shards, vocab_size=300, seed=len(made) + 7)
            fields.update(overrides)
            out = tmp_path_factory.mktemp(f"{family}-{dtype}")
            made[key] = make_checkpoint(out, CheckpointSpec(**fields))
        return made[key]

    return make

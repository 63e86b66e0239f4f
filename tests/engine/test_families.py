"""The family registry: every model type has one description, pure Python, run by a module of
each backend; the config reads its traits from there."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from engine.config import ConfigError, ModelConfig
from engine.families import BY_MODEL_TYPE, FAMILIES, SUPPORTED_MODEL_TYPES, family_of
from tests.requirements import require

BACKEND_PACKAGES = ("engine.backends.pytorch", "engine.backends.mlx")


def test_the_descriptions_import_no_framework():
    """The supervisor reads them, so they must not pull torch, MLX, numpy or safetensors."""
    code = ("import sys, engine.families, engine.config; "
            "print(sorted(m for m in ('torch', 'mlx', 'numpy', 'safetensors') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_each_model_type_has_one_family():
    served = [t for family in FAMILIES for t in family.model_types]
    assert len(served) == len(set(served)) == len(SUPPORTED_MODEL_TYPES)
    assert set(BY_MODEL_TYPE) == {"llama", "mistral", "qwen2", "qwen3", "qwen3_5_text", "qwen3_5"}
    with pytest.raises(ConfigError, match="not supported"):
        family_of("gpt2")


@pytest.mark.parametrize("package", BACKEND_PACKAGES)
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_each_backend_has_a_module_for_each_family(package, family):
    if package.endswith(".mlx"):
        require("mlx.core")
    module = importlib.import_module(f"{package}.{family.backend_module}")
    assert callable(module.build_range)


@pytest.mark.parametrize(("model_type", "qk_norm", "bias", "gate"), [
    ("llama", False, False, False), ("qwen2", False, True, False),
    ("qwen3", True, False, False), ("qwen3_5_text", True, False, True)])
def test_the_config_takes_its_traits_from_the_description(model_type, qk_norm, bias, gate):
    raw = dict(model_type=model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, vocab_size=300)
    if model_type == "qwen3_5_text":
        raw["layer_types"] = ["full_attention"] * 2
    config = ModelConfig.from_dict(raw)
    assert (config.qk_norm, config.attention_bias, config.attn_output_gate) == \
        (qk_norm, bias, gate)
    assert config.family is family_of(model_type)
    assert config.is_hybrid == (model_type == "qwen3_5_text")

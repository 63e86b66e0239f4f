"""A quantized Qwen3.5 hybrid (mlx-lm's affine format, our writer) on PyTorch against MLX.

The PyTorch stage dequantizes its range at load; MLX computes with the packed weights. The
two backends' logits must agree at every position of a prompt chunk and the decode rows
after it, and in a mixed round.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.requirements import require

require("mlx.core")

from engine.backends.base import StageSpec, load_stage
from engine.checkpoint.quantize import quantize_checkpoint
from tests.engine.conftest import stage_driver

GROUP = 32  # packs hidden-wide inputs (32); 72-wide and 48-wide inputs stay dense


def drive(model_dir: Path, backend: str, ids: list[int]) -> np.ndarray:
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    driver = stage_driver(load_stage(StageSpec(model_dir, (0, layers), backend, 2, 128, 64)))
    rows = [driver.round({0: ids[:40]})[0]]
    rows += [driver.round({0: [t]})[0] for t in ids[40:]]
    return np.stack(rows)  # [1 + len(ids) - 40, vocab]


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_hybrid_agrees_across_backends(make_model, tmp_path, bits):
    source = make_model("qwen3_5")
    model_dir = quantize_checkpoint(source, tmp_path / "model", bits, GROUP)
    assert json.loads((model_dir / "config.json").read_text())["quantization"]["bits"] == bits
    ids = np.random.default_rng(bits).integers(3, 300, 60).tolist()
    torch_logits = drive(model_dir, "torch-cpu", ids)
    mlx_logits = drive(model_dir, "mlx-cpu", ids)
    np.testing.assert_allclose(torch_logits, mlx_logits, atol=1e-4, rtol=0)
    # Quantization moved the logits: the test is not reading the float checkpoint.
    assert np.abs(torch_logits - drive(source, "torch-cpu", ids)).max() > 1e-3

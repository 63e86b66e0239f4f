"""Calibration of a quantized checkpoint times the packed kernels a stage will run."""

from __future__ import annotations

import pytest

from agent.calibrate import (
    HOP,
    ROUND,
    CalibrationError,
    CalibrationRequest,
    calibrate,
    make_timer,
)
from engine.config import FULL_ATTENTION
from tests.requirements import require

require("mlx.core")

SHAPE = dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
             torch_dtype="bfloat16")
QUANT = {"group_size": 32, "bits": 4, "mode": "affine"}


def request(config: dict, backend: str) -> CalibrationRequest:
    return CalibrationRequest(config=config, backend=backend, contexts=(64,), batch_rows=2,
                              chunk_rows=16, runs=1, warmup=0, budget_s=5.0, threads=1)


@pytest.mark.parametrize(("backend", "packed_type"), [("torch-cpu", "PackedWeight"),
                                                      ("mlx-cpu", "QuantizedWeight")])
def test_a_quantized_shape_is_timed_on_packed_weights(backend, packed_type, tmp_path):
    quantized = request(dict(SHAPE, quantization=QUANT), backend)
    dense = request(SHAPE, backend)
    timer = make_timer(quantized, FULL_ATTENTION, tmp_path / "packed")
    layer = timer.model.layers[0]
    assert type(layer.down).__name__ == packed_type
    assert type(layer.input_norm).__name__ not in ("PackedWeight", "QuantizedWeight")
    dense_layer = make_timer(dense, FULL_ATTENTION, tmp_path / "dense").model.layers[0]
    assert type(dense_layer.down).__name__ not in ("PackedWeight", "QuantizedWeight")
    assert quantized.key("0.1.0") != dense.key("0.1.0")  # cached apart
    result = calibrate(quantized, "0.1.0")
    # every layer's and the head's; the host work beyond the layers may read 0 (under noise)
    assert all(t.ms_per_layer > 0 for t in result.timings if t.kind not in (ROUND, HOP))


def test_a_float32_quantized_shape_on_torch_cpu_is_timed_dense_as_it_will_run(tmp_path):
    """quant_policy holds float32 dense on the CPU (its int4 path measured slower)."""
    quantized = request(dict(SHAPE, torch_dtype="float32", quantization=QUANT), "torch-cpu")
    timer = make_timer(quantized, FULL_ATTENTION, tmp_path)
    assert type(timer.model.layers[0].down).__name__ == "Tensor"


def test_a_non_affine_quantization_is_refused_by_name():
    bad = request(dict(SHAPE, quantization=dict(QUANT, mode="mxfp4")), "torch-cpu")
    with pytest.raises(CalibrationError, match="mxfp4"):
        bad.key("0.1.0")

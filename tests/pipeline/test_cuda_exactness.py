"""A two-stage pipeline on CUDA gives one CUDA process's bits (skipped without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.harness.local_pipeline import whole_runner
from tests.pipeline.conftest import first_difference, greedy_trace, pipeline

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])  # the hybrid cut after a DeltaNet layer
def test_cuda_pipeline_logits_equal_one_cuda_process(make_model, tmp_path, family, dtype):
    model_dir = make_model(family, dtype=dtype, num_hidden_layers=4)
    prompts = [np.random.default_rng(n).integers(0, 300, 200 + n).tolist() for n in range(4)]
    whole = whole_runner(model_dir, backend="torch-cuda", chunk=64, depth=2)  # as the ring
    expected = greedy_trace(whole, model_dir, prompts, steps=32, chunk=64)
    devices = {1: {"CUDA_VISIBLE_DEVICES": str(min(1, torch.cuda.device_count() - 1))}}
    with pipeline(model_dir, [(0, 1), (1, 4)], tmp_path, backends=["torch-cuda"] * 2,
                  chunk=64, rank_env=devices) as runner:
        got = greedy_trace(runner, model_dir, prompts, steps=32, chunk=64)
    assert [p for p, _ in got] == [p for p, _ in expected]
    assert first_difference(got, expected) is None, first_difference(got, expected)

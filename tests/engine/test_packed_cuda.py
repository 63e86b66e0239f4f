"""A packed 4-bit stage on CUDA (skipped without a GPU): PyTorch's CUDA int4 kernel, its
decode rounds replayed as CUDA graphs, held to the dense dequantized stage on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.backends.base import StageSpec, load_stage
from engine.checkpoint.quantize import quantize_checkpoint
from tests.engine.conftest import stage_driver

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

# hidden 64 and intermediate 128 pack every projection at group 32 (k and v padded: 18 rows).
SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=1, head_dim=18, num_hidden_layers=3, seed=31)


def kl_mean(got: np.ndarray, want: np.ndarray) -> float:
    p = torch.log_softmax(torch.from_numpy(want).double(), -1)
    q = torch.log_softmax(torch.from_numpy(got).double(), -1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


def teacher_forced(model_dir, backend: str, ids: list[int], **spec) -> np.ndarray:
    stage = load_stage(StageSpec(model_dir, (0, 3), backend, 2, 128, 16, **spec))
    if backend == "torch-cuda":
        assert type(stage.model.layers[0].down).__name__ == "PackedWeight"
    driver = stage_driver(stage)
    rows = [driver.round({0: ids[:16]})[0]] + [driver.round({0: [t]})[0] for t in ids[16:]]
    return np.stack(rows)


def test_packed_cuda_stage_is_held_to_the_dense_cpu_stage(make_model, tmp_path):
    model_dir = quantize_checkpoint(make_model("qwen3", dtype="bfloat16", **SHAPE),
                                    tmp_path / "q4", 4, 32)
    ids = np.random.default_rng(3).integers(0, 300, 64).tolist()
    want = teacher_forced(model_dir, "torch-cpu", ids, quant="dense")
    graphs = teacher_forced(model_dir, "torch-cuda", ids)
    eager = teacher_forced(model_dir, "torch-cuda", ids, cuda_graphs=False)
    # The bounds of the packed bfloat16 contract (test_packed_exactness.py).
    for got in (graphs, eager):
        assert kl_mean(got, want) <= 5e-3
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.85
    assert teacher_forced(model_dir, "torch-cuda", ids).tobytes() == graphs.tobytes()

"""Mixed rings on one 4-bit checkpoint: torch stages run it packed, MLX stages as stored.

The RFC's fleet: a CUDA (here torch-cpu) stage and an MLX stage serve the same mlx-lm 4-bit
directory. In bfloat16 the torch stages hold the weights packed (PyTorch's int4 kernels,
engine.backends.quant_policy), so no stage dequantizes. Held like every mixed ring
(test_mixed_rings.py, whose helpers these are): deterministic per placement, and close to a
whole-model reference on the same file, here one MLX process (MLX is mlx-lm's arithmetic).
"""

from __future__ import annotations

import pytest

from tests.requirements import require

require("mlx.core")

from engine.backends.base import StageSpec, load_stage
from engine.checkpoint.quantize import quantize_checkpoint
from tests.pipeline.test_mixed_rings import (  # noqa: F401 (one_thread: the module's fixture)
    LAYERS,
    SEED,
    check,
    divergence,
    forced,
    one_thread,
    report,
    run_ring,
    sequences,
)

# Bounds against the whole MLX process, as test_mixed_rings' BFLOAT16 (mean KL, max KL, max
# |diff|, least top-1): bfloat16 rounding differs by backend, and the packed torch stages add
# one rounding of each zero. And mixing may cost no more than a whole torch-cpu process on
# the same file costs alone (FACTOR): measured ring / alone 0.4-1.1 (KL mean 3e-4 and
# 1e-4, top-1 95 % and 97 %).
BOUNDS = (1e-3, 1e-2, 0.5, 0.93)
FACTOR = 3.0


@pytest.fixture(scope="module")
def quantized(make_model, tmp_path_factory):
    dense = make_model("qwen3", dtype="bfloat16", num_hidden_layers=LAYERS, seed=SEED)
    model = quantize_checkpoint(dense, tmp_path_factory.mktemp("q4bf16") / "model", 4, 32)
    # What the rings' torch stages hold: packed weights (bfloat16 on torch-cpu).
    stage = load_stage(StageSpec(model, (0, 2), "torch-cpu", 1, 16, 16))
    assert type(stage.model.layers[0].q).__name__ == "PackedWeight"
    seqs = sequences(300, seed=4)
    reference = forced(model, "mlx-cpu", seqs)
    alone = divergence(forced(model, "torch-cpu", seqs), reference)
    report("4-bit bfloat16 whole torch-cpu (packed)", alone)
    return model, seqs, reference, alone


@pytest.mark.parametrize("ring", ["torch>mlx", "mlx>torch"])
def test_packed_4bit_mixed_ring_against_whole_mlx(quantized, tmp_path, ring):
    model, seqs, reference, alone = quantized
    figures = divergence(run_ring(model, ring, tmp_path, seqs), reference)
    check(f"4-bit bfloat16 {ring}", figures, BOUNDS)
    for key in ("kl_mean", "kl_max", "max_abs"):
        assert figures[key] <= FACTOR * max(alone[key], 1e-6), (key, figures, alone)

"""Qwen3.5 hybrid rings of MLX stages give one MLX process's bits (mixed PyTorch + MLX
rings of the hybrid: tests/pipeline/test_qwen3_5_mixed_rings.py).

Followers are `fleet-engine` processes on loopback; rank 0 runs in the test. The checkpoint's
layers are DeltaNet, attention, DeltaNet, attention, DeltaNet: a cut at 1 follows a DeltaNet
layer (the next stage starts with attention and holds KV only for its own layers), a cut at
2 follows an attention layer (the next stage's first state is a recurrent one).
"""

from __future__ import annotations

import pytest

from tests.requirements import require

require("mlx.core")

from engine.harness.local_pipeline import whole_runner
from tests.pipeline.conftest import greedy_trace, hybrid_prompts, pipeline

LAYERS = 5
CHUNK = 48  # a 150-token prompt spans four chunks, each starting from the last one's state
STEPS = 16
# Key and value head dims of 16: at 8 a random hybrid is ill-conditioned enough that float32
# noise alone reaches 1e-3 of a logit (tests/engine/test_qwen3_5_mlx_vs_mlx_lm.py says how).
SHAPE = dict(num_hidden_layers=LAYERS, linear_key_head_dim=16, linear_value_head_dim=16)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cut", [1, 2], ids=["after-deltanet", "after-attention"])
def test_mlx_pipeline_logits_equal_one_mlx_process(make_model, tmp_path, cut, dtype):
    model_dir = make_model("qwen3_5", dtype=dtype, **SHAPE)
    whole = whole_runner(model_dir, backend="mlx-cpu", chunk=CHUNK, depth=2)  # as the ring
    expected = {n: greedy_trace(whole, model_dir, hybrid_prompts(n), steps=STEPS, chunk=CHUNK)
                for n in (1, 4)}
    with pipeline(model_dir, [(0, cut), (cut, LAYERS)], tmp_path, chunk=CHUNK,
                  backends=["mlx-cpu", "mlx-cpu"]) as runner:
        for n in (1, 4):
            got = greedy_trace(runner, model_dir, hybrid_prompts(n), steps=STEPS, chunk=CHUNK)
            assert [plan for plan, _ in got] == [plan for plan, _ in expected[n]]
            for (plan, logits), (_, want) in zip(got, expected[n], strict=True):
                assert logits == want, f"round {plan.round_no} differs ({n} streams)"
            assert len(got) >= STEPS + 150 // CHUNK

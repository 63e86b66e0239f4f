"""Qwen3.5 hybrid pipelines give one process's bits, with cuts after either layer type.

The checkpoint's layers are DeltaNet, attention, DeltaNet, attention, DeltaNet: a cut at 1
follows a DeltaNet layer (the next stage starts with attention), a cut at 2 follows an
attention layer. Each stage keeps the KV and recurrent state of its own layers only.
"""

from __future__ import annotations

import pytest

from engine.harness.local_pipeline import whole_runner
from tests.pipeline.conftest import greedy_trace, hybrid_prompts, pipeline

CHUNK = 48  # a 150-token prompt spans four chunks, each starting from the last one's state
STEPS = 24


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cut", [1, 2], ids=["after-deltanet", "after-attention"])
def test_pipeline_logits_equal_one_process(make_model, tmp_path, cut, dtype):
    model_dir = make_model("qwen3_5", dtype=dtype, num_hidden_layers=5)
    whole = whole_runner(model_dir, chunk=CHUNK, depth=2)  # rounds as the ring runs them
    expected = {n: greedy_trace(whole, model_dir, hybrid_prompts(n), steps=STEPS, chunk=CHUNK)
                for n in (1, 4)}
    with pipeline(model_dir, [(0, cut), (cut, 5)], tmp_path, chunk=CHUNK) as runner:
        for n in (1, 4):
            got = greedy_trace(runner, model_dir, hybrid_prompts(n), steps=STEPS, chunk=CHUNK)
            assert [plan for plan, _ in got] == [plan for plan, _ in expected[n]]
            for (plan, logits), (_, want) in zip(got, expected[n], strict=True):
                assert logits == want, f"round {plan.round_no} differs ({n} streams)"
            assert len(got) >= STEPS + 150 // CHUNK

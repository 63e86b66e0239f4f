"""Pipelines give the same bits as one process: every round's logits, byte for byte."""

from __future__ import annotations

import numpy as np
import pytest

from engine.harness.local_pipeline import whole_runner
from tests.pipeline.conftest import greedy_trace, pipeline

CHUNK = 64  # a 300-token prompt spans five chunks
STEPS = 64


def prompts(count: int) -> list[list[int]]:
    rng = np.random.default_rng(count)
    return [rng.integers(0, 300, 300 - 7 * i).tolist() for i in range(count)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("stages", [[(0, 4), (4, 5)], [(0, 1), (1, 4), (4, 5)]],
                         ids=["2-stages", "3-stages"])
def test_pipeline_logits_equal_one_process(make_model, tmp_path, stages, dtype):
    model_dir = make_model("qwen3", dtype=dtype, num_hidden_layers=5)
    whole = whole_runner(model_dir, chunk=CHUNK, depth=len(stages))  # rounds as the ring runs them
    expected = {n: greedy_trace(whole, model_dir, prompts(n), steps=STEPS, chunk=CHUNK)
                for n in (1, 4)}
    with pipeline(model_dir, stages, tmp_path, chunk=CHUNK) as runner:
        for n in (1, 4):
            got = greedy_trace(runner, model_dir, prompts(n), steps=STEPS, chunk=CHUNK)
            assert [plan for plan, _ in got] == [plan for plan, _ in expected[n]]
            for (plan, logits), (_, want) in zip(got, expected[n], strict=True):
                assert logits == want, f"round {plan.round_no} differs ({n} streams)"
            # Each stream ran its prompt in several chunks, then STEPS decode rounds.
            assert len(got) >= STEPS + 300 // CHUNK

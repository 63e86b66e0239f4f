"""A pipeline of compiled stages (FLEET_COMPILE=on) gives one compiled process's bits.

The compiled decode layer is not bit-identical to the eager one, so the promise is per
setting: every stage compiles the same layer function and meets the same sequence of
shapes (every stage runs every round), so it compiles the same kernels at the same
rounds as a whole model in one process, and a pipeline's logits are that process's,
byte for byte.
"""

from __future__ import annotations

import numpy as np

from engine.backends.base import StageSpec, load_stage
from engine.pipeline.runner import LocalRunner
from tests.pipeline.conftest import greedy_trace, pipeline

CHUNK = 16
STEPS = 12
STAGES = [(0, 2), (2, 3)]


def prompts(count: int) -> list[list[int]]:
    rng = np.random.default_rng(count)
    return [rng.integers(0, 300, 40 - 5 * i).tolist() for i in range(count)]


def test_compiled_pipeline_logits_equal_one_compiled_process(make_model, tmp_path):
    model_dir = make_model("qwen3", dtype="bfloat16", seed=47)
    whole = LocalRunner(load_stage(StageSpec(model_dir, (0, 3), "torch-cpu", 4, 512, CHUNK,
                                             compile="on")))
    assert whole.stage.decode_step is not None
    expected = greedy_trace(whole, model_dir, prompts(3), steps=STEPS, chunk=CHUNK)
    # One round in flight at a time, as the whole model above runs them.
    extra_env = {"FLEET_COMPILE": "on", "FLEET_ROUNDS_IN_FLIGHT": "1"}
    with pipeline(model_dir, STAGES, tmp_path, chunk=CHUNK, extra_env=extra_env) as runner:
        assert runner.stage.decode_step is not None
        got = greedy_trace(runner, model_dir, prompts(3), steps=STEPS, chunk=CHUNK)
    assert [plan for plan, _ in got] == [plan for plan, _ in expected]
    for (plan, logits), (_, want) in zip(got, expected, strict=True):
        assert logits == want, f"round {plan.round_no} differs"

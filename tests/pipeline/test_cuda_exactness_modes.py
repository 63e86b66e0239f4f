"""A two-stage CUDA ring against one CUDA process, byte for byte, with each of the paths a
round can take switched off in turn (captured graphs, the compiled step), so that a ring
that leaves one process's bits names the path that does it and the round where it starts
(skipped without a GPU). `tests/pipeline/test_cuda_exactness.py` checks the serving
default; this one takes it apart."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.backends.base import StageSpec, load_stage
from engine.env import EngineEnv
from engine.pipeline.runner import LocalRunner
from tests.pipeline.conftest import first_difference, greedy_trace, pipeline

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize(("graphs", "compiled"), [("1", "on"), ("0", "on"), ("1", "off")])
def test_a_cuda_ring_equals_one_process_on_each_path(make_model, tmp_path, graphs, compiled):
    model_dir = make_model("llama", dtype="float32", num_hidden_layers=4)
    prompts = [np.random.default_rng(n).integers(0, 300, 200 + n).tolist() for n in range(4)]
    knobs = {"FLEET_CUDA_GRAPHS": graphs, "FLEET_COMPILE": compiled}
    env = EngineEnv.from_environ({"FLEET_MODEL": str(model_dir), "FLEET_BACKEND": "torch-cuda",
                                  "FLEET_PARALLEL": "4", "FLEET_CONTEXT": "512",
                                  "FLEET_CHUNK": "64", **knobs})
    whole = LocalRunner(load_stage(StageSpec.of(env, 4)), depth=2)  # as the ring groups rounds
    expected = greedy_trace(whole, model_dir, prompts, steps=32, chunk=64)
    with pipeline(model_dir, [(0, 1), (1, 4)], tmp_path, backends=["torch-cuda"] * 2,
                  chunk=64, extra_env=knobs) as runner:
        got = greedy_trace(runner, model_dir, prompts, steps=32, chunk=64)
    assert [p for p, _ in got] == [p for p, _ in expected]
    assert first_difference(got, expected) is None, first_difference(got, expected)

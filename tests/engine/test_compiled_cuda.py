"""The compiled decode layer captured in CUDA graphs (FLEET_COMPILE=auto on CUDA) against
the eager graphs and eager rounds (skipped without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.backends.base import StageSpec, load_stage
from tests.engine.conftest import stage_driver, teacher_forced_agreement

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize(("family", "dtype", "tolerance"), [
    ("qwen3", "float32", 1e-4),
    # bfloat16: Inductor keeps fused norms and RoPE in float32 where eager rounds between
    # ops, and over 300 positions the two KV caches drift apart by that rounding: measured
    # up to 0.102 (one logit of 270,000; ~13 bfloat16 steps at 1.0) on an H200 with SDPA in
    # the compiled layer, 0.131 with the Triton decode attention in both.
    ("llama", "bfloat16", 0.1875),
])
def test_compiled_graphs_decode_the_eager_tokens(make_model, family, dtype, tolerance):
    """Teacher-forced with eager rounds' tokens: every round's logits within the dtype's
    rounding, and the greedy token wherever the eager top two are further apart."""
    model_dir = make_model(family, dtype=dtype, num_hidden_layers=3, seed=53)
    prompts = {s: np.random.default_rng(s).integers(0, 300, 9 + 5 * s).tolist()
               for s in range(3)}
    compiled = load_stage(StageSpec(model_dir, (0, 3), "torch-cuda", 4, 512, 64))
    eager = load_stage(StageSpec(model_dir, (0, 3), "torch-cuda", 4, 512, 64, False,
                                 compile="off"))
    assert compiled.decode_step is not None and compiled.graphs.step is not None  # auto
    drivers = (stage_driver(eager), stage_driver(compiled))
    # 300 rounds: past 256 keys, a second key bucket, so a second graph shape.
    decided = teacher_forced_agreement(drivers, prompts, 300, tolerance)
    assert {keys for (_run, _rows, keys, _steps) in compiled.graphs.captured} == {256, 320}
    # Not vacuous: most rounds' top two are far enough apart to decide the token (587 of
    # 900 on an H200 at bfloat16's tolerance, with the Triton decode attention).
    assert decided >= 3 * 300 // 2

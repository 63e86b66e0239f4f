"""The hybrid's MLX stage against its PyTorch stage: logits, and the recurrent states themselves.

The RFC's extra check for hybrids (section 5): beside the logits, the DeltaNet states at
chosen positions are compared, so a state that drifts while the logits still look right
(a wrong decay, a conv window off by one row) is caught where it happens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.requirements import require

mx = require("mlx.core")

from engine.backends.base import StageSpec, load_stage
from engine.checkpoint.maker import CheckpointSpec, make_checkpoint
from tests.engine.conftest import stage_driver
from tests.engine.test_qwen3_5_mlx_vs_mlx_lm import SHAPE

STATE_ATOL = 1e-4  # values of order one after layers of float32 noise (seen: 1.4e-5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen3_5") / "model",
                           CheckpointSpec(family="qwen3_5", **SHAPE, seed=21))


def states(stage) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each DeltaNet layer's (conv [slots, kernel - 1, c], delta [slots, h, v_dim, k_dim])."""
    rec = stage.model.cache.recurrent
    if isinstance(rec.conv, list):  # MLX: one array a layer, in mlx-lm's layout already
        return [np.array(a) for a in rec.conv], [np.array(a) for a in rec.delta]
    conv = rec.conv.transpose(-1, -2).numpy()  # torch: [layers, slots, c, kernel - 1]
    delta = rec.delta.transpose(-1, -2).numpy()  # torch: [layers, slots, h, k_dim, v_dim]
    return list(conv), list(delta)


def test_logits_and_recurrent_states_agree_across_backends(model_dir):
    stages = [load_stage(StageSpec(model_dir, (0, SHAPE["num_hidden_layers"]), backend, 3, 256,
                                   64)) for backend in ("torch-cpu", "mlx-cpu")]
    drivers = [stage_driver(s) for s in stages]
    rng = np.random.default_rng(4)
    ids = [rng.integers(0, 300, n).tolist() for n in (70, 33)]
    rounds = [{0: ids[0][:40], 2: ids[1][:1]},  # a chunk beside a first decode row
              *({0: [ids[0][p]], 2: ids[1][p - 39:p - 38]} for p in range(40, 44)),
              {0: ids[0][44:70], 2: ids[1][5:33]}]  # two chunks from held states
    checked = 0
    for feeds in rounds:
        torch_logits, mlx_logits = (d.round(feeds) for d in drivers)
        for slot in feeds:
            np.testing.assert_allclose(mlx_logits[slot], torch_logits[slot], atol=1e-4, rtol=0)
        (torch_conv, torch_delta), (mlx_conv, mlx_delta) = (states(s) for s in stages)
        assert len(torch_delta) == len(mlx_delta) == 6  # DeltaNet layers of 8
        for layer, (a, b) in enumerate(zip(torch_delta, mlx_delta, strict=True)):
            for slot in feeds:
                np.testing.assert_allclose(b[slot], a[slot], atol=STATE_ATOL, rtol=0,
                                           err_msg=f"delta state, layer {layer}, slot {slot}")
                checked += 1
        for layer, (a, b) in enumerate(zip(torch_conv, mlx_conv, strict=True)):
            for slot in feeds:
                np.testing.assert_allclose(b[slot], a[slot], atol=STATE_ATOL, rtol=0,
                                           err_msg=f"conv window, layer {layer}, slot {slot}")
    assert checked == 6 * 2 * len(rounds)
    assert np.abs(states(stages[1])[1][0][0]).max() > 0.01, "a state that never moved"

"""Calibration's timer is a real stage: the class, the compiled step and the state that serve."""

from __future__ import annotations

import numpy as np
import pytest

from agent.stage_timer import StageTimer, TimerError, cut_config, decode_layout, random_row_bytes
from engine.backends.pytorch.stage import TorchStage
from engine.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig

DENSE = dict(model_type="qwen3", hidden_size=64, intermediate_size=96, num_hidden_layers=6,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128)
# The conditional-generation form, whose layers are described inside text_config.
HYBRID = dict(model_type="qwen3_5", torch_dtype="float32", text_config=dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=128, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, full_attention_interval=4))


def test_a_nested_config_is_cut_inside_its_text_model():
    cut = ModelConfig.from_dict(cut_config(HYBRID, LINEAR_ATTENTION, 3, "bfloat16"))
    assert cut.num_hidden_layers == 5 and set(cut.layer_types) == {LINEAR_ATTENTION}
    assert cut.dtype == "bfloat16" and cut.weight_prefix == "model.language_model."
    assert HYBRID["text_config"]["num_hidden_layers"] == 4  # the caller's dict is untouched


@pytest.mark.parametrize("layer_type", [FULL_ATTENTION, LINEAR_ATTENTION])
def test_the_timer_is_the_stage_serving_loads(tmp_path, layer_type):
    timer = StageTimer(HYBRID, "torch-cpu", 2, 3, 64, 16, tmp_path, layer_type=layer_type)
    assert type(timer.stage) is TorchStage
    assert timer.stage.layer_range == (1, 3) and len(timer.model.layers) == 2
    kinds = {type(layer).__name__ for layer in timer.model.layers}
    assert len(kinds) == 1  # every timed layer is of the one type
    for kind, rows in (("decode", 3), ("prefill", 16)):
        timer.make_round(kind, 64, rows)()  # runs, and leaves the slot table alone
    assert timer.stage.slots.in_use() == 0


def test_the_compiled_step_is_timed_when_the_stage_would_run_it(tmp_path):
    """FLEET_COMPILE=on runs decode rounds through the compiled step: so does the timer, and
    its rows are the eager stage's (the same layers, the same weights)."""
    rows = {}
    for mode in ("off", "on"):
        timer = StageTimer(DENSE, "torch-cpu", 2, 2, 64, 16, tmp_path / mode,
                           layer_type=FULL_ATTENTION, stage_options={"compile": mode})
        assert (timer.stage.decode_step is not None) == (mode == "on")
        x = timer.stage.rows_from_bytes(random_row_bytes(2, 64, "float32"), 2)
        rows[mode] = timer.stage.run_layers_again(x, decode_layout(64, 2)).numpy()
    np.testing.assert_allclose(rows["on"], rows["off"], rtol=1e-4, atol=1e-5)


def test_a_backend_that_cannot_run_here_is_named(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: its absence cannot be shown here")
    with pytest.raises(TimerError, match="no CUDA device"):
        StageTimer(DENSE, "torch-cuda", 1, 1, 64, 16, tmp_path, layer_type=FULL_ATTENTION)


@pytest.mark.parametrize("layer_type", [FULL_ATTENTION, LINEAR_ATTENTION])
def test_a_serving_round_runs_its_plan_again_and_again(tmp_path, layer_type):
    """The "round" point is `forward` over a decode plan, the slot table put back before
    each run: a plan the table refused (a generation, an offset) would raise."""
    timer = StageTimer(HYBRID, "torch-cpu", 2, 3, 64, 16, tmp_path, layer_type=layer_type)
    served = timer.make_round("round", 64, 2)
    for _ in range(3):
        served()
    assert [s.offset for s in timer.stage.slots.slots[:2]] == [64, 64]


def test_a_hop_goes_there_and_back_between_two_link_ends(tmp_path):
    """The hop timer's rows cross two real link ends (the far one a child process) and come
    back as the next stage expects them (their round and rows checked); closing it ends
    the child."""
    from agent.hop_timer import HopTimer

    timer = StageTimer(DENSE, "torch-cpu", 1, 2, 32, 8, tmp_path, layer_type=FULL_ATTENTION)
    hop = HopTimer(timer.stage, max_rows=2)
    try:
        for rows in (1, 2):
            there_and_back = hop.make_round(rows)
            there_and_back()
            there_and_back()
    finally:
        hop.close()
    assert hop.child.returncode == 0

"""Projections stacked at load (engine/backends/pytorch/stacked.py): a GPU stage holds one
weight for each group of projections that read one input, the same bytes as the parts, and
computes what the parts compute; groups that cannot be one weight stay apart. The CPU keeps
the parts, so these stack a CPU stage's layers by hand."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from engine.backends.base import StageSpec, load_stage
from engine.backends.pytorch import llama, stacked
from engine.family import DeltaNetWeights, LayerWeights
from engine.harness.local_pipeline import model_config
from tests.engine.conftest import stage_driver

GROUPS = {LayerWeights: {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")},
          DeltaNetWeights: {"inputs": ("qkv", "z", "b", "a"), "gate_up": ("gate", "up")}}


@pytest.mark.parametrize("family", ["qwen2", "qwen3_5"])
def test_a_stage_s_groups_stack_into_one_weight_of_the_parts_bytes(make_model, family):
    """A CPU stage keeps its parts (its weights are the checkpoint's mapped pages); stacked
    as a GPU stage stacks them at load, each group is one weight of the parts' bytes."""
    model_dir = make_model(family)
    layers = model_config(model_dir).num_hidden_layers
    stage = load_stage(StageSpec(model_dir, (0, layers), "torch-cpu", 2, 64, 16))
    assert all(layer.gate is not None and layer.gate_up is None for layer in stage.model.layers)
    held = stage.weights_nbytes
    stacked.stack_on(torch.device("cpu"), stage.model.layers)  # the CPU: nothing
    assert stage.model.layers[0].gate_up is None
    for layer in stage.model.layers:
        stacked.stack(layer)
    kinds = set()
    for layer in stage.model.layers:
        kinds.add(type(layer))
        for whole, parts in GROUPS[type(layer)].items():
            assert getattr(layer, whole) is not None, whole
            assert all(getattr(layer, p) is None for p in parts), parts
    assert kinds == ({LayerWeights} if family == "qwen2" else {LayerWeights, DeltaNetWeights})
    assert stage.weights_nbytes == held
    if family == "qwen2":  # q, k and v carry biases, stacked with them
        assert stage.model.layers[0].qkv_bias is not None
        assert stage.model.layers[0].q_bias is None


def test_a_stacked_layer_computes_what_its_parts_compute(make_model):
    config = model_config(make_model("qwen2"))
    generator = torch.Generator().manual_seed(5)
    kv = config.num_key_value_heads * config.head_dim

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    h, inter = config.hidden_size, config.intermediate_size
    parts = LayerWeights(1 + 0.1 * random(h), random(config.q_width, h), random(kv, h),
                         random(kv, h), random(h, config.q_width), 1 + 0.1 * random(h),
                         random(inter, h), random(inter, h), random(h, inter),
                         q_bias=random(config.q_width), k_bias=random(kv), v_bias=random(kv))
    whole = copy.deepcopy(parts)
    stacked.stack(whole)
    assert whole.qkv.shape == (config.q_width + 2 * kv, h) and whole.gate_up is not None
    rope = llama.Rope(config, 32, torch.device("cpu"), torch.float32)
    x, positions = random(3, h), torch.tensor([0, 5, 31])
    for got, want in zip(llama.attention_inputs(x, whole, config, rope.cos, rope.sin, positions),
                         llama.attention_inputs(x, parts, config, rope.cos, rope.sin, positions),
                         strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(llama.mlp(x, whole), llama.mlp(x, parts), atol=1e-5, rtol=1e-5)


def test_parts_that_cannot_be_one_weight_stay_apart():
    w = {n: torch.randn(4, 8) for n in ("q", "k", "v", "o", "gate", "up", "down")}
    norms = dict(input_norm=torch.ones(8), post_norm=torch.ones(8))
    mixed = LayerWeights(**norms, **dict(w, k=w["k"].to(torch.bfloat16)))  # two dtypes
    stacked.stack(mixed)
    assert mixed.qkv is None and mixed.q is not None
    assert mixed.gate_up is not None  # gate and up still share one
    one_bias = LayerWeights(**norms, **w, q_bias=torch.zeros(4))  # k and v have none
    stacked.stack(one_bias)
    assert one_bias.qkv is None and one_bias.q_bias is not None


def test_a_hybrid_stage_decodes_the_same_tokens_stacked_or_not(make_model):
    """Whole rounds, prompt chunk and decode rows, DeltaNet and attention layers: the stacked
    stage's logits are the parts' within float32 rounding."""
    model_dir = make_model("qwen3_5")
    layers = model_config(model_dir).num_hidden_layers

    def logits(stack: bool) -> np.ndarray:
        stage = load_stage(StageSpec(model_dir, (0, layers), "torch-cpu", 2, 64, 16))
        if stack:  # as a GPU stage stacks at load
            for layer in stage.model.layers:
                stacked.stack(layer)
        driver = stage_driver(stage)
        out = [driver.round({0: list(range(3, 23)), 1: [7, 8, 9]})]
        for step in range(6):
            out.append(driver.round({0: [int(out[-1][0].argmax())],
                                     1: [int(out[-1][1].argmax())]}))
        return np.stack([r[s] for r in out for s in (0, 1)])

    np.testing.assert_allclose(logits(stack=True), logits(stack=False), atol=1e-4, rtol=0)

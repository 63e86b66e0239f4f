"""The Qwen3.5 hybrid's checkpoints: the conditional-generation layout, and what our config reads."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine.checkpoint.maker import CheckpointSpec, SpecError, config_json, tensor_plan
from engine.checkpoint.reader import open_checkpoint
from engine.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from engine.family import end_tensor_shapes, layer_tensor_shapes
from tests.checkpoint.conftest import family_spec


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_transformers_loads_the_conditional_generation_layout(made, tied):
    spec = family_spec("qwen3_5", multimodal=True, tie_word_embeddings=tied)
    model_dir = made(spec)
    model, info = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        model_dir, dtype="auto", output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, "missing, unexpected or mismatched keys"
    checkpoint = open_checkpoint(model_dir)
    expected = checkpoint.load_tensors(checkpoint.tensor_names(), framework="pt")
    assert any(n.startswith("model.visual.") for n in expected)
    assert any(n.startswith("mtp.") for n in expected)
    state = model.state_dict()
    for name, tensor in expected.items():
        if not name.startswith("mtp."):  # transformers drops the MTP head by design
            assert torch.equal(state[name], tensor), name
    assert model.config.text_config.layer_types == [LINEAR_ATTENTION, FULL_ATTENTION]


@pytest.mark.parametrize("multimodal", [False, True], ids=["text", "conditional"])
def test_family_tables_name_exactly_the_text_tensors(made, multimodal):
    """Per layer type, our tables match the file: every text tensor, never the tower or MTP."""
    spec = family_spec("qwen3_5", multimodal=multimodal)
    checkpoint = open_checkpoint(made(spec))
    config = ModelConfig.from_dict(checkpoint.config)
    assert config.layer_types == (LINEAR_ATTENTION, FULL_ATTENTION)
    assert config.weight_prefix == ("model.language_model." if multimodal else "model.")
    named: dict[str, tuple[int, ...]] = dict(end_tensor_shapes(config))
    for layer in range(config.num_hidden_layers):
        named |= layer_tensor_shapes(config, layer)
    for name, shape in named.items():
        checkpoint.check_shape(name, shape)
    rest = set(checkpoint.tensor_names()) - set(named)
    assert all(n.startswith(("model.visual.", "mtp.")) for n in rest), rest
    assert bool(rest) == multimodal


def test_config_reads_the_nested_text_config():
    spec = family_spec("qwen3_5", multimodal=True, tie_word_embeddings=True, dtype="bfloat16")
    config = ModelConfig.from_dict(config_json(spec))
    assert (config.model_type, config.dtype, config.tie_word_embeddings) == \
        ("qwen3_5", "bfloat16", True)
    assert config.rotary_dim == 2 and config.attn_output_gate and config.norm_adds_one
    assert config.linear_conv_width == 2 * 2 * 8 + 4 * 6


def test_hybrid_fields_are_refused_by_name():
    with pytest.raises(SpecError, match="multimodal"):
        CheckpointSpec(family="llama", multimodal=True)
    with pytest.raises(SpecError, match="linear_num_value_heads"):
        family_spec("qwen3_5", linear_num_value_heads=3)
    with pytest.raises(SpecError, match="partial_rotary_factor"):
        family_spec("qwen3_5", partial_rotary_factor=0.3)
    assert len(tensor_plan(family_spec("qwen3_5"))) > 0


def test_config_refuses_a_bad_layer_pattern_by_name():
    from engine.config import ConfigError

    raw = config_json(family_spec("qwen3_5"))
    with pytest.raises(ConfigError, match="layer_types names 1 layers"):
        ModelConfig.from_dict(dict(raw, layer_types=[LINEAR_ATTENTION]))
    with pytest.raises(ConfigError, match="'sliding_attention'"):
        ModelConfig.from_dict(dict(raw, layer_types=["sliding_attention", FULL_ATTENTION]))
    with pytest.raises(ConfigError, match="linear_num_key_heads must be positive"):
        ModelConfig.from_dict(dict(raw, linear_num_key_heads=0))
    older = {k: v for k, v in raw.items() if k != "layer_types"} | {"full_attention_interval": 2}
    assert ModelConfig.from_dict(older).layer_types == (LINEAR_ATTENTION, FULL_ATTENTION)


@pytest.mark.parametrize("multimodal", [False, True], ids=["text", "conditional"])
def test_a_whole_mtp_head_is_what_the_description_names_and_transformers_skips(made,
                                                                               multimodal):
    """--mtp: the head's tensors are exactly the description's (names and shapes, as the
    Hub's checkpoints and vLLM's predictor have them), in either layout; transformers
    loads the model with nothing missing or unexpected (it ignores `mtp.*` by design), as
    it loads a Hub file."""
    spec = family_spec("qwen3_5", multimodal=multimodal, mtp=True)
    model_dir = made(spec)
    checkpoint = open_checkpoint(model_dir)
    config = ModelConfig.from_dict(checkpoint.config)
    assert config.mtp_num_hidden_layers == 1
    head = {t.name: t.shape for t in config.family.draft_head_tensors(config)}
    assert set(head) == {n for n in checkpoint.tensor_names() if n.startswith("mtp.")}
    for name, shape in head.items():
        checkpoint.check_shape(name, shape)
    h = config.hidden_size
    assert head["mtp.fc.weight"] == (h, 2 * h)
    assert head["mtp.layers.0.self_attn.q_proj.weight"] == (2 * config.q_width, h)
    cls = (transformers.Qwen3_5ForConditionalGeneration if multimodal
           else transformers.Qwen3_5ForCausalLM)
    _, info = cls.from_pretrained(model_dir, dtype="auto", output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}

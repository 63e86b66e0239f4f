"""What the maker writes for the Qwen3.5 hybrid: its config.json and tensors, in both layouts.

The text layout is transformers' `Qwen3_5ForCausalLM` (model type `qwen3_5_text`). The
conditional-generation layout is `Qwen3_5ForConditionalGeneration` (model type `qwen3_5`),
as the Hub ships the family: the text config nested in `text_config`, the text weights under
`model.language_model.`, beside a (tiny) vision tower and MTP tensors that a text server must
never read, which is why they are written at all.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from engine.checkpoint.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID
from engine.config import FULL_ATTENTION, LINEAR_ATTENTION

if TYPE_CHECKING:
    from engine.checkpoint.maker import CheckpointSpec, TensorPlan

# The tiny vision tower of the conditional-generation layout: shapes only matter to loaders.
VISION_CONFIG = {
    "model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 16, "intermediate_size": 32,
    "num_heads": 2, "in_channels": 3, "patch_size": 4, "spatial_merge_size": 2,
    "temporal_patch_size": 2, "num_position_embeddings": 16, "hidden_act": "gelu_pytorch_tanh",
}


def layer_types(spec: CheckpointSpec) -> list[str]:
    """Every `full_attention_interval`-th layer is full attention, the rest Gated DeltaNet."""
    return [FULL_ATTENTION if (i + 1) % spec.full_attention_interval == 0 else LINEAR_ATTENTION
            for i in range(spec.num_hidden_layers)]


def text_config_json(spec: CheckpointSpec) -> dict:
    """The causal LM's config.json, as transformers' Qwen3_5TextConfig writes it."""
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta,
                            "partial_rotary_factor": spec.partial_rotary_factor},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "linear_conv_kernel_dim": spec.linear_conv_kernel_dim,
        "linear_key_head_dim": spec.linear_key_head_dim,
        "linear_value_head_dim": spec.linear_value_head_dim,
        "linear_num_key_heads": spec.linear_num_key_heads,
        "linear_num_value_heads": spec.linear_num_value_heads,
        "layer_types": layer_types(spec),
        "dtype": spec.dtype,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def config_json(spec: CheckpointSpec) -> dict:
    text = text_config_json(spec)
    if not spec.multimodal:
        return text
    del text["architectures"]
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": dict(VISION_CONFIG, out_hidden_size=spec.hidden_size),
        "tie_word_embeddings": spec.tie_word_embeddings,
        "dtype": spec.dtype,
    }


def tensor_plan(spec: CheckpointSpec, plan_type: type[TensorPlan]) -> list[TensorPlan]:
    """Every tensor, scaled as the dense families' are (see maker.tensor_plan).

    RMSNorm weights here are offsets from one (the family scales by 1 + weight), so they
    are drawn around zero; the gated RMSNorm inside a DeltaNet layer scales by its weight.
    """
    hidden, inter = spec.hidden_size, spec.intermediate_size
    q_width, kv_width = spec.num_attention_heads * spec.head_dim, \
        spec.num_key_value_heads * spec.head_dim
    key_width = spec.linear_num_key_heads * spec.linear_key_head_dim
    value_width = spec.linear_num_value_heads * spec.linear_value_head_dim
    heads = spec.linear_num_value_heads
    residual_scale = 1.0 / math.sqrt(2 * spec.num_hidden_layers)
    noise = 0.05
    text = "model.language_model." if spec.multimodal else "model."

    def linear(name: str, out_features: int, in_features: int, scale: float = 1.0) -> TensorPlan:
        return plan_type(name, (out_features, in_features), scale / math.sqrt(in_features))

    def norm(name: str, width: int) -> TensorPlan:
        return plan_type(name, (width,), noise)

    plan = [plan_type(f"{text}embed_tokens.weight", (spec.vocab_size, hidden),
                      1 / math.sqrt(hidden))]
    for layer, kind in enumerate(layer_types(spec)):
        p = f"{text}layers.{layer}."
        if kind == LINEAR_ATTENTION:
            a = p + "linear_attn."
            plan += [
                linear(a + "in_proj_qkv.weight", 2 * key_width + value_width, hidden),
                linear(a + "in_proj_z.weight", value_width, hidden),
                linear(a + "in_proj_b.weight", heads, hidden),
                linear(a + "in_proj_a.weight", heads, hidden),
                plan_type(a + "conv1d.weight", (2 * key_width + value_width, 1,
                                                spec.linear_conv_kernel_dim),
                          1 / math.sqrt(spec.linear_conv_kernel_dim)),
                plan_type(a + "dt_bias", (heads,), noise, mean=1.0),
                plan_type(a + "A_log", (heads,), 0.5),
                plan_type(a + "norm.weight", (spec.linear_value_head_dim,), noise, mean=1.0),
                linear(a + "out_proj.weight", hidden, value_width, residual_scale),
            ]
        else:
            s = p + "self_attn."
            plan += [
                linear(s + "q_proj.weight", 2 * q_width, hidden),  # query and gate per head
                linear(s + "k_proj.weight", kv_width, hidden),
                linear(s + "v_proj.weight", kv_width, hidden),
                linear(s + "o_proj.weight", hidden, q_width, residual_scale),
                norm(s + "q_norm.weight", spec.head_dim),
                norm(s + "k_norm.weight", spec.head_dim),
            ]
        plan += [
            linear(p + "mlp.gate_proj.weight", inter, hidden),
            linear(p + "mlp.up_proj.weight", inter, hidden),
            linear(p + "mlp.down_proj.weight", hidden, inter, residual_scale),
            norm(p + "input_layernorm.weight", hidden),
            norm(p + "post_attention_layernorm.weight", hidden),
        ]
    # Tied: the final norm's scale (1 + weight) gets a random sign, for the reason the dense
    # families' does; weight = sign x (1 + noise) - 1.
    if spec.tie_word_embeddings:
        plan.append(plan_type(f"{text}norm.weight", (hidden,), noise, mean=1.0,
                              random_sign=True, offset=-1.0))
    else:
        plan.append(norm(f"{text}norm.weight", hidden))
        plan.append(linear("lm_head.weight", spec.vocab_size, hidden))
    if spec.multimodal:
        plan += _vision_plan(spec, plan_type) + _mtp_plan(spec, plan_type)
    return plan


def _vision_plan(spec: CheckpointSpec, plan_type: type[TensorPlan]) -> list[TensorPlan]:
    v = VISION_CONFIG
    h, inter, merged = v["hidden_size"], v["intermediate_size"], \
        v["hidden_size"] * v["spatial_merge_size"] ** 2
    patch = (h, v["in_channels"], v["temporal_patch_size"], v["patch_size"], v["patch_size"])
    shapes = {
        "patch_embed.proj.weight": patch, "patch_embed.proj.bias": (h,),
        "pos_embed.weight": (v["num_position_embeddings"], h),
        "blocks.0.norm1.weight": (h,), "blocks.0.norm1.bias": (h,),
        "blocks.0.norm2.weight": (h,), "blocks.0.norm2.bias": (h,),
        "blocks.0.attn.qkv.weight": (3 * h, h), "blocks.0.attn.qkv.bias": (3 * h,),
        "blocks.0.attn.proj.weight": (h, h), "blocks.0.attn.proj.bias": (h,),
        "blocks.0.mlp.linear_fc1.weight": (inter, h), "blocks.0.mlp.linear_fc1.bias": (inter,),
        "blocks.0.mlp.linear_fc2.weight": (h, inter), "blocks.0.mlp.linear_fc2.bias": (h,),
        "merger.norm.weight": (h,), "merger.norm.bias": (h,),
        "merger.linear_fc1.weight": (merged, merged), "merger.linear_fc1.bias": (merged,),
        "merger.linear_fc2.weight": (spec.hidden_size, merged),
        "merger.linear_fc2.bias": (spec.hidden_size,),
    }
    return [plan_type(f"model.visual.{name}", shape, 0.02) for name, shape in shapes.items()]


def _mtp_plan(spec: CheckpointSpec, plan_type: type[TensorPlan]) -> list[TensorPlan]:
    """A token of the multi-token-prediction head's tensors: transformers skips `mtp.*`."""
    h = spec.hidden_size
    return [plan_type("mtp.fc.weight", (h, 2 * h), 0.02),
            plan_type("mtp.norm.weight", (h,), 0.02),
            plan_type("mtp.pre_fc_norm_embedding.weight", (h,), 0.02),
            plan_type("mtp.pre_fc_norm_hidden.weight", (h,), 0.02)]

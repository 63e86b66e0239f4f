"""What the maker writes for the Qwen3.5 hybrid: its config.json, and the layouts' extra tensors.

The text layout is transformers' `Qwen3_5ForCausalLM` (model type `qwen3_5_text`). The
conditional-generation layout is `Qwen3_5ForConditionalGeneration` (model type `qwen3_5`),
as the Hub ships the family: the text config nested in `text_config`, the text weights under
`model.language_model.`, beside a (tiny) vision tower and MTP tensors that a text server must
never read, which is why they are written at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.checkpoint.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID
from engine.families.qwen3_5 import interval_pattern

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
    return list(interval_pattern(spec.num_hidden_layers, spec.full_attention_interval))


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
        **({"mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False}
           if spec.mtp else {}),
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


def beside_text_plan(spec: CheckpointSpec, plan_type: type[TensorPlan]) -> list[TensorPlan]:
    """What the conditional-generation layout holds besides the text model (whose tensors
    are the family description's, as for every family: maker.tensor_plan)."""
    # A whole MTP head (spec.mtp) is the maker's, from the family's description.
    return _vision_plan(spec, plan_type) + ([] if spec.mtp else _mtp_plan(spec, plan_type))


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

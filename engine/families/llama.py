"""The Llama-style dense family (Llama, Mistral, Qwen2, Qwen3): every layer full attention."""

from __future__ import annotations

from engine.families.description import FamilyDescription, ModelTypeTraits
from engine.families.kinds import ATTENTION, end_tensors

# Qwen2 always carries q/k/v biases; Qwen3 normalises q and k per head. Mistral sets
# sliding_window directly; Qwen2/3 only honour it with use_sliding_window.
MODEL_TYPES = {
    "llama": ModelTypeTraits(flag_biases_o_proj=True),
    "mistral": ModelTypeTraits(),
    "qwen2": ModelTypeTraits(attention_bias=True, sliding_window_switch="use_sliding_window"),
    "qwen3": ModelTypeTraits(qk_norm=True, sliding_window_switch="use_sliding_window",
                             flag_biases_o_proj=True),
}

FAMILY = FamilyDescription(
    name="llama",
    model_types=MODEL_TYPES,
    layer_kinds=(ATTENTION,),
    end_tensors=end_tensors,
    backend_module="llama",
)

"""The layer kinds and state kinds the families share: attention (+ its KV), Gated DeltaNet (+ its recurrent state), the MLP, the ends."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.families.description import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    LayerKind,
    StateKind,
    StateTensor,
    Tensor,
)
from engine.rounds import VERIFY_ROWS

if TYPE_CHECKING:
    from engine.config import ModelConfig

# Recurrent states a hybrid keeps per slot for its last verify entry: the state after each
# of its rows but the last, which is the live state (keeping every row restores nothing).
VERIFY_STATES = VERIFY_ROWS - 1


def _kv(config: ModelConfig) -> tuple[StateTensor, ...]:
    # K and V of one cached position, in the model's dtype.
    heads = (config.num_key_value_heads, config.head_dim)
    return StateTensor("k", heads), StateTensor("v", heads)


def _recurrent(config: ModelConfig) -> tuple[StateTensor, ...]:
    # The conv window (the last kernel - 1 inputs, model dtype) and the delta-rule matrix
    # per value head (float32: it accumulates over the whole stream), as both backends keep
    # them (each in its own axis order).
    # Each is held live, saved where a full prompt chunk last ended (the prompt cache's
    # resume point, engine.slots), and once after each row but the last of the slot's last
    # verify entry (the next entry may keep any prefix of it), since a recurrent state
    # cannot be cut back.
    kernel = config.linear_conv_kernel_dim
    conv = (config.linear_conv_width, max(kernel - 1, 0))
    delta = (config.linear_num_value_heads, config.linear_key_head_dim,
             config.linear_value_head_dim)
    return (StateTensor("conv", conv), StateTensor("delta", delta, float32=True),
            StateTensor("saved_conv", conv), StateTensor("saved_delta", delta, float32=True),
            StateTensor("verify_conv", (VERIFY_STATES, *conv), drafting=True),
            StateTensor("verify_delta", (VERIFY_STATES, *delta), float32=True, drafting=True))


KV = StateKind("kv", "position", _kv)
RECURRENT = StateKind("recurrent", "slot", _recurrent)


def mlp_and_norms(config: ModelConfig) -> tuple[Tensor, ...]:
    """What every decoder layer has around its mixer: the SwiGLU MLP and the two norms."""
    h, i = config.hidden_size, config.intermediate_size
    return (Tensor("gate", "mlp.gate_proj.weight", (i, h)),
            Tensor("up", "mlp.up_proj.weight", (i, h)),
            Tensor("down", "mlp.down_proj.weight", (h, i)),
            Tensor("input_norm", "input_layernorm.weight", (h,)),
            Tensor("post_norm", "post_attention_layernorm.weight", (h,)))


def attention_tensors(config: ModelConfig) -> tuple[Tensor, ...]:
    """A full-attention layer: q/k/v/o, the optional q/k/v biases and q/k norms, the MLP."""
    h, d = config.hidden_size, config.head_dim
    q, kv = config.q_width, config.kv_width
    # A gated attention's q_proj yields each head's query and then its gate: twice the width.
    q_out = 2 * q if config.attn_output_gate else q
    a = "self_attn."
    out = [Tensor("q", a + "q_proj.weight", (q_out, h)),
           Tensor("k", a + "k_proj.weight", (kv, h)),
           Tensor("v", a + "v_proj.weight", (kv, h))]
    if config.attention_bias:
        out += [Tensor("q_bias", a + "q_proj.bias", (q,)),
                Tensor("k_bias", a + "k_proj.bias", (kv,)),
                Tensor("v_bias", a + "v_proj.bias", (kv,))]
    out.append(Tensor("o", a + "o_proj.weight", (h, q)))
    if config.qk_norm:
        out += [Tensor("q_norm", a + "q_norm.weight", (d,)),
                Tensor("k_norm", a + "k_norm.weight", (d,))]
    return (*out, *mlp_and_norms(config))


def deltanet_tensors(config: ModelConfig) -> tuple[Tensor, ...]:
    """A Gated DeltaNet layer: fused q/k/v, z, b, a, the short conv, decay terms, gated
    norm, out_proj, then the MLP."""
    h = config.hidden_size
    heads, conv = config.linear_num_value_heads, config.linear_conv_width
    a = "linear_attn."
    return (Tensor("qkv", a + "in_proj_qkv.weight", (conv, h)),
            Tensor("z", a + "in_proj_z.weight", (config.linear_value_width, h)),
            Tensor("b", a + "in_proj_b.weight", (heads, h)),
            Tensor("a", a + "in_proj_a.weight", (heads, h)),
            Tensor("conv", a + "conv1d.weight", (conv, 1, config.linear_conv_kernel_dim)),
            Tensor("dt_bias", a + "dt_bias", (heads,)),
            Tensor("a_log", a + "A_log", (heads,)),
            Tensor("norm", a + "norm.weight", (config.linear_value_head_dim,)),
            Tensor("out", a + "out_proj.weight", (h, config.linear_value_width)),
            *mlp_and_norms(config))


ATTENTION = LayerKind(FULL_ATTENTION, attention_tensors, (KV,))
DELTANET = LayerKind(LINEAR_ATTENTION, deltanet_tensors, (RECURRENT,))


def end_tensors(config: ModelConfig) -> tuple[Tensor, ...]:
    """Embeddings, final norm and (untied) head: what rank 0 holds besides its layers."""
    h, vocab = config.hidden_size, config.vocab_size
    ends = (Tensor("embed", "embed_tokens.weight", (vocab, h)),
            Tensor("norm", "norm.weight", (h,)))
    if config.tie_word_embeddings:
        return ends
    return (*ends, Tensor("head", "lm_head.weight", (vocab, h), absolute=True))

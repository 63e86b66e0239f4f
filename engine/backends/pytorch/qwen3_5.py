"""The Qwen3.5 hybrid on PyTorch, one layer range: Gated DeltaNet and gated full attention.

Layers follow `config.layer_types`. A DeltaNet layer projects q, k and v together, runs
them through a short causal depthwise convolution (its window kept per slot), and applies
the gated delta rule (its matrix kept per slot): one step for decode rows, the chunked form
for a prompt chunk; one round may hold both, across slots. A verify entry's rows come as
decode rows, several of one slot; the recurrence runs them in steps, row j of every slot
at once, and keeps the state after each (recurrent_state.py), so the next entry may keep
any prefix of them. Their projections, attention and MLP stay batched with the decode
rows', and the round can replay a CUDA graph as a decode round does. Its output
goes through an RMSNorm gated by a projection of the input. A full-attention layer is the Qwen3 one plus a
sigmoid gate per channel from q_proj, with RoPE on the first `rotary_dim` channels of
a head. The family's RMSNorm scales by (1 + weight). Ops follow transformers' order and
precision so that float32 logits match it closely.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.backends.pytorch import delta_kernels, gated_delta
from engine.backends.pytorch.delta_kernels import OURS, DeltaKernels
from engine.backends.pytorch.kv_cache import KVCache, RoundIndex, VerifySteps
from engine.backends.pytorch.llama import Rope, mlp, rotate_half
from engine.backends.pytorch.recurrent_state import HybridState, RecurrentState
from engine.backends.pytorch.stacked import projections
from engine.config import LINEAR_ATTENTION, ModelConfig
from engine.family import DeltaNetWeights, LayerWeights, load_range

if TYPE_CHECKING:
    from engine.backends.base import StageSpec


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The family's RMSNorm: (1 + weight), multiplied in float32 before the cast back."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """DeltaNet's output norm: plain weight, then times silu(gate), in float32."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32.to(dtype) * F.silu(gate.float())).to(dtype)


def partial_rope(x: torch.Tensor, rope: Rope, positions: torch.Tensor) -> torch.Tensor:
    """x: [rows, heads, head_dim]; the first rope.cos.shape[-1] channels rotate."""
    width = rope.cos.shape[-1]
    cos = rope.cos[positions][:, None, :]
    sin = rope.sin[positions][:, None, :]
    turned, kept = x[..., :width], x[..., width:]
    return torch.cat((turned * cos + rotate_half(turned) * sin, kept), dim=-1)


def gated_attention(x: torch.Tensor, w: LayerWeights, config: ModelConfig, rope: Rope,
                    state: HybridState, kv_layer: int, index: RoundIndex) -> torch.Tensor:
    rows, eps = x.shape[0], config.rms_norm_eps
    q, gate, k, v = attention_projections(x, w, config)
    q = partial_rope(rms_norm(q, w.q_norm, eps), rope, index.positions)
    k = partial_rope(rms_norm(k, w.k_norm, eps), rope, index.positions)
    state.kv.write(kv_layer, index, k, v)
    out = state.kv.attend(kv_layer, index, q).reshape(rows, config.q_width)
    return F.linear(out * torch.sigmoid(gate.reshape(rows, config.q_width)), w.o)


def attention_projections(x: torch.Tensor, w: LayerWeights, config: ModelConfig
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A gated attention layer's q, its output gate ([rows, heads, head_dim] each), k and v
    ([rows, kv heads, head_dim] each): q's projection holds q and gate head by head."""
    rows, d = x.shape[0], config.head_dim
    kv_width = config.num_key_value_heads * d
    q_and_gate, k, v = projections(x, w.qkv, None, (2 * config.q_width, kv_width, kv_width),
                                   (w.q, w.k, w.v))
    q, gate = q_and_gate.reshape(rows, config.num_attention_heads, 2 * d).chunk(2, dim=-1)
    return (q, gate, k.reshape(rows, config.num_key_value_heads, d),
            v.reshape(rows, config.num_key_value_heads, d))


def _conv(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """window [n, width, kernel - 1 + L] -> silu(causal depthwise conv) [n, width, L]."""
    out = F.conv1d(window, weight, groups=window.shape[1])
    return F.silu(out)


def split_qkv(m: torch.Tensor, config: ModelConfig,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv's output [n, width] as q, k [n, k_heads, k_dim] and v [n, v_heads, v_dim]."""
    key_width = config.linear_key_width
    q, k, v = m.split([key_width, key_width, config.linear_value_width], dim=-1)
    n = m.shape[0]
    return (q.reshape(n, config.linear_num_key_heads, config.linear_key_head_dim),
            k.reshape(n, config.linear_num_key_heads, config.linear_key_head_dim),
            v.reshape(n, config.linear_num_value_heads, config.linear_value_head_dim))


def deltanet(x: torch.Tensor, w: DeltaNetWeights, config: ModelConfig,
             recurrent: RecurrentState, layer: int, index: RoundIndex,
             kernels: DeltaKernels = OURS) -> torch.Tensor:
    rows = x.shape[0]
    kernel = config.linear_conv_kernel_dim
    heads = config.linear_num_value_heads
    mixed, z, b, a = projections(x, w.inputs, None, (config.linear_conv_width,
                                                     config.linear_value_width, heads, heads),
                                 (w.qkv, w.z, w.b, w.a))
    z = z.reshape(rows, heads, config.linear_value_head_dim)
    beta = torch.sigmoid(b).float()  # [rows, v_heads]
    g = -w.a_log.float().exp() * F.softplus(a.float() + w.dt_bias.float())
    core = torch.empty(rows, config.linear_num_value_heads, config.linear_value_head_dim,
                       dtype=torch.float32, device=x.device)

    if index.single_rows.numel():
        singles = index.single_rows
        if index.verify_steps is None:  # one row a slot: one decode step
            slots = index.single_slots
            fresh = index.positions[singles] == 0  # a stream's first row reads no state
            conv_state, delta_state = recurrent.read(layer, slots, fresh)
            out, conv_state, delta_state = _decode_step(mixed[singles], g[singles],
                                                        beta[singles], conv_state,
                                                        delta_state, w, config, kernels)
            recurrent.write(layer, slots, conv_state, delta_state)
            core[singles] = out
        else:
            core[singles] = _verify_steps(mixed[singles], g[singles], beta[singles],
                                          index.positions[singles], index.single_slots,
                                          index.verify_steps, w, config, recurrent, layer,
                                          kernels)
    for span in index.spans:
        slot = torch.tensor([span.slot], device=x.device)
        fresh = torch.tensor([span.first == 0], device=x.device)
        conv_state, delta_state = recurrent.read(layer, slot, fresh)
        rows_in = mixed[span.start:span.stop].transpose(0, 1)[None]  # [1, width, L]
        window = torch.cat((conv_state, rows_in), dim=-1)  # [1, width, kernel - 1 + L]
        conv_out = _conv(window.to(w.conv.dtype), w.conv)[0].transpose(0, 1)  # [L, width]
        q, k, v = split_qkv(conv_out, config)
        q, k = gated_delta.prepare(q, k, config.linear_num_value_heads)
        out, final = kernels.chunked(q, k, v, g[span.start:span.stop],
                                     beta[span.start:span.stop], delta_state[0])
        recurrent.write(layer, slot, window[:, :, window.shape[-1] - (kernel - 1):],
                        final[None])
        core[span.start:span.stop] = out
    out = gated_rms_norm(core.to(x.dtype), z, w.norm, config.rms_norm_eps)
    return F.linear(out.reshape(rows, config.linear_value_width), w.out)


def _decode_step(mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 conv_state: torch.Tensor, delta_state: torch.Tensor, w: DeltaNetWeights,
                 config: ModelConfig, kernels: DeltaKernels,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token of n slots: mixed [n, width] (the rows' q, k, v before the conv), g, beta
    [n, heads], their slots' conv [n, width, kernel - 1] and delta [n, heads, k_dim, v_dim]
    states. Returns (out [n, heads, v_dim], the conv and delta states after it)."""
    window = torch.cat((conv_state, mixed[:, :, None]), dim=-1)  # [n, width, kernel]
    conv_out = _conv(window.to(w.conv.dtype), w.conv)[:, :, -1]  # [n, width]
    q, k, v = split_qkv(conv_out, config)
    q, k = gated_delta.prepare(q, k, config.linear_num_value_heads)
    out, delta_state = kernels.step(q, k, v, g, beta, delta_state)
    return out, window[:, :, 1:], delta_state


def _verify_steps(mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  positions: torch.Tensor, slots_of_rows: torch.Tensor, steps: VerifySteps,
                  w: DeltaNetWeights, config: ModelConfig, recurrent: RecurrentState,
                  layer: int, kernels: DeltaKernels) -> torch.Tensor:
    """Single rows of which some slots hold several (verify entries'), all given in the
    singles' order: row j of every slot runs as one decode step, and the state after it
    is kept (`keep_rows`), so the next entry may keep any prefix of a verify entry. A slot
    with fewer rows repeats its last, its state and output left as they were. The
    recurrence is a decode row's, step by step: the chunked form would give the last row's
    state alone, and other bits than decode rows give. Device tensors only: capturable.
    Returns out [n, heads, v_dim]."""
    slots = slots_of_rows[steps.first]  # [m], each slot once
    out = torch.empty(mixed.shape[0], config.linear_num_value_heads,
                      config.linear_value_head_dim, dtype=torch.float32, device=mixed.device)
    for step, (rows, valid) in enumerate(zip(steps.rows, steps.valid, strict=True)):
        fresh = (positions[rows] == 0) & valid  # a stream's first row reads no state
        conv_before, delta_before = recurrent.read(layer, slots, fresh)
        step_out, conv_after, delta_after = _decode_step(mixed[rows], g[rows], beta[rows],
                                                         conv_before, delta_before, w, config,
                                                         kernels)
        recurrent.write(layer, slots, torch.where(valid[:, None, None], conv_after, conv_before),
                        torch.where(valid[:, None, None, None], delta_after, delta_before))
        recurrent.keep_rows(layer, slots, step, conv_after, delta_after)
        out[rows] = torch.where(valid[:, None, None], step_out, out[rows])
    return out


class Qwen35Range:
    """Layers [start, end) of a Qwen3.5 hybrid, plus the ends when it is the first range.

    `cache` holds KV for this range's attention layers and recurrent state for its DeltaNet
    layers, each numbered in the range's order of its own type.
    """

    def __init__(self, config: ModelConfig, layer_range: tuple[int, int],
                 load: Callable[[dict[str, tuple[int, ...]]], dict[str, torch.Tensor]],
                 cache: HybridState, rope: Rope, on_layer: Callable[[int], None] | None = None,
                 kernels: DeltaKernels = OURS):
        self.config = config
        self.kernels = kernels  # the gated delta rule's: ours, or fla-core's on CUDA
        self.layer_range = layer_range
        self.cache = cache
        self.rope = rope
        self.layers, ends = load_range(config, layer_range, load, on_layer)
        self.embed, self.norm, self.head = ends
        self.state_index = state_indices(config, layer_range)

    @property
    def recurrent(self) -> RecurrentState:
        """The DeltaNet layers' per-slot state (what the CUDA graphs keep aside)."""
        return self.cache.recurrent

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.embed)  # [rows, hidden]

    def run_layers(self, x: torch.Tensor, index: RoundIndex) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        for w, slot in zip(self.layers, self.state_index, strict=True):
            h = rms_norm(x, w.input_norm, eps)
            if isinstance(w, DeltaNetWeights):
                h = deltanet(h, w, self.config, self.cache.recurrent, slot, index,
                             self.kernels)
            else:
                h = gated_attention(h, w, self.config, self.rope, self.cache, slot, index)
            x = x + h
            x = x + mlp(rms_norm(x, w.post_norm, eps), w)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        x = rms_norm(x, self.norm, self.config.rms_norm_eps)
        return F.linear(x, self.head).float()  # [rows, vocab]


def state_indices(config: ModelConfig, layer_range: tuple[int, int]) -> list[int]:
    """Each layer's index among the range's layers of its own type (its KV or recurrent slot)."""
    counts: dict[str, int] = {}
    out = []
    for layer in range(*layer_range):
        kind = config.layer_type(layer)
        out.append(counts.get(kind, 0))
        counts[kind] = out[-1] + 1
    return out


def layer_counts(config: ModelConfig, layer_range: tuple[int, int]) -> tuple[int, int]:
    """(full-attention layers, DeltaNet layers) in the range."""
    types = [config.layer_type(layer) for layer in range(*layer_range)]
    linear = types.count(LINEAR_ATTENTION)
    return len(types) - linear, linear


def build_range(config: ModelConfig, spec: StageSpec,
                load: Callable[[dict[str, tuple[int, ...]]], dict[str, torch.Tensor]],
                device: torch.device, dtype: torch.dtype,
                on_layer: Callable[[int], None] | None = None) -> Qwen35Range:
    """The stage's range, KV for its attention layers and recurrent state for its DeltaNet
    layers: this family's entry for the PyTorch stage."""
    attention_layers, deltanet_layers = layer_counts(config, spec.layer_range)
    cache = KVCache(attention_layers, spec.parallel, config.num_key_value_heads,
                    spec.context, config.head_dim, dtype, device, pages=spec.kv_pages)
    rope = Rope(config, spec.context, device, dtype)
    with torch.inference_mode():
        state = HybridState(cache, RecurrentState(config, deltanet_layers, spec.parallel,
                                                  dtype, device, spec.verify_states))
        kernels = delta_kernels.choose(device, spec.delta_kernel)
        return Qwen35Range(config, spec.layer_range, load, state, rope, on_layer, kernels)

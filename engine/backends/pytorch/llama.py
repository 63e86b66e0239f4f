"""The Llama-style dense decoder (Llama, Mistral, Qwen2, Qwen3) on PyTorch, one layer range.

A range keeps global layer indices, so weight names never change; the first range (rank 0)
also holds the embeddings, the final norm and the head. Every op follows transformers'
order and precision (RMSNorm in float32, RoPE tables in float32, residual adds in the
model's dtype) so that float32 logits match it closely.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.backends.pytorch.kv_cache import (
    KVCache,
    RoundIndex,
    decode_kernel_runs,
    in_order,
    located,
    visible_keys,
)
from engine.backends.pytorch.stacked import projections
from engine.config import ModelConfig, rope_inv_freq
from engine.family import DeltaNetWeights, LayerWeights, load_range
from engine.kv_pages import pages_for

if TYPE_CHECKING:
    from engine.backends.base import StageSpec


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rope:
    """cos / sin tables for every position up to the context, built once in float32."""

    def __init__(self, config: ModelConfig, context: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        inv_freq = torch.tensor(rope_inv_freq(config), dtype=torch.float32, device=device)
        positions = torch.arange(context, dtype=torch.float32, device=device)
        freqs = positions[:, None] * inv_freq[None, :]
        table = torch.cat((freqs, freqs), dim=-1)  # [context, head_dim]
        self.cos = table.cos().to(dtype)
        self.sin = table.sin().to(dtype)


def attention_inputs(x: torch.Tensor, w: LayerWeights, config: ModelConfig,
                     cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer up to its attention: the input norm, then q, k and v ([rows, heads,
    head_dim] each) with the q/k norms and the rotary embedding at each row's position
    (`cos`, `sin`: the tables [context, head_dim])."""
    rows, d, eps = x.shape[0], config.head_dim, config.rms_norm_eps
    h = rms_norm(x, w.input_norm, eps)
    kv_width = config.num_key_value_heads * d
    q, k, v = projections(h, w.qkv, w.qkv_bias, (config.q_width, kv_width, kv_width),
                          (w.q, w.k, w.v), (w.q_bias, w.k_bias, w.v_bias))
    q = q.view(rows, config.num_attention_heads, d)
    k = k.view(rows, config.num_key_value_heads, d)
    v = v.view(rows, config.num_key_value_heads, d)
    if w.q_norm is not None:
        q = rms_norm(q, w.q_norm, eps)
        k = rms_norm(k, w.k_norm, eps)
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s, v


def layer_output(x: torch.Tensor, o: torch.Tensor, w: LayerWeights, config: ModelConfig
                 ) -> torch.Tensor:
    """A layer after its attention: o [rows, heads, head_dim] projected onto the residual,
    then the MLP's part."""
    x = x + F.linear(o.reshape(x.shape[0], config.q_width), w.o)
    return x + mlp(rms_norm(x, w.post_norm, config.rms_norm_eps), w)


def mlp(x: torch.Tensor, w: LayerWeights | DeltaNetWeights) -> torch.Tensor:
    width = w.down.shape[1]
    gate, up = projections(x, w.gate_up, None, (width, width), (w.gate, w.up))
    return F.linear(F.silu(gate) * up, w.down)


@dataclass(frozen=True)
class LayerParts:
    """The two halves of a layer around its attention, as a stage runs them: as written
    here, or compiled (`compiled_step.compiled_layer_parts`), which fuses each half's norms,
    rotary, activation and residual adds; the attention and the cache stay eager."""

    inputs: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = attention_inputs
    output: Callable[..., torch.Tensor] = layer_output


def block(x: torch.Tensor, w: LayerWeights, config: ModelConfig, rope: Rope, cache: KVCache,
          layer_slot: int, index: RoundIndex, parts: LayerParts = LayerParts()
          ) -> torch.Tensor:
    q, k, v = parts.inputs(x, w, config, rope.cos, rope.sin, index.positions)
    cache.write(layer_slot, index, k, v)
    return parts.output(x, cache.attend(layer_slot, index, q), w, config)


def decode_block(x: torch.Tensor, w: LayerWeights, config: ModelConfig, cos: torch.Tensor,
                 sin: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                 pages: torch.Tensor, positions: torch.Tensor, kernel: bool = False,
                 offsets: torch.Tensor | None = None) -> torch.Tensor:
    """One layer of a decode round over a run of consecutive slots: `block`'s math with
    every input a tensor (no round index, no layer number), so that one compiled graph
    serves every layer and every round of a shape (`compiled_step.py`).

    x: [n, hidden]; k_pages, v_pages: this layer's pages [pages, kv_heads, page, head_dim]
    (written in place); pages: [slots, p], the run's rows of the page table cut to the p
    pages that hold the keys the rows read, [0, p x page); positions: [n]; cos, sin: the
    RoPE tables [context, head_dim]; offsets: [n], each row's slot in the run where rows
    share slots (a verify entry's rows), None: one row a slot, in order (whether they share
    is this argument, not a comparison of sizes, so that the compiled layer takes every size
    as symbolic: `compiled_step.py`). kernel: attention through the Triton decode kernel
    (CUDA, `kv_cache.decode_kernel_runs`) instead of SDPA under a mask.
    """
    # Sizes that are equal, said so for the compiled layer, which takes each as a symbol of
    # its own (compiled_step.py); eagerly these are plain comparisons.
    torch._check(positions.shape[0] == x.shape[0])
    torch._check(v_pages.shape[0] == k_pages.shape[0])
    q, k, v = attention_inputs(x, w, config, cos, sin, positions)
    if offsets is None:
        offsets = torch.arange(x.shape[0], device=x.device)
    else:
        torch._check(offsets.shape[0] == x.shape[0])
    keys = pages.shape[1] * k_pages.shape[2]
    torch._check(keys > 0)
    at, within = located(pages, offsets, positions)
    k_pages[at, :, within] = k  # every row's, before any row attends
    v_pages[at, :, within] = v
    if kernel:  # each row reads keys [0, its position] through the table, no copy
        o = torch.ops.ringfleet.decode_attention(q, k_pages, v_pages, pages, offsets,
                                                 positions + 1, keys, config.sliding_window)
    else:
        # SDPA's own grouped heads, not kv_cache.attend_one_row_each: Inductor compiles this
        # form without the math kernel's copies, and the rows form here made an 8B's step
        # after 8,000-token conversations 2x slower on an H200 (docs/benchmarks.md, "36
        # layers").
        mask = visible_keys(positions[:, None], keys, config.sliding_window)[:, None, None, :]
        rows_pages = pages[offsets]
        o = F.scaled_dot_product_attention(q[:, :, None, :], in_order(k_pages, rows_pages, keys),
                                           in_order(v_pages, rows_pages, keys),
                                           attn_mask=mask, enable_gqa=True)
    return layer_output(x, o, w, config)


DecodeBlock = Callable[..., torch.Tensor]  # decode_block, or its compiled form


class LlamaRange:
    """Layers [start, end) of a Llama-style model, plus the ends when it is the first range."""

    recurrent = None  # no per-slot recurrent state: every layer keeps KV only

    def __init__(self, config: ModelConfig, layer_range: tuple[int, int],
                 load: Callable[[dict[str, tuple[int, ...]]], dict[str, torch.Tensor]],
                 cache: KVCache, rope: Rope, on_layer: Callable[[int], None] | None = None):
        self.config = config
        self.layer_range = layer_range
        self.cache = cache
        self.rope = rope
        self.layers, ends = load_range(config, layer_range, load, on_layer)
        self.embed, self.norm, self.head = ends
        self.parts = LayerParts()  # a compiling stage sets compiled ones

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.embed)  # [rows, hidden]

    def run_layers(self, x: torch.Tensor, index: RoundIndex) -> torch.Tensor:
        for layer_slot, w in enumerate(self.layers):
            x = block(x, w, self.config, self.rope, self.cache, layer_slot, index, self.parts)
        return x

    def run_decode(self, x: torch.Tensor, positions: torch.Tensor, run: tuple[int, int],
                   keys: int, step: DecodeBlock = decode_block, *,
                   offsets: torch.Tensor | None = None) -> torch.Tensor:
        """A decode round of the slots in `run` [a, b), each row at `positions` in slot
        a + `offsets` (None: one row a slot), its rows reading keys [0, keys) (under the
        model's sliding window, if any), layer by layer through `step` (compiled or not).
        Device tensors only, no host values: it can be captured in a CUDA graph."""
        a, b = run
        # Whole pages of keys (a graph's bucket already is): the keys past a row's position
        # weigh nothing under its mask, and the kernel reads none of them.
        pages = self.cache.table[a:b, :pages_for(keys)]  # a view: a graph reads it at replay
        kernel = decode_kernel_runs(x.device)  # True once the operator's module imported
        if x.shape[0] == b - a:  # one row a slot, in order
            offsets = None
        for layer_slot, w in enumerate(self.layers):
            x = step(x, w, self.config, self.rope.cos, self.rope.sin, self.cache.k[layer_slot],
                     self.cache.v[layer_slot], pages, positions, kernel, offsets)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        x = rms_norm(x, self.norm, self.config.rms_norm_eps)
        return F.linear(x, self.head).float()  # [rows, vocab]


def build_range(config: ModelConfig, spec: StageSpec,
                load: Callable[[dict[str, tuple[int, ...]]], dict[str, torch.Tensor]],
                device: torch.device, dtype: torch.dtype,
                on_layer: Callable[[int], None] | None = None) -> LlamaRange:
    """The stage's range and its KV cache: this family's entry for the PyTorch stage."""
    layers = spec.layer_range[1] - spec.layer_range[0]
    cache = KVCache(layers, spec.parallel, config.num_key_value_heads, spec.context,
                    config.head_dim, dtype, device, pages=spec.kv_pages)
    rope = Rope(config, spec.context, device, dtype)
    with torch.inference_mode():
        return LlamaRange(config, spec.layer_range, load, cache, rope, on_layer)

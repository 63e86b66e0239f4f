"""The Qwen3.5 MTP head on MLX: the draft head (engine.draft_head) of a hybrid's rank 0.

The twin of the PyTorch head (engine/backends/pytorch/mtp_head.py), its maths the MLX
family file's: (1 + weight) norms shifted once at load so `mx.fast.rms_norm` runs them,
the gated full-attention layer with RoPE on the first `rotary_dim` channels, and a KV
cache of the head's own per slot, entries stored compactly (engine.draft_head).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from engine.backends.mlx.llama import linear, mlp
from engine.backends.mlx.quant import Weight
from engine.backends.mlx.qwen3_5 import one_plus
from engine.config import ModelConfig
from engine.family import DraftHeadWeights, LayerWeights, load_draft_head


class MtpHead:
    """The head's weights, its KV cache [layers, slots, context, kv heads, head dim] and
    each slot's entry count; `model` is the first stage's range (embeddings, final norm,
    head, rotary), which the head shares."""

    def __init__(self, config: ModelConfig, weights: DraftHeadWeights[Weight], model: Any,
                 parallel: int, context: int, dtype: mx.Dtype) -> None:
        self.config = config
        self.model = model
        weights.embed_norm = one_plus(weights.embed_norm)
        weights.hidden_norm = one_plus(weights.hidden_norm)
        weights.norm = one_plus(weights.norm)
        for w in weights.layers:
            for name in ("input_norm", "post_norm", "q_norm", "k_norm"):
                setattr(w, name, one_plus(getattr(w, name)))
        self.w = weights
        shape = (len(weights.layers), parallel, context, config.num_key_value_heads,
                 config.head_dim)
        self.k = mx.zeros(shape, dtype=dtype)
        self.v = mx.zeros(shape, dtype=dtype)
        self.count = [0] * parallel  # entries each slot holds
        arrays = _arrays(weights)
        mx.eval(arrays, self.k, self.v)
        self.nbytes = sum(a.nbytes for a in arrays) + self.k.nbytes + self.v.nbytes

    @classmethod
    def load(cls, config: ModelConfig,
             load: Callable[[dict[str, tuple[int, ...]]], dict[str, Weight]], model: Any,
             parallel: int, context: int, dtype: mx.Dtype) -> MtpHead:
        return cls(config, load_draft_head(config, load), model, parallel, context, dtype)

    def normed(self, rows: mx.array) -> mx.array:
        return mx.fast.rms_norm(rows, self.model.norm, self.config.rms_norm_eps)

    def draft(self, slot: int, kept: int, hidden: mx.array, rows: Sequence[int],
              tokens: Sequence[int], position: int, count: int) -> tuple[int, ...]:
        self.count[slot] = kept
        h = hidden[mx.array(list(rows), dtype=mx.int32)]
        out = self.forward(slot, h, mx.array(list(tokens), dtype=mx.int32), position)[-1:]
        position += len(tokens)
        drafts: list[int] = []
        for step in range(count):
            token = mx.argmax(self.logits(out), axis=-1)  # [1]
            drafts.append(int(token.item()))
            if step + 1 < count:
                out = self.forward(slot, out, token.astype(mx.int32), position)
                position += 1
        mx.eval(self.k, self.v)
        return tuple(drafts)

    def logits(self, out: mx.array) -> mx.array:
        """The model's head over the head's output rows: [rows, vocab] float32."""
        return linear(out, self.model.head).astype(mx.float32)

    def forward(self, slot: int, hidden: mx.array, token_ids: mx.array,
                position: int) -> mx.array:
        """Rows [n, hidden] (normed) and their next tokens [n], the first at `position`:
        the head's output rows [n, hidden] after `mtp.norm`, their entries written."""
        eps = self.config.rms_norm_eps
        e = mx.fast.rms_norm(self.model.embed_tokens(token_ids), self.w.embed_norm, eps)
        h = mx.fast.rms_norm(hidden, self.w.hidden_norm, eps)
        x = linear(mx.concatenate((e, h), axis=-1), self.w.fc)
        positions = mx.arange(position, position + token_ids.shape[0], dtype=mx.int32)
        for layer, w in enumerate(self.w.layers):
            x = x + self._attention(layer, slot, mx.fast.rms_norm(x, w.input_norm, eps), w,
                                    positions)
            x = x + mlp(mx.fast.rms_norm(x, w.post_norm, eps), w)
        self.count[slot] += token_ids.shape[0]
        return mx.fast.rms_norm(x, self.w.norm, eps)

    def _attention(self, layer: int, slot: int, x: mx.array, w: LayerWeights,
                   positions: mx.array) -> mx.array:
        c = self.config
        rows, d, heads = x.shape[0], c.head_dim, c.num_attention_heads
        q_and_gate = linear(x, w.q).reshape(rows, heads, 2 * d)
        q, gate = q_and_gate[..., :d], q_and_gate[..., d:].reshape(rows, heads * d)
        k = linear(x, w.k).reshape(rows, c.num_key_value_heads, d)
        v = linear(x, w.v).reshape(rows, c.num_key_value_heads, d)
        rope = self.model.rope
        q = rope.apply(mx.fast.rms_norm(q, w.q_norm, c.rms_norm_eps), positions)
        k = rope.apply(mx.fast.rms_norm(k, w.k_norm, c.rms_norm_eps), positions)
        start = self.count[slot]
        end = start + rows
        if end > self.k.shape[2]:
            raise ValueError(f"the draft head's cache holds {self.k.shape[2]} entries a slot; "
                             f"slot {slot} would need {end}")
        self.k[layer, slot, start:end] = k.astype(self.k.dtype)
        self.v[layer, slot, start:end] = v.astype(self.v.dtype)
        keys = self.k[layer, slot, :end].transpose(1, 0, 2)[None]  # [1, kv heads, end, d]
        values = self.v[layer, slot, :end].transpose(1, 0, 2)[None]
        # row i (entry start + i) sees entries up to its own
        mask = mx.arange(end)[None, :] <= (start + mx.arange(rows))[:, None]
        out = mx.fast.scaled_dot_product_attention(q.transpose(1, 0, 2)[None], keys, values,
                                                   scale=d ** -0.5, mask=mask)
        out = out[0].transpose(1, 0, 2).reshape(rows, heads * d)
        return linear(out * mx.sigmoid(gate), w.o)


def _arrays(w: DraftHeadWeights[Weight]) -> list[mx.array]:
    out = [a for a in (w.fc, w.embed_norm, w.hidden_norm, w.norm) if isinstance(a, mx.array)]
    for layer in w.layers:
        out += [a for a in vars(layer).values() if isinstance(a, mx.array)]
    return out

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
from engine.draft_head import DraftAsk, SlotGroups, draft_in_batches, next_entries
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

    def draft(self, asks: Sequence[DraftAsk]) -> list[tuple[int, ...]]:
        drafts = draft_in_batches(self, asks)
        mx.eval(self.k, self.v)
        return drafts

    # The draft loop's array operations (engine.draft_head.HeadSteps).
    def fed_rows(self, asks: Sequence[DraftAsk]) -> mx.array:
        return mx.concatenate([a.hidden[self.ids(a.rows)] for a in asks])

    def ids(self, values: Sequence[int]) -> mx.array:
        return mx.array(list(values), dtype=mx.int32)

    def take(self, x: mx.array, indices: Sequence[int]) -> mx.array:
        return x[self.ids(indices)]

    def greedy(self, out: mx.array) -> mx.array:
        return mx.argmax(self.logits(out), axis=-1).astype(mx.int32)

    def logits(self, out: mx.array) -> mx.array:
        """The model's head over the head's output rows: [rows, vocab] float32."""
        return linear(out, self.model.head).astype(mx.float32)

    def forward(self, slots: Sequence[int], hidden: mx.array, token_ids: mx.array,
                positions: Sequence[int]) -> mx.array:
        """Rows [n, hidden] (normed), each of slot `slots[i]` at `positions[i]`, and their
        next tokens [n]: the head's output rows [n, hidden] after `mtp.norm`. Each row's entry
        is written after its slot's last (rows of one slot in order), and it attends over
        its slot's entries up to its own."""
        eps = self.config.rms_norm_eps
        entries = next_entries(self.count, slots, self.k.shape[2])
        groups = SlotGroups.of(slots)
        padded = [[0] * groups.most for _ in groups.slots]  # a padding row sees entry 0
        for g, j, entry in zip(groups.group, groups.within, entries, strict=True):
            padded[g][j] = entry
        # slot, entry, rotary position [rows]; the span of entries; the rows grouped by slot
        # (engine.draft_head.SlotGroups): the slots, each row's slot and place among its
        # slot's rows, each place's entry [slots, most rows]
        at = (self.ids(slots), self.ids(entries), self.ids(positions), max(entries) + 1,
              self.ids(groups.slots), self.ids(groups.group), self.ids(groups.within),
              mx.array(padded, dtype=mx.int32))
        e = mx.fast.rms_norm(self.model.embed_tokens(token_ids), self.w.embed_norm, eps)
        h = mx.fast.rms_norm(hidden, self.w.hidden_norm, eps)
        x = linear(mx.concatenate((e, h), axis=-1), self.w.fc)
        for layer, w in enumerate(self.w.layers):
            x = x + self._attention(layer, mx.fast.rms_norm(x, w.input_norm, eps), w, at)
            x = x + mlp(mx.fast.rms_norm(x, w.post_norm, eps), w)
        return mx.fast.rms_norm(x, self.w.norm, eps)

    def _attention(self, layer: int, x: mx.array, w: LayerWeights, at: tuple) -> mx.array:
        c = self.config
        slots, entries, positions, span, group_slots, group, within, padded = at
        rows, d, heads = x.shape[0], c.head_dim, c.num_attention_heads
        q_and_gate = linear(x, w.q).reshape(rows, heads, 2 * d)
        q, gate = q_and_gate[..., :d], q_and_gate[..., d:].reshape(rows, heads * d)
        k = linear(x, w.k).reshape(rows, c.num_key_value_heads, d)
        v = linear(x, w.v).reshape(rows, c.num_key_value_heads, d)
        rope = self.model.rope
        q = rope.apply(mx.fast.rms_norm(q, w.q_norm, c.rms_norm_eps), positions)
        k = rope.apply(mx.fast.rms_norm(k, w.k_norm, c.rms_norm_eps), positions)
        # Every row's K and V first, so rows of one slot see the earlier rows of the call.
        self.k[layer, slots, entries] = k.astype(self.k.dtype)
        self.v[layer, slots, entries] = v.astype(self.v.dtype)
        # [slots, kv heads, span, d]: each slot's entries, once for all its rows
        keys = self.k[layer, group_slots, :span].transpose(0, 2, 1, 3)
        values = self.v[layer, group_slots, :span].transpose(0, 2, 1, 3)
        queries = mx.zeros((len(group_slots), padded.shape[1], heads, d), dtype=q.dtype)
        queries[group, within] = q  # [slots, most rows, heads, d]
        # [slots, most rows, span]: each row sees its slot's entries up to its own
        seen = mx.arange(span)[None, None, :] <= padded[:, :, None]
        out = mx.fast.scaled_dot_product_attention(queries.transpose(0, 2, 1, 3), keys,
                                                   values, scale=d ** -0.5,
                                                   mask=seen[:, None])
        # [slots, heads, most rows, d] -> [rows, q width]
        out = out.transpose(0, 2, 1, 3)[group, within].reshape(rows, heads * d)
        return linear(out * mx.sigmoid(gate), w.o)


def _arrays(w: DraftHeadWeights[Weight]) -> list[mx.array]:
    out = [a for a in (w.fc, w.embed_norm, w.hidden_norm, w.norm) if isinstance(a, mx.array)]
    for layer in w.layers:
        out += [a for a in vars(layer).values() if isinstance(a, mx.array)]
    return out

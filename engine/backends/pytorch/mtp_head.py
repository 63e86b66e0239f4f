"""The Qwen3.5 MTP head on PyTorch: the draft head (engine.draft_head) of a hybrid's rank 0.

fc([pre_fc_norm_embedding(embed(token)); pre_fc_norm_hidden(hidden)]) -> the model's gated
full-attention decoder layer (its own weights, `mtp.layers.0.`) -> `mtp.norm` -> the
model's head. Norms are the family's (1 + weight); the layer is the family's attention
layer, over a KV cache of the head's own per slot whose entries are stored compactly
(engine.draft_head says why). Float32 where transformers' components compute in float32.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.backends.pytorch.llama import Rope, mlp
from engine.backends.pytorch.qwen3_5 import partial_rope, rms_norm
from engine.config import ModelConfig
from engine.draft_head import DraftAsk
from engine.family import DraftHeadWeights, LayerWeights, load_draft_head


class MtpHead:
    """The head's weights, its KV cache [layers, slots, context, kv heads, head dim] and
    each slot's entry count."""

    def __init__(self, config: ModelConfig, weights: DraftHeadWeights[torch.Tensor],
                 embed: torch.Tensor, head: torch.Tensor, final_norm: torch.Tensor,
                 rope: Rope, parallel: int, context: int) -> None:
        self.config = config
        self.w = weights
        self.embed, self.head, self.final_norm = embed, head, final_norm
        self.rope = rope
        shape = (len(weights.layers), parallel, context, config.num_key_value_heads,
                 config.head_dim)
        self.k = torch.zeros(shape, dtype=embed.dtype, device=embed.device)
        self.v = torch.zeros_like(self.k)
        self.count = [0] * parallel  # entries each slot holds
        weights_bytes = sum(t.numel() * t.element_size() for t in _tensors(weights))
        self.nbytes = weights_bytes + 2 * self.k.numel() * self.k.element_size()

    @classmethod
    def load(cls, config: ModelConfig,
             load: Callable[[dict[str, tuple[int, ...]]], dict[str, torch.Tensor]],
             embed: torch.Tensor, head: torch.Tensor, final_norm: torch.Tensor, rope: Rope,
             parallel: int, context: int) -> MtpHead:
        return cls(config, load_draft_head(config, load), embed, head, final_norm, rope,
                   parallel, context)

    def normed(self, rows: torch.Tensor) -> torch.Tensor:
        return rms_norm(rows, self.final_norm, self.config.rms_norm_eps)

    def draft(self, asks: Sequence[DraftAsk]) -> list[tuple[int, ...]]:
        if not asks:
            return []
        device = self.embed.device
        for a in asks:  # each slot's cache back to the stream's own rows
            self.count[a.slot] = a.kept
        # Every stream's rows in one batch, each stream's in order after its kept entries.
        h = torch.cat([a.hidden[torch.tensor(a.rows, dtype=torch.int64, device=device)]
                       for a in asks])
        token_ids = torch.tensor([t for a in asks for t in a.tokens], dtype=torch.int64,
                                 device=device)
        fed = self.forward([a.slot for a in asks for _ in a.tokens], h, token_ids,
                           [p for a in asks for p in range(a.position,
                                                           a.position + len(a.tokens))])
        ends = list(itertools.accumulate(len(a.tokens) for a in asks))
        next_position = [a.position + len(a.tokens) for a in asks]
        drafts: list[list[int]] = [[] for _ in asks]
        live = [i for i, a in enumerate(asks) if a.count > 0]
        out = fed[torch.tensor([ends[i] - 1 for i in live], dtype=torch.int64, device=device)]
        step = 0
        while live:  # step j of every stream still drafting, as one batch of rows
            tokens = self.logits(out).argmax(-1)  # [streams]
            for i, token in zip(live, tokens.tolist(), strict=True):
                drafts[i].append(token)
            step += 1
            going = [j for j, i in enumerate(live) if asks[i].count > step]
            if not going:
                break
            pick = torch.tensor(going, dtype=torch.int64, device=device)
            live = [live[j] for j in going]
            out = self.forward([asks[i].slot for i in live], out[pick], tokens[pick],
                               [next_position[i] + step - 1 for i in live])
        return [tuple(d) for d in drafts]

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The model's head over the head's output rows: [rows, vocab] float32."""
        return F.linear(out, self.head).float()

    def forward(self, slots: Sequence[int], hidden: torch.Tensor, token_ids: torch.Tensor,
                positions: Sequence[int]) -> torch.Tensor:
        """Rows [n, hidden] (normed), each of slot `slots[i]` at `positions[i]`, and their
        next tokens [n]: the head's output rows [n, hidden] after `mtp.norm`. Each row's entry
        is written after its slot's last (rows of one slot in order), and it attends over
        its slot's entries up to its own."""
        eps = self.config.rms_norm_eps
        entries = []  # each row's entry index in its slot's cache
        for slot in slots:
            entries.append(self.count[slot])
            self.count[slot] += 1
        if max(entries) >= self.k.shape[2]:
            raise ValueError(f"the draft head's cache holds {self.k.shape[2]} entries a slot; "
                             f"a row would be entry {max(entries)}")
        device = hidden.device
        at = _RowsAt(torch.tensor(list(slots), dtype=torch.int64, device=device),
                     torch.tensor(entries, dtype=torch.int64, device=device),
                     torch.tensor(list(positions), dtype=torch.int64, device=device),
                     max(entries) + 1)
        e = rms_norm(F.embedding(token_ids, self.embed), self.w.embed_norm, eps)
        x = F.linear(torch.cat((e, rms_norm(hidden, self.w.hidden_norm, eps)), dim=-1),
                     self.w.fc)
        for layer, w in enumerate(self.w.layers):
            x = x + self._attention(layer, rms_norm(x, w.input_norm, eps), w, at)
            x = x + mlp(rms_norm(x, w.post_norm, eps), w)
        return rms_norm(x, self.w.norm, eps)

    def _attention(self, layer: int, x: torch.Tensor, w: LayerWeights,
                   at: _RowsAt) -> torch.Tensor:
        c = self.config
        rows, d, eps = x.shape[0], c.head_dim, c.rms_norm_eps
        q, gate = F.linear(x, w.q).view(rows, c.num_attention_heads, 2 * d).chunk(2, dim=-1)
        k = F.linear(x, w.k).view(rows, c.num_key_value_heads, d)
        v = F.linear(x, w.v).view(rows, c.num_key_value_heads, d)
        q = partial_rope(rms_norm(q, w.q_norm, eps), self.rope, at.positions)
        k = partial_rope(rms_norm(k, w.k_norm, eps), self.rope, at.positions)
        # Every row's K and V first, so rows of one slot see the earlier rows of the call.
        self.k[layer, at.slots, at.entries] = k
        self.v[layer, at.slots, at.entries] = v
        groups = c.num_attention_heads // c.num_key_value_heads
        # [rows, heads, span, d]: each row's slot's entries
        keys = self.k[layer, at.slots, :at.span].transpose(1, 2).repeat_interleave(groups, 1)
        values = self.v[layer, at.slots, :at.span].transpose(1, 2).repeat_interleave(groups, 1)
        seen = torch.arange(at.span, device=x.device)[None, :] <= at.entries[:, None]
        out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values,
                                             attn_mask=seen[:, None, None, :],
                                             scale=d ** -0.5)  # [rows, heads, 1, d]
        out = out.reshape(rows, c.q_width)
        return F.linear(out * torch.sigmoid(gate.reshape(rows, c.q_width)), w.o)


@dataclass(frozen=True)
class _RowsAt:
    """Where a call's rows sit: slot, entry in the slot's cache, rotary position [rows]
    each, and the longest span of entries a row attends over."""

    slots: torch.Tensor
    entries: torch.Tensor
    positions: torch.Tensor
    span: int


def _tensors(w: DraftHeadWeights[torch.Tensor]) -> list[torch.Tensor]:
    out = [w.fc, w.embed_norm, w.hidden_norm, w.norm]
    for layer in w.layers:
        out += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    return out

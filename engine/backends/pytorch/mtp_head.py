"""The Qwen3.5 MTP head on PyTorch: the draft head (engine.draft_head) of a hybrid's rank 0.

fc([pre_fc_norm_embedding(embed(token)); pre_fc_norm_hidden(hidden)]) -> the model's gated
full-attention decoder layer (its own weights, `mtp.layers.0.`) -> `mtp.norm` -> the
model's head. Norms are the family's (1 + weight); the layer is the family's attention
layer, over a KV cache of the head's own per slot whose entries are stored compactly
(engine.draft_head says why). Float32 where transformers' components compute in float32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from engine.backends.pytorch.llama import Rope, mlp
from engine.backends.pytorch.qwen3_5 import partial_rope, rms_norm
from engine.config import ModelConfig
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

    def draft(self, slot: int, kept: int, hidden: torch.Tensor, rows: Sequence[int],
              tokens: Sequence[int], position: int, count: int) -> tuple[int, ...]:
        device = self.embed.device
        self.count[slot] = kept
        h = hidden[torch.tensor(list(rows), dtype=torch.int64, device=device)]
        token_ids = torch.tensor(list(tokens), dtype=torch.int64, device=device)
        out = self.forward(slot, h, token_ids, position)[-1:]  # [1, hidden]
        position += len(tokens)
        drafts: list[int] = []
        for step in range(count):
            token = self.logits(out).argmax(-1)  # [1]
            drafts.append(int(token))
            if step + 1 < count:
                out = self.forward(slot, out, token, position)
                position += 1
        return tuple(drafts)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The model's head over the head's output rows: [rows, vocab] float32."""
        return F.linear(out, self.head).float()

    def forward(self, slot: int, hidden: torch.Tensor, token_ids: torch.Tensor,
                position: int) -> torch.Tensor:
        """Rows [n, hidden] (normed) and their next tokens [n], the first at `position`:
        the head's output rows [n, hidden] after `mtp.norm`, their entries written."""
        eps = self.config.rms_norm_eps
        e = rms_norm(F.embedding(token_ids, self.embed), self.w.embed_norm, eps)
        x = F.linear(torch.cat((e, rms_norm(hidden, self.w.hidden_norm, eps)), dim=-1),
                     self.w.fc)
        positions = torch.arange(position, position + len(token_ids), device=x.device)
        for layer, w in enumerate(self.w.layers):
            x = x + self._attention(layer, slot, rms_norm(x, w.input_norm, eps), w, positions)
            x = x + mlp(rms_norm(x, w.post_norm, eps), w)
        self.count[slot] += len(token_ids)
        return rms_norm(x, self.w.norm, eps)

    def _attention(self, layer: int, slot: int, x: torch.Tensor, w: LayerWeights,
                   positions: torch.Tensor) -> torch.Tensor:
        c = self.config
        rows, d, eps = x.shape[0], c.head_dim, c.rms_norm_eps
        q, gate = F.linear(x, w.q).view(rows, c.num_attention_heads, 2 * d).chunk(2, dim=-1)
        k = F.linear(x, w.k).view(rows, c.num_key_value_heads, d)
        v = F.linear(x, w.v).view(rows, c.num_key_value_heads, d)
        q = partial_rope(rms_norm(q, w.q_norm, eps), self.rope, positions)
        k = partial_rope(rms_norm(k, w.k_norm, eps), self.rope, positions)
        start = self.count[slot]
        end = start + rows
        if end > self.k.shape[2]:
            raise ValueError(f"the draft head's cache holds {self.k.shape[2]} entries a slot; "
                             f"slot {slot} would need {end}")
        self.k[layer, slot, start:end] = k
        self.v[layer, slot, start:end] = v
        keys = self.k[layer, slot, :end].transpose(0, 1)  # [kv heads, end, d]
        values = self.v[layer, slot, :end].transpose(0, 1)
        groups = c.num_attention_heads // c.num_key_value_heads
        keys = keys.repeat_interleave(groups, dim=0)
        values = values.repeat_interleave(groups, dim=0)
        # row i (entry start + i) sees entries up to its own
        mask = (torch.arange(end, device=x.device)[None, :]
                <= (start + torch.arange(rows, device=x.device))[:, None])
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask,
                                             scale=d ** -0.5)  # [heads, rows, d]
        out = out.transpose(0, 1).reshape(rows, c.q_width)
        return F.linear(out * torch.sigmoid(gate.reshape(rows, c.q_width)), w.o)


def _tensors(w: DraftHeadWeights[torch.Tensor]) -> list[torch.Tensor]:
    out = [w.fc, w.embed_norm, w.hidden_norm, w.norm]
    for layer in w.layers:
        out += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    return out

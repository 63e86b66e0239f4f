"""The Qwen3.5 MTP head on PyTorch: the draft head (engine.draft_head) of a hybrid's rank 0.

fc([pre_fc_norm_embedding(embed(token)); pre_fc_norm_hidden(hidden)]) -> the model's gated
full-attention decoder layer (its own weights, `mtp.layers.0.`) -> `mtp.norm` -> the
model's head. Norms are the family's (1 + weight); the layer is the family's attention
layer, over a KV cache of the head's own per slot whose entries are stored compactly
(engine.draft_head says why). Float32 where transformers' components compute in float32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.backends.pytorch import stacked
from engine.backends.pytorch.kv_cache import decode_kernel_runs
from engine.backends.pytorch.llama import Rope, mlp
from engine.backends.pytorch.qwen3_5 import attention_projections, partial_rope, rms_norm
from engine.backends.pytorch.sampling import on_device
from engine.config import ModelConfig
from engine.draft_head import DraftAsk, SlotGroups, draft_in_batches, next_entries
from engine.family import DraftHeadWeights, LayerWeights, load_draft_head


class MtpHead:
    """The head's weights, its KV cache [layers, slots, context, kv heads, head dim] and
    each slot's entry count."""

    def __init__(self, config: ModelConfig, weights: DraftHeadWeights[torch.Tensor],
                 embed: torch.Tensor, head: torch.Tensor, final_norm: torch.Tensor,
                 rope: Rope, parallel: int, context: int) -> None:
        self.config = config
        stacked.stack_on(embed.device, weights.layers)  # one matmul a group of projections
        self.w = weights
        self.embed, self.head, self.final_norm = embed, head, final_norm
        self.rope = rope
        shape = (len(weights.layers), parallel, context, config.num_key_value_heads,
                 config.head_dim)
        self.k = torch.zeros(shape, dtype=embed.dtype, device=embed.device)
        self.v = torch.zeros_like(self.k)
        self.count = [0] * parallel  # entries each slot holds
        # Slot s's entries are page s of the decode kernel's layout (over_live_entries).
        self.one_page_a_slot = torch.arange(parallel, device=embed.device)[:, None]
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
        return draft_in_batches(self, asks)

    # The draft loop's array operations (engine.draft_head.HeadSteps).
    def fed_rows(self, asks: Sequence[DraftAsk]) -> torch.Tensor:
        return torch.cat([a.hidden[self.ids(a.rows)] for a in asks])

    def ids(self, values: Sequence[int]) -> torch.Tensor:
        return _ids(self.embed.device, values)

    def take(self, x: torch.Tensor, indices: Sequence[int]) -> torch.Tensor:
        return x[self.ids(indices)]

    def greedy(self, out: torch.Tensor) -> torch.Tensor:
        return self.logits(out).argmax(-1)

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
        at = _RowsAt.of(slots, next_entries(self.count, slots, self.k.shape[2]), positions,
                        self.one_page_a_slot)
        # A draft step (one row a slot) on CUDA reads live entries in place; a feed, or any
        # call elsewhere, gathers them.
        attend = over_live_entries if at.one_a_slot and decode_kernel_runs(hidden.device) \
            else over_gathered_entries
        e = rms_norm(F.embedding(token_ids, self.embed), self.w.embed_norm, eps)
        x = F.linear(torch.cat((e, rms_norm(hidden, self.w.hidden_norm, eps)), dim=-1),
                     self.w.fc)
        for layer, w in enumerate(self.w.layers):
            x = x + self._attention(layer, rms_norm(x, w.input_norm, eps), w, at, attend)
            x = x + mlp(rms_norm(x, w.post_norm, eps), w)
        return rms_norm(x, self.w.norm, eps)

    def _attention(self, layer: int, x: torch.Tensor, w: LayerWeights, at: _RowsAt,
                   attend: Callable[..., torch.Tensor]) -> torch.Tensor:
        c = self.config
        rows, eps = x.shape[0], c.rms_norm_eps
        q, gate, k, v = attention_projections(x, w, c)
        q = partial_rope(rms_norm(q, w.q_norm, eps), self.rope, at.positions)
        k = partial_rope(rms_norm(k, w.k_norm, eps), self.rope, at.positions)
        # Every row's K and V first, so rows of one slot see the earlier rows of the call.
        self.k[layer, at.slots, at.entries] = k
        self.v[layer, at.slots, at.entries] = v
        out = attend(q, self.k[layer], self.v[layer], at).reshape(rows, c.q_width)
        return F.linear(out * torch.sigmoid(gate.reshape(rows, c.q_width)), w.o)


def over_gathered_entries(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          at: _RowsAt) -> torch.Tensor:
    """q [rows, heads, d], each row over its slot's entries up to its own, k and v [slots,
    entries, kv heads, d] a layer's cache: SDPA over each slot's entries gathered once for
    all its rows (a prompt chunk's rows share them), under a mask. [rows, heads, d]."""
    heads, d = q.shape[1:]
    groups = heads // k.shape[2]
    # [slots, heads, span, d]: each slot's entries, once for all its rows
    keys = k[at.group_slots, :at.span].transpose(1, 2).repeat_interleave(groups, 1)
    values = v[at.group_slots, :at.span].transpose(1, 2).repeat_interleave(groups, 1)
    queries = q.new_zeros(len(at.group_slots), at.padded.shape[1], heads, d)
    queries[at.group, at.within] = q  # [slots, most rows, heads, d]
    # [slots, most rows, span]: each row sees its slot's entries up to its own
    seen = torch.arange(at.span, device=q.device)[None, None, :] <= at.padded[:, :, None]
    out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys, values,
                                         attn_mask=seen[:, None],
                                         scale=d ** -0.5)  # [slots, heads, most rows, d]
    return out.transpose(1, 2)[at.group, at.within]


def over_live_entries(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      at: _RowsAt) -> torch.Tensor:
    """The same by the model's decode kernel (CUDA): each row reads its slot's live entries
    in place, with no gather, no copy of a key head per query head and no mask, whose cost
    grows with the longest conversation in the call. A slot's entries are one page of the
    kernel's paged layout. [rows, heads, d]."""
    from engine.backends.pytorch.decode_attention_triton import decode_attention

    return decode_attention(q, k.transpose(1, 2), v.transpose(1, 2), at.pages, at.slots,
                            at.entries + 1, at.span)


@dataclass(frozen=True)
class _RowsAt:
    """Where a call's rows sit: slot, entry in the slot's cache, rotary position [rows]
    each, the longest span of entries a row attends over, and the rows grouped by slot
    (engine.draft_head.SlotGroups): the slots [slots], each row's slot and place among its
    slot's rows [rows], and each place's entry [slots, most rows]. `pages`: each slot as
    one page of the decode kernel's layout [slots, 1]; `one_a_slot`: no slot has two rows
    (a draft step, not a feed)."""

    slots: torch.Tensor
    entries: torch.Tensor
    positions: torch.Tensor
    span: int
    group_slots: torch.Tensor
    group: torch.Tensor
    within: torch.Tensor
    padded: torch.Tensor
    pages: torch.Tensor
    one_a_slot: bool

    @classmethod
    def of(cls, slots: Sequence[int], entries: Sequence[int], positions: Sequence[int],
           pages: torch.Tensor) -> _RowsAt:
        groups = SlotGroups.of(slots)
        padded = [[0] * groups.most for _ in groups.slots]  # a padding row sees entry 0
        for g, j, entry in zip(groups.group, groups.within, entries, strict=True):
            padded[g][j] = entry

        def ids(values: object) -> torch.Tensor:
            return _ids(pages.device, values)

        return cls(ids(slots), ids(entries), ids(positions), max(entries) + 1,
                   ids(groups.slots), ids(groups.group), ids(groups.within), ids(padded),
                   pages, groups.most == 1)


def _ids(device: torch.device, values: object) -> torch.Tensor:
    """Host integers as an int64 index tensor on `device`, copied without waiting."""
    return on_device(device, np.asarray(values, dtype=np.int64))


def _tensors(w: DraftHeadWeights[torch.Tensor]) -> list[torch.Tensor]:
    out = [w.fc, w.embed_norm, w.hidden_norm, w.norm]
    for layer in w.layers:
        out += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    return out

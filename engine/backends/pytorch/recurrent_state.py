"""Per-slot recurrent state for one stage's Gated DeltaNet layers on PyTorch, preallocated.

RFC 6.3: each stage keeps KV *and* recurrent state for its own layers, a slot. A DeltaNet
layer keeps, per slot, the last `kernel - 1` inputs of its short causal convolution
([slots, conv width, kernel - 1], the model's dtype, as transformers keeps it) and the
delta rule's matrix per value head ([slots, v_heads, k_dim, v_dim], float32 so that a
bfloat16 model does not round it every token). Both are allocated once for
`FLEET_PARALLEL` slots, so shapes never change.

A recurrent state cannot be rolled back by moving an offset (it is overwritten every
token), so a verify entry (engine.rounds) keeps the state after each of its rows but the
last (`VERIFY_STATES` per slot, preallocated too), and the next entry, if it keeps only
`accepted` of those rows, starts from the state kept after its `accepted`-th row. The
slot table refuses a keep after any other entry. A stream's first row (position 0) never
reads its slot: it starts from zeros, whatever a previous stream left there, so a reused
slot starts clean without a separate clearing step. The choice is made on the
device (`torch.where`), with no host value, so a decode step can still be captured.
"""

from __future__ import annotations

import torch

from engine.backends.pytorch.kv_cache import KVCache
from engine.config import ModelConfig
from engine.families.kinds import VERIFY_STATES
from engine.rounds import RowLayout


class RecurrentState:
    def __init__(self, config: ModelConfig, layers: int, slots: int, dtype: torch.dtype,
                 device: torch.device, verify_states: int = VERIFY_STATES) -> None:
        kernel = config.linear_conv_kernel_dim
        self.conv = torch.zeros((layers, slots, config.linear_conv_width, max(kernel - 1, 0)),
                                dtype=dtype, device=device)
        self.delta = torch.zeros((layers, slots, config.linear_num_value_heads,
                                  config.linear_key_head_dim, config.linear_value_head_dim),
                                 dtype=torch.float32, device=device)
        # Each slot's state where a full prompt chunk last ended (SlotTable.snapshot), the
        # prompt cache's start for a RESUME: the recurrent state cannot be cut back.
        self.saved_conv = torch.zeros_like(self.conv)
        self.saved_delta = torch.zeros_like(self.delta)
        # Each slot's state after each row but the last of its last verify entry:
        # [layers, slots, verify_states, ...], what `restore_row` puts back. None kept
        # (verify_states 0) where the model does not draft: nothing rolls a verify entry back.
        self.verify_conv = torch.zeros((layers, slots, verify_states, *self.conv.shape[2:]),
                                       dtype=dtype, device=device)
        self.verify_delta = torch.zeros((layers, slots, verify_states, *self.delta.shape[2:]),
                                        dtype=torch.float32, device=device)
        self.slots = slots

    @property
    def nbytes(self) -> int:
        return (2 * (self.conv.nbytes + self.delta.nbytes)
                + self.verify_conv.nbytes + self.verify_delta.nbytes)

    def save(self, slot: int) -> None:
        self.saved_conv[:, slot] = self.conv[:, slot]
        self.saved_delta[:, slot] = self.delta[:, slot]

    def restore(self, slot: int) -> None:
        self.conv[:, slot] = self.saved_conv[:, slot]
        self.delta[:, slot] = self.saved_delta[:, slot]

    def keep_rows(self, layer: int, slots: torch.Tensor, row: int, conv: torch.Tensor,
                  delta: torch.Tensor) -> None:
        """Keep one layer's state after row `row` of each of `slots`' verify entries: conv
        [n, width, kernel - 1], delta [n, heads, k_dim, v_dim]. A slot whose entry has no
        such row (or ends there) keeps one too, never read: `restore_row` asks only for a
        row its entry ran, before its last."""
        if row >= self.verify_conv.shape[2]:
            return  # the last of 8 rows, or a stage whose model does not draft
        self.verify_conv[layer, slots, row] = conv.to(self.conv.dtype)
        self.verify_delta[layer, slots, row] = delta

    def restore_row(self, slot: int, row: int) -> None:
        """Every layer's state back to where row `row` of the slot's last verify entry left
        it (the next entry keeps rows [0, row])."""
        self.conv[:, slot] = self.verify_conv[:, slot, row]
        self.delta[:, slot] = self.verify_delta[:, slot, row]

    def read(self, layer: int, slots: torch.Tensor, fresh: torch.Tensor,
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [n, width, kernel - 1], delta [n, heads, k_dim, v_dim]) of `slots` [n];
        zeros where `fresh` [n] (a stream's first row)."""
        conv, delta = self.conv[layer, slots], self.delta[layer, slots]
        conv = torch.where(fresh[:, None, None], torch.zeros_like(conv), conv)
        delta = torch.where(fresh[:, None, None, None], torch.zeros_like(delta), delta)
        return conv, delta

    def keep_aside(self, run: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of slots [a, b) of every layer, for `put_back`."""
        a, b = run
        return self.conv[:, a:b].clone(), self.delta[:, a:b].clone()

    def put_back(self, run: tuple[int, int], kept: tuple[torch.Tensor, torch.Tensor]) -> None:
        a, b = run
        self.conv[:, a:b] = kept[0]
        self.delta[:, a:b] = kept[1]

    def write(self, layer: int, slots: torch.Tensor, conv: torch.Tensor,
              delta: torch.Tensor) -> None:
        self.conv[layer, slots] = conv.to(self.conv.dtype)
        self.delta[layer, slots] = delta


class HybridState:
    """A hybrid stage's per-slot state: KV for its attention layers, recurrent for DeltaNet."""

    def __init__(self, kv: KVCache, recurrent: RecurrentState) -> None:
        self.kv = kv
        self.recurrent = recurrent

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.recurrent.nbytes

    def cover(self, layout: RowLayout) -> None:
        self.kv.cover(layout)

    def release(self, slot: int) -> None:
        self.kv.release(slot)

    def save_recurrent(self, slot: int) -> None:
        self.recurrent.save(slot)

    def restore_recurrent(self, slot: int) -> None:
        self.recurrent.restore(slot)

    def keep_verified(self, slot: int, accepted: int) -> None:
        """The slot's recurrent state as if only the first `accepted` rows of its last verify
        entry had run (fewer than all). Its KV needs nothing: the next rows overwrite the
        dropped positions, and no row reads past its own."""
        self.recurrent.restore_row(slot, accepted - 1)

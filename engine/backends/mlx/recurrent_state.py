"""Per-slot recurrent state for one stage's Gated DeltaNet layers on MLX, preallocated.

RFC 6.3: each stage keeps KV *and* recurrent state for its own layers, a slot. A DeltaNet
layer keeps, per slot, the last `kernel - 1` inputs of its short causal convolution
([slots, kernel - 1, conv_dim], the model's dtype) and the delta rule's matrix per value
head ([slots, v_heads, v_dim, k_dim], float32 as mlx-lm keeps it, so a bfloat16 model does
not round its memory every token). Both are allocated once at start for `FLEET_PARALLEL`
slots, like the KV cache.

Unlike KV, a recurrent state cannot be rolled back by moving an offset: it is overwritten
every token. So a row at position 0 (a stream's first) never reads the slot: it starts
from zeros, whatever a previous stream left there. A verify entry (engine.rounds) keeps
the state after each of its rows but the last (`VERIFY_STATES` per slot, preallocated
too), and the next entry, if it keeps only `accepted` of those rows, starts from the state
kept after its `accepted`-th row; a keep after any other entry is refused by the slot
table (`engine.slots`) before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine.backends.mlx.kv_cache import KVCache, RoundIndex
from engine.families.kinds import VERIFY_STATES
from engine.rounds import RowLayout


@dataclass
class RecurrentIndex:
    """Which rows of a round start a stream (read zeros, not the slot), built once a round."""

    single_fresh: mx.array | None  # [n] bool per single row (RoundIndex's order), or None
    span_fresh: list[bool]  # per span: its first position is 0
    span_verifies: list[bool]  # per span: a verify entry's rows (RowSpan.verifies)

    @classmethod
    def build(cls, layout: RowLayout) -> RecurrentIndex:
        fresh = [pos == 0 for pos in layout.single_positions]
        return cls(mx.array(fresh) if any(fresh) else None,
                   [span.first == 0 for span in layout.spans],
                   [span.verifies for span in layout.spans])


@dataclass
class HybridIndex:
    """A round's rows as the attention layers (`attention`) and the DeltaNet layers see them."""

    attention: RoundIndex
    recurrent: RecurrentIndex

    @classmethod
    def build(cls, layout: RowLayout) -> HybridIndex:
        return cls(RoundIndex.build(layout, None), RecurrentIndex.build(layout))


class RecurrentState:
    """Conv and delta-rule state of `layers` DeltaNet layers for `slots` slots."""

    def __init__(self, layers: int, slots: int, conv_kernel: int, conv_dim: int,
                 v_heads: int, v_dim: int, k_dim: int, dtype: mx.Dtype,
                 verify_states: int = VERIFY_STATES) -> None:
        self.conv = [mx.zeros((slots, conv_kernel - 1, conv_dim), dtype=dtype)
                     for _ in range(layers)]
        self.delta = [mx.zeros((slots, v_heads, v_dim, k_dim), dtype=mx.float32)
                      for _ in range(layers)]
        # Each slot's state where a full prompt chunk last ended (SlotTable.snapshot), the
        # prompt cache's start for a RESUME: the recurrent state cannot be cut back.
        self.saved_conv = [mx.zeros_like(a) for a in self.conv]
        self.saved_delta = [mx.zeros_like(a) for a in self.delta]
        # Each slot's state after each row but the last of its last verify entry:
        # [slots, verify_states, ...] a layer, what `restore_row` puts back. None kept
        # (verify_states 0) where the model does not draft: nothing rolls a verify entry back.
        self.verify_states = verify_states
        self.verify_conv = [mx.zeros((slots, verify_states, *a.shape[1:]), dtype=a.dtype)
                            for a in self.conv]
        self.verify_delta = [mx.zeros((slots, verify_states, *a.shape[1:]), dtype=a.dtype)
                             for a in self.delta]
        mx.eval(self.arrays())

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def arrays(self) -> list[mx.array]:
        return (self.conv + self.delta + self.saved_conv + self.saved_delta
                + self.verify_conv + self.verify_delta)

    def save(self, slot: int) -> None:
        for live, saved in ((self.conv, self.saved_conv), (self.delta, self.saved_delta)):
            for layer, array in enumerate(live):
                saved[layer][slot] = array[slot]

    def restore(self, slot: int) -> None:
        for live, saved in ((self.conv, self.saved_conv), (self.delta, self.saved_delta)):
            for layer, array in enumerate(saved):
                live[layer][slot] = array[slot]

    def keep_row(self, layer: int, slot: int, row: int, conv: mx.array,
                 delta: mx.array) -> None:
        """Keep one layer's state after row `row` of a verify entry: conv [1, k-1, c],
        delta [1, h, dv, dk]."""
        if row >= self.verify_states:
            return  # this stage keeps no per-row state (its model does not draft)
        self.verify_conv[layer][slot, row] = conv[0].astype(self.conv[layer].dtype)
        self.verify_delta[layer][slot, row] = delta[0]

    def restore_row(self, slot: int, row: int) -> None:
        """Every layer's state back to where row `row` of the slot's last verify entry left
        it (the next entry keeps rows [0, row])."""
        for live, kept in ((self.conv, self.verify_conv), (self.delta, self.verify_delta)):
            for layer, array in enumerate(kept):
                live[layer][slot] = array[slot, row]

    def read_singles(self, layer: int, slots: mx.array, fresh: mx.array | None,
                     ) -> tuple[mx.array, mx.array]:
        """The slots' (conv [n, k-1, c], delta [n, h, dv, dk]); zeros where `fresh`."""
        conv = mx.take(self.conv[layer], slots, axis=0)
        delta = mx.take(self.delta[layer], slots, axis=0)
        if fresh is not None:
            conv = mx.where(fresh[:, None, None], mx.zeros_like(conv), conv)
            delta = mx.where(fresh[:, None, None, None], mx.zeros_like(delta), delta)
        return conv, delta

    def read_span(self, layer: int, slot: int, fresh: bool) -> tuple[mx.array, mx.array]:
        """One slot's (conv [1, k-1, c], delta [1, h, dv, dk]); zeros for a fresh stream."""
        conv = self.conv[layer][slot:slot + 1]
        delta = self.delta[layer][slot:slot + 1]
        if fresh:
            return mx.zeros_like(conv), mx.zeros_like(delta)
        return conv, delta

    def write(self, layer: int, slots: mx.array | slice, conv: mx.array,
              delta: mx.array) -> None:
        self.conv[layer][slots] = conv.astype(self.conv[layer].dtype)
        self.delta[layer][slots] = delta


class HybridState:
    """A hybrid stage's per-slot state: KV for its attention layers, recurrent for DeltaNet."""

    def __init__(self, kv: KVCache, recurrent: RecurrentState) -> None:
        self.kv = kv
        self.recurrent = recurrent

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.recurrent.nbytes

    def arrays(self) -> list[mx.array]:
        return self.kv.arrays() + self.recurrent.arrays()

    def save_recurrent(self, slot: int) -> None:
        self.recurrent.save(slot)

    def restore_recurrent(self, slot: int) -> None:
        self.recurrent.restore(slot)

    def keep_verified(self, slot: int, accepted: int) -> None:
        """The slot's recurrent state as if only the first `accepted` rows of its last verify
        entry had run (fewer than all). Its KV needs nothing: the next rows overwrite the
        dropped positions, and no row reads past its own."""
        self.recurrent.restore_row(slot, accepted - 1)

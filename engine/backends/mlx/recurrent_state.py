"""Per-slot recurrent state for one stage's Gated DeltaNet layers on MLX, preallocated.

RFC 6.3: each stage keeps KV *and* recurrent state for its own layers, a slot. A DeltaNet
layer keeps, per slot, the last `kernel - 1` inputs of its short causal convolution
([slots, kernel - 1, conv_dim], the model's dtype) and the delta rule's matrix per value
head ([slots, v_heads, v_dim, k_dim], float32 as mlx-lm keeps it, so a bfloat16 model does
not round its memory every token). Both are allocated once at start for `FLEET_PARALLEL`
slots, like the KV cache.

Unlike KV, a recurrent state cannot be rolled back by moving an offset: it is overwritten
every token. So a row at position 0 (a stream's first) never reads the slot: it starts
from zeros, whatever a previous stream left there. A verify entry (engine.rounds) comes as
single rows, several of one slot, which the recurrence runs in steps (row j of every slot
at once, `RecurrentIndex.verify_steps`); it keeps the state after each of its rows but
the last (`VERIFY_STATES` per slot where the model drafts, preallocated too), and the next entry, if it keeps only `accepted` of those rows, starts from the state
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
class VerifyStep:
    """One step of single rows where some slots hold several (a verify entry's): row j of
    every slot that has one, run as one batch of decode rows."""

    rows: mx.array  # [m] which single rows (their index among them)
    slots: mx.array  # [m] their slots, each once
    fresh: mx.array | None  # [m] bool: a stream's first row (reads zeros), or None


@dataclass
class RecurrentIndex:
    """Which rows of a round start a stream (read zeros, not the slot), and in what steps
    the recurrence runs single rows that share a slot; built once a round."""

    single_fresh: mx.array | None  # [n] bool per single row (RoundIndex's order), or None
    span_fresh: list[bool]  # per span: its first position is 0
    # None: one single row a slot. Else the steps, and the single rows' order as the steps
    # give them back (`step_order`: where each single row's output lands among them).
    verify_steps: list[VerifyStep] | None = None
    step_order: mx.array | None = None

    @classmethod
    def build(cls, layout: RowLayout) -> RecurrentIndex:
        fresh = [pos == 0 for pos in layout.single_positions]
        span_fresh = [span.first == 0 for span in layout.spans]
        if layout.rows_a_slot <= 1:
            return cls(mx.array(fresh) if any(fresh) else None, span_fresh)
        by_slot: dict[int, list[int]] = {}  # each slot's single rows, in order
        for at, slot in enumerate(layout.single_slots):
            by_slot.setdefault(slot, []).append(at)
        steps, produced = [], []
        for step in range(layout.rows_a_slot):
            taken = [(rows[step], slot) for slot, rows in by_slot.items() if step < len(rows)]
            step_fresh = [fresh[at] for at, _ in taken]
            steps.append(VerifyStep(mx.array([at for at, _ in taken]),
                                    mx.array([slot for _, slot in taken]),
                                    mx.array(step_fresh) if any(step_fresh) else None))
            produced.extend(at for at, _ in taken)
        inverse = [0] * len(produced)
        for at, row in enumerate(produced):
            inverse[row] = at
        return cls(None, span_fresh, steps, mx.array(inverse))


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

    def keep_rows(self, layer: int, slots: mx.array, row: int, conv: mx.array,
                  delta: mx.array) -> None:
        """Keep one layer's state after row `row` of each of `slots`' verify entries: conv
        [m, k-1, c], delta [m, h, dv, dk]. A slot whose entry ends at that row keeps one
        too, never read: `restore_row` asks only for a row before an entry's last."""
        if row >= self.verify_states:
            return  # the last of 8 rows, or a stage whose model does not draft
        self.verify_conv[layer][slots, row] = conv.astype(self.conv[layer].dtype)
        self.verify_delta[layer][slots, row] = delta

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

"""Per-slot KV state for one stage's layers on MLX, preallocated, and attention over it.

The same layout and round semantics as the PyTorch backend's `kv_cache.py`: every layer
holds [slots, kv_heads, context, head_dim] for K and for V, allocated once at start, and
rolling back (trim) is only a change of the slot's offset in `engine.slots.SlotTable`;
positions past it are never read. Each layer is its own array (rather than one
[layers, ...] array) so that a round's scatter into one layer can update that buffer in
place: MLX donates an array's memory to the op that replaces it when nothing else holds it.

A prompt span without a sliding window builds no mask: its rows are the last of the keys
they read, and `mx.fast.scaled_dot_product_attention`'s "causal" mask aligns a shorter
query to the end of the keys (lower right), which is that causality (tested byte for
byte against the explicit mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine.kv_pages import PAGE_POSITIONS, PageAllocator, consecutive, pages_for
from engine.rounds import RowLayout


@dataclass
class PromptSpan:
    """One stream's multi-row span in a round: its rows attend to its own slot."""

    start: int  # first row in the round
    stop: int
    slot: int
    keys: int  # positions the span can see: [0, keys)
    # [rows, keys] bool, True = attend; None: plain causality (no sliding window cuts in),
    # the fused kernel's own "causal" mask.
    mask: mx.array | None


@dataclass
class RoundIndex:
    """Where each row of a round sits: built once a round, used by every layer."""

    positions: mx.array  # [rows] int32
    slots: mx.array  # [rows] int32
    single_rows: mx.array | None  # [n] rows that are one-row entries (decode), batched together
    single_slots: mx.array | None  # [n]
    single_keys: int  # positions the batched single rows need: [0, single_keys)
    # [n, 1, 1, single_keys] bool; None when every single row sees every key (a decode
    # round whose rows all sit at single_keys - 1, with no window cutting in): no mask op.
    single_mask: mx.array | None
    spans: list[PromptSpan]
    # Attention outputs come out singles first, then each span; this gathers them back into
    # the round's row order. None when that order is already the round's (decode only).
    order: mx.array | None
    # On CPU each op costs tens of microseconds of dispatch whatever its size, so a round
    # of one entry (one stream decoding, or one prompt chunk) skips the gathers and the
    # scatter: its rows are already in order, and its slot and positions are plain ints
    # that slice the cache (the same values, fewer ops).
    singles_in_order: bool = False  # the single rows are the round's rows 0..n-1
    one_entry: tuple[int, int] | None = None  # (slot, first position) of the round's only entry

    @classmethod
    def build(cls, layout: RowLayout, sliding_window: int | None) -> RoundIndex:
        spans = []
        for span in layout.spans:
            mask = None
            if sliding_window:
                mask = _visible(mx.arange(span.first, span.end)[:, None], span.end,
                                sliding_window)
            spans.append(PromptSpan(span.start, span.stop, span.slot, span.end, mask))
        single, single_slot = layout.single_rows, layout.single_slots
        positions, slots = layout.positions, layout.slots
        single_keys = layout.single_keys
        single_mask = None
        sees_every_key = all(p == single_keys - 1 for p in layout.single_positions) and not (
            sliding_window and single_keys > sliding_window)
        if single and not sees_every_key:
            q = mx.array(layout.single_positions)[:, None]
            single_mask = _visible(q, single_keys, sliding_window)[:, None, None, :]
        produced = single + [row for span in spans for row in range(span.start, span.stop)]
        order = None
        if produced != sorted(produced):
            inverse = [0] * len(produced)
            for at, row in enumerate(produced):
                inverse[row] = at
            order = mx.array(inverse)

        def as_array(values: list[int]) -> mx.array:
            return mx.array(values, dtype=mx.int32)

        one_entry = None
        if len(set(slots)) == 1 and len(single) + len(spans) == 1:
            one_entry = (slots[0], positions[0])
        return cls(as_array(positions), as_array(slots),
                   as_array(single) if single else None,
                   as_array(single_slot) if single else None,
                   single_keys, single_mask, spans, order,
                   singles_in_order=single == list(range(len(positions))),
                   one_entry=one_entry)


def _visible(q: mx.array, keys: int, window: int | None) -> mx.array:
    """Causal (and sliding-window) visibility of keys [0, keys) from query positions q [n, 1]."""
    k = mx.arange(keys)[None, :]
    mask = k <= q
    if window:
        mask = mask & (k > q - window)
    return mask


class KVCache:
    def __init__(self, layers: int, slots: int, kv_heads: int, context: int, head_dim: int,
                 dtype: mx.Dtype) -> None:
        shape = (slots, kv_heads, context, head_dim)
        self.k = [mx.zeros(shape, dtype=dtype) for _ in range(layers)]
        self.v = [mx.zeros(shape, dtype=dtype) for _ in range(layers)]
        mx.eval(self.k, self.v)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    def arrays(self) -> list[mx.array]:
        """Every buffer, for `mx.eval` at the end of a round so no write stays pending."""
        return self.k + self.v

    def write(self, layer: int, index: RoundIndex, k: mx.array, v: mx.array) -> None:
        """k, v: [rows, kv_heads, head_dim] at each row's (slot, position)."""
        if index.one_entry is not None:
            slot, first = index.one_entry
            at = (slice(slot, slot + 1), slice(None), slice(first, first + k.shape[0]))
            self.k[layer][at] = k.transpose(1, 0, 2)[None]  # [1, kv_heads, rows, head_dim]
            self.v[layer][at] = v.transpose(1, 0, 2)[None]
            return
        self.k[layer][index.slots, :, index.positions] = k
        self.v[layer][index.slots, :, index.positions] = v

    def attend(self, layer: int, index: RoundIndex, q: mx.array, scale: float) -> mx.array:
        """q: [rows, heads, head_dim] -> [rows, heads, head_dim]."""
        parts = []
        if index.single_rows is not None:
            k, v = self._singles_keys(layer, index)  # [n, kv_heads, keys, head_dim] each
            qs = q if index.singles_in_order else q[index.single_rows]
            qs = qs[:, :, None, :]  # [n, heads, 1, head_dim]
            o = mx.fast.scaled_dot_product_attention(qs, k, v, scale=scale,
                                                     mask=index.single_mask)
            parts.append(o[:, :, 0, :])
        for span in index.spans:
            k, v = self._slot_keys(layer, span.slot, span.keys)  # [1, kv_heads, keys, head_dim]
            qs = q[span.start:span.stop].transpose(1, 0, 2)[None]  # [1, heads, rows, head_dim]
            mask = "causal" if span.mask is None else span.mask
            o = mx.fast.scaled_dot_product_attention(qs, k, v, scale=scale, mask=mask)
            parts.append(o[0].transpose(1, 0, 2))
        out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
        return out if index.order is None else out[index.order]

    def _singles_keys(self, layer: int, index: RoundIndex) -> tuple[mx.array, mx.array]:
        """K and V of positions [0, single_keys) of each batched single row's slot."""
        keys = index.single_keys
        if index.one_entry is not None:
            return self._slot_keys(layer, index.one_entry[0], keys)
        _, kv_heads, positions, _ = self.k[layer].shape
        if positions % PAGE_POSITIONS:
            # Slice, then gather: `cache[slots, :, :keys]` gathers every slot's whole
            # context before slicing (20 ms instead of 0.2 ms for 2 slots of a 4096-position
            # layer).
            return (mx.take(self.k[layer][:, :, :keys], index.single_slots, axis=0),
                    mx.take(self.v[layer][:, :, :keys], index.single_slots, axis=0))
        # A window is blocks of a page's positions, one run a (slot, head): taken whole
        # (`_blocks_taken` says why).
        windows = positions // PAGE_POSITIONS
        firsts = (index.single_slots[:, None] * kv_heads  # each (slot, head)'s first block
                  + mx.arange(kv_heads, dtype=index.single_slots.dtype)[None, :]) * windows
        blocks = firsts[:, :, None] + mx.arange(pages_for(keys), dtype=firsts.dtype)
        return (_blocks_taken(self.k[layer], blocks, keys),
                _blocks_taken(self.v[layer], blocks, keys))

    def _slot_keys(self, layer: int, slot: int, keys: int) -> tuple[mx.array, mx.array]:
        """K and V of one slot's positions [0, keys): [1, kv_heads, keys, head_dim] each."""
        return (self.k[layer][slot:slot + 1, :, :keys],
                self.v[layer][slot:slot + 1, :, :keys])

    def cover(self, layout: RowLayout) -> None:
        """Nothing to take: every slot's whole context is already held."""

    def release(self, slot: int) -> None:
        """Nothing to hand back: the slot's window stays allocated for its next stream."""


def kv_cache(layers: int, slots: int, kv_heads: int, context: int, head_dim: int,
             dtype: mx.Dtype, pages: int) -> KVCache:
    """A stage's KV: a pool of `pages` (FLEET_KV_PAGES), or a whole window a slot (0)."""
    if pages:
        return PagedKVCache(layers, slots, kv_heads, context, head_dim, dtype, pages)
    return KVCache(layers, slots, kv_heads, context, head_dim, dtype)


class PagedKVCache(KVCache):
    """A stage's KV as a pool of pages (`engine.kv_pages`, FLEET_KV_PAGES), so that it holds
    the positions its conversations hold rather than a whole context a slot.

    Each layer's K and V are [kv_heads, pages x page, head_dim]: the pool's pages end to
    end along the position axis, so a slot whose pages are consecutive is read as one
    slice, as a whole-window cache's slot is. MLX has no paged attention kernel and its
    fused SDPA needs a slot's keys in one run: a slot whose pages are not consecutive is
    gathered into one each round (a copy of its live keys; docs/mlx-backend.md measures
    it). The page table is the host's: each round's positions are looked up in `cover`,
    once for every layer."""

    def __init__(self, layers: int, slots: int, kv_heads: int, context: int, head_dim: int,
                 dtype: mx.Dtype, pages: int) -> None:
        pages_a_slot = pages_for(context)
        self.pages = PageAllocator(slots, pages_a_slot, pages)
        shape = (kv_heads, self.pages.pages * PAGE_POSITIONS, head_dim)
        self.k = [mx.zeros(shape, dtype=dtype) for _ in range(layers)]
        self.v = [mx.zeros(shape, dtype=dtype) for _ in range(layers)]
        mx.eval(self.k, self.v)
        # This round's places in the pool, found once for every layer: its rows', and the
        # keys it reads, (slot, keys) -> a slice of consecutive pages or the pages [1, p],
        # and (-1, keys) -> the batched single rows' slots' pages [n, p].
        self.written_at: slice | mx.array = slice(0, 0)
        self.runs: dict[tuple[int, int], slice | mx.array] = {}

    def cover(self, layout: RowLayout) -> None:
        """Pages for every position the round writes, and where in the pool each row goes."""
        self.pages.cover_round(layout)
        self.runs = {}
        self.written_at = _as_run([
            self._pool_position(slot, position)
            for slot, position in zip(layout.slots, layout.positions, strict=True)])

    def release(self, slot: int) -> None:
        """The slot's state is dropped: its pages go back to the pool."""
        self.pages.release(slot)

    def write(self, layer: int, index: RoundIndex, k: mx.array, v: mx.array) -> None:
        """k, v: [rows, kv_heads, head_dim] at each row's place in the pool (`cover`)."""
        self.k[layer][:, self.written_at] = k.transpose(1, 0, 2)
        self.v[layer][:, self.written_at] = v.transpose(1, 0, 2)

    def _singles_keys(self, layer: int, index: RoundIndex) -> tuple[mx.array, mx.array]:
        keys = index.single_keys
        if index.one_entry is not None:
            return self._slot_keys(layer, index.one_entry[0], keys)
        if (-1, keys) not in self.runs:
            # A slot with fewer pages than the longest reads page 0 past its own: stale
            # values its mask weighs at zero.
            self.runs[-1, keys] = mx.array(
                [self._pages(slot, keys, padded=True) for slot in index.single_slots.tolist()],
                dtype=mx.int32)
        pages = self.runs[-1, keys]
        return _gathered(self.k[layer], pages, keys), _gathered(self.v[layer], pages, keys)

    def _slot_keys(self, layer: int, slot: int, keys: int) -> tuple[mx.array, mx.array]:
        if (slot, keys) not in self.runs:
            held = self._pages(slot, keys)
            self.runs[slot, keys] = (
                slice(held[0] * PAGE_POSITIONS, held[0] * PAGE_POSITIONS + keys)
                if consecutive(held) else mx.array([held], dtype=mx.int32))
        run = self.runs[slot, keys]
        if isinstance(run, slice):
            return self.k[layer][None, :, run], self.v[layer][None, :, run]
        return _gathered(self.k[layer], run, keys), _gathered(self.v[layer], run, keys)

    def _pool_position(self, slot: int, position: int) -> int:
        page = self.pages.held[slot][position // PAGE_POSITIONS]
        return page * PAGE_POSITIONS + position % PAGE_POSITIONS

    def _pages(self, slot: int, keys: int, padded: bool = False) -> list[int]:
        """The pages holding a slot's positions [0, keys); `padded`: page 0 stands in for
        those it has not taken."""
        held = self.pages.held[slot][:pages_for(keys)]
        return held + [0] * (pages_for(keys) - len(held)) if padded else held


def _gathered(pool: mx.array, pages: mx.array, keys: int) -> mx.array:
    """A layer's pool [kv_heads, pages x page, head_dim] read at `pages` [n, p] as
    [n, kv_heads, keys, head_dim]: each row's positions [0, keys), in order, a copy."""
    kv_heads, positions, _ = pool.shape
    heads = mx.arange(kv_heads, dtype=pages.dtype)[None, :, None] * (positions // PAGE_POSITIONS)
    return _blocks_taken(pool, heads + pages[:, None, :], keys)


def _blocks_taken(cache: mx.array, blocks: mx.array, keys: int) -> mx.array:
    """`cache` (any layout whose last two axes are positions and head_dim, positions a
    multiple of a page) as blocks of a page's positions, taken at `blocks` [n, kv_heads, p]
    (block numbers in that flat order) as [n, kv_heads, keys, head_dim]: one copy.

    Indexing blocks in the result's own order leaves attention a plain run to read: taking
    pages for every head and moving the heads after (a pool), or taking every slot's
    strided slice (a window), left a second copy or a slow strided one (4 streams of 2,000
    keys with their attention, CPU build: about 8 -> 5.7 ms in a pool)."""
    head_dim = cache.shape[-1]
    n, kv_heads, p = blocks.shape
    by_block = cache.reshape(-1, PAGE_POSITIONS, head_dim)
    run = mx.take(by_block, blocks.reshape(-1), axis=0)
    return run.reshape(n, kv_heads, p * PAGE_POSITIONS, head_dim)[:, :, :keys]


def _as_run(positions: list[int]) -> slice | mx.array:
    """Pool positions as a slice where they are consecutive (one entry's rows in its
    pages, the common case), else as an index array."""
    if not positions:
        return slice(0, 0)
    if consecutive(positions):
        return slice(positions[0], positions[0] + len(positions))
    return mx.array(positions, dtype=mx.int32)

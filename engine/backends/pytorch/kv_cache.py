"""Per-slot KV state for one stage's layers, in pages, and attention over it.

The storage is a pool of pages ([layers, pages, kv_heads, page, head_dim]) and a table of
which page holds which of a slot's positions (`engine.kv_pages`). Shapes never change after
start, so a captured decode graph can later write into the same storage through the same
table. Rolling back (trim) is a change of the slot's offset in `engine.slots.SlotTable`;
positions past it are never read.

Attention reads only the keys a round's rows can see, never the whole context, so a step
costs what the conversations hold, not what the fleet configured: an eager round reads
keys [0, its rows' highest position + 1) of each slot it serves (a prompt span its own
slot's [0, span end)), and a captured decode step reads [0, `key_bucket` of that).

Decode rows on CUDA go through a Triton split-K kernel (`decode_attention_triton`) that
reads each row's slot and length from device tensors and its keys through the page table:
no gather, no mask, and every key of a group's query heads read once.
FLEET_DECODE_ATTENTION=sdpa (or a CUDA without Triton) keeps SDPA under the mask over
each slot's pages gathered in order (`KVCache.gather`), which is what the CPU and MPS
always run.

A prompt span on CUDA without a sliding window builds no mask: its rows are the last of
the keys they read, so causality is `causal_lower_right`, which SDPA runs as a flash or
memory-efficient kernel, or (FLEET_PROMPT_ATTENTION=cudnn) as two cuDNN attentions merged
(`prompt_attention`). Elsewhere the span carries the explicit mask: the CPU would
expand `causal_lower_right` to the same mask anyway (the same bytes), and its module
imports torch._dynamo, about 74 MB resident in a process that never compiles.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.env import read_switch
from engine.kv_pages import PAGE_POSITIONS, PageAllocator, pages_for
from engine.rounds import RowLayout


@dataclass
class PromptSpan:
    """One stream's multi-row span in a round: its rows attend to its own slot."""

    start: int  # first row in the round
    stop: int
    slot: int
    first: int  # position of the first row
    keys: int  # positions the span can see: [0, keys), its last row's position + 1
    # [rows, keys] bool, True = attend; None: plain causality, the rows being the last
    # `rows` of the keys (no sliding window cuts in), which needs no mask.
    mask: torch.Tensor | None


@dataclass
class VerifySteps:
    """Single rows of which some slots hold several (a verify entry's, in order), as a
    recurrence must run them: step j takes row j of every slot at once, and a slot with
    fewer rows repeats its last, its result dropped (`valid`). Device tensors of fixed
    shapes, so a CUDA graph can capture a round of them."""

    rows: torch.Tensor  # [steps, slots]: which single row (its index among them) each slot runs
    valid: torch.Tensor  # [steps, slots] bool: the slot has a row at that step
    first: torch.Tensor  # [slots]: each slot's first single row


def verify_steps(groups: torch.Tensor, slots: int, steps: int) -> VerifySteps:
    """groups [n]: each single row's slot numbered 0..slots - 1 in order of appearance
    (nondecreasing, every number at least once); `steps`: the most rows a slot holds."""
    numbers = torch.arange(slots, device=groups.device)
    first = torch.searchsorted(groups, numbers)
    count = torch.searchsorted(groups, numbers, right=True) - first
    step = torch.arange(steps, device=groups.device)[:, None]
    return VerifySteps(first[None] + torch.minimum(step, count[None] - 1), step < count[None],
                       first)


@dataclass
class RoundIndex:
    """Where each row of a round sits: built once a round, used by every layer."""

    positions: torch.Tensor  # [rows] int64
    slots: torch.Tensor  # [rows] int64
    single_rows: torch.Tensor  # [n] rows that are one-row entries (decode), batched together
    single_slots: torch.Tensor  # [n]
    single_mask: torch.Tensor | None  # [n, 1, 1, keys] bool; None under the decode kernel
    spans: list[PromptSpan]
    single_keys: int = 0  # the decode rows read keys [0, single_keys) at most
    # [n] int32, each decode row's keys (position + 1) for the decode kernel, which reads
    # them on the device instead of a mask; None: SDPA under single_mask.
    single_lengths: torch.Tensor | None = None
    window: int | None = None  # the sliding window the decode kernel applies
    # Where a slot holds several single rows (a verify entry on the decode path): the
    # steps a recurrent layer runs them in. None: one single row a slot.
    verify_steps: VerifySteps | None = None
    # Prompt spans without a mask go through cuDNN (`prompt_attention`) rather than SDPA's
    # flash kernel: FLEET_PROMPT_ATTENTION on CUDA, read as the round's index is built.
    spans_by_cudnn: bool = False

    @classmethod
    def build(cls, layout: RowLayout, device: torch.device, sliding_window: int | None, *,
              recurrent: bool = False) -> RoundIndex:
        """`recurrent`: the range has recurrent layers, which run a slot's several single rows
        in steps (`verify_steps`); attention alone needs none."""
        spans = []
        for span in layout.spans:
            mask = None
            if sliding_window or device.type != "cuda":
                q = torch.arange(span.first, span.end, device=device)[:, None]
                mask = _visible(q, span.end, sliding_window, device)
            spans.append(PromptSpan(span.start, span.stop, span.slot, span.first, span.end,
                                    mask))
        single_mask = single_lengths = None
        if layout.single_rows and decode_kernel_runs(device):
            single_lengths = torch.tensor(layout.single_positions, dtype=torch.int32,
                                          device=device) + 1
        elif layout.single_rows:
            q = torch.tensor(layout.single_positions, device=device)[:, None]
            single_mask = _visible(q, layout.single_keys, sliding_window,
                                   device)[:, None, None, :]

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        steps = None
        if recurrent and layout.rows_a_slot > 1:
            groups = list(itertools.accumulate(
                (int(b != a) for a, b in itertools.pairwise(layout.single_slots)), initial=0))
            steps = verify_steps(as_tensor(groups), groups[-1] + 1, layout.rows_a_slot)
        return cls(as_tensor(layout.positions), as_tensor(layout.slots),
                   as_tensor(layout.single_rows), as_tensor(layout.single_slots), single_mask,
                   spans, layout.single_keys, single_lengths,
                   sliding_window, steps,
                   device.type == "cuda" and read_switch("prompt_attention") == "cudnn")


# Positions a slot's cache holds are the context rounded up to whole pages, so every page's
# and head's keys start on a 64-byte boundary whatever the context (64 positions x head_dim
# x itemsize is a multiple of 64). CPU matrix kernels take alignment-dependent paths whose
# last bits differ: with head_dim 18, a context of 33 and one of 32768 gave different
# logits for the same conversation; aligned, any two contexts give the same bytes.
ALIGN_POSITIONS = PAGE_POSITIONS
KEY_BUCKET_FLOOR = 256  # a round whose rows need fewer keys still reads this many
KEY_BUCKETS_PER_OCTAVE = 4  # bucket sizes between 2^n and 2^(n+1): at most 25 % read in vain


def allocated_positions(context: int) -> int:
    """Positions a slot's cache holds for a context: the context, aligned (ALIGN_POSITIONS)."""
    return -(-context // ALIGN_POSITIONS) * ALIGN_POSITIONS


def key_bucket(keys: int, context: int) -> int:
    """How many keys a captured decode step reads when its rows need [0, keys).

    A captured graph has fixed shapes, so the live length is rounded up to a bucket and
    one graph serves every round of that bucket: 256, 320, 384, 448, 512, 640, 768, ...
    (quarter octaves, multiples of 64), never past `context` (pass the cache's allocated
    positions: keys past the configured context are never written, so they read as masked
    zeros, and a short conversation reads 256 keys under any context). Powers of two
    alone would read up to twice the live keys; multiples of 256 would need context / 256
    graphs per run of slots. Quarter octaves keep both small: 29 buckets up to 32768.
    Keys in [live, bucket) are zeros or a released stream's stale values: finite, so the
    mask's zero weight leaves them out exactly.
    """
    if keys <= KEY_BUCKET_FLOOR:
        return min(KEY_BUCKET_FLOOR, context)
    octave = 1 << ((keys - 1).bit_length() - 1)  # the largest power of two below keys
    step = octave // KEY_BUCKETS_PER_OCTAVE
    return min(-(-keys // step) * step, context)


def decode_index(positions: torch.Tensor, run: tuple[int, int], keys: int,
                 window: int | None, offsets: torch.Tensor | None = None,
                 steps: int = 1) -> RoundIndex:
    """The index of a decode round over consecutive slots [a, b), row i in slot
    a + offsets[i] (a verify entry's rows share one; None: one row a slot, in order),
    built from device tensors only (no host values), so that it can be captured in a CUDA
    graph. `steps` > 1: the most rows a slot holds, for a recurrent layer's `VerifySteps`
    (a dense model needs none).

    Its rows attend over keys [0, keys) (a `key_bucket` of the round's live length, or
    the whole context) under a mask, or through the decode kernel with their lengths as a
    device tensor and `keys` as the bound that fixes its chunks; either way every shape is
    fixed for every round of that bucket.
    """
    a, b = run
    device = positions.device
    if offsets is None:
        offsets = torch.arange(b - a, device=device)
    slots = offsets + a
    mask = lengths = None
    if decode_kernel_runs(device):
        lengths = (positions + 1).to(torch.int32)
    else:
        mask = _visible(positions[:, None], keys, window, device)[:, None, None, :]
    rows_by_step = verify_steps(offsets, b - a, steps) if steps > 1 else None
    return RoundIndex(positions, slots, torch.arange(len(offsets), device=device), slots,
                      mask, [], keys, lengths, window, rows_by_step)


def decode_kernel_runs(device: torch.device) -> bool:
    """Whether decode rows on `device` go through the Triton decode kernel
    (`decode_attention_triton`) instead of SDPA under a mask: on CUDA when Triton imports,
    unless FLEET_DECODE_ATTENTION=sdpa (the contract's `decode_attention`, engine.env). Read
    from the environment when a round's index is built, so that a process (or a test) can
    switch it; a captured graph keeps what it was captured with. The CPU and MPS always
    run SDPA."""
    choice = read_switch("decode_attention")
    return device.type == "cuda" and choice == "triton" and _triton_imports()


@functools.cache
def _triton_imports() -> bool:
    try:
        import engine.backends.pytorch.decode_attention_triton  # noqa: F401
    except ImportError:
        return False
    return True


def visible_keys(q: torch.Tensor, keys: int, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) visibility of keys [0, keys) from query positions q [n, 1]."""
    return _visible(q, keys, window, q.device)


def _visible(q: torch.Tensor, keys: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Causal (and sliding-window) visibility of keys [0, keys) from query positions q [n, 1]."""
    k = torch.arange(keys, device=device)[None, :]
    mask = k <= q
    if window:
        mask &= k > q - window
    return mask


def attends_in_float32(t: torch.Tensor) -> bool:
    """Whether attention over `t` runs in float32 (`attention` says why): half precision
    on a CPU."""
    return t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16)


def located(table: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each row's (slot, position) lies in the pages of `table` (rows of the page
    table: slots index them): its page, and its position within that page."""
    page = PAGE_POSITIONS
    return table[slots, positions // page], positions % page


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
    """Scaled dot-product attention (grouped heads) of q over k, v under `mask`.

    On a CPU a half-precision cache is attended in float32 and the result rounded back:
    the CPU's bfloat16 kernel converts each element at every use, and one conversion up
    front with the float32 kernel took 0.3-0.5x its time over 8,000 keys and 0.4x for 8
    rows over 96 (one thread; bench/cpu_attention.py). The float32 copy of the keys and
    values read lives for the call only. GPUs keep their native kernels.
    """
    if attends_in_float32(q):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                              enable_gqa=True).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def attend_one_row_each(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         mask: torch.Tensor) -> torch.Tensor:
    """Decode attention, one query row a slot: q [n, heads, head_dim] over k, v
    [n, kv_heads, keys, head_dim] under mask [n, 1, 1, keys] -> [n, heads, head_dim].

    On CUDA the query heads go in as their key heads' rows (`heads_as_rows`). Grouped
    heads asked of SDPA itself (`enable_gqa`) with a mask run there only as the math
    kernel (torch 2.11), which copies every key and value once per query head; as rows,
    the memory-efficient kernel takes them and reads each key once. On an H200, 8 rows
    over 8,000 keys: 4.06 -> 0.58 ms for the Qwen3.5 27B's heads, 3.28 -> 0.45 ms for an
    8B's (bench/decode_attention.py). The CPU's kernels take grouped heads as they are,
    so a CPU keeps SDPA's grouped form and its bytes. The compiled dense decode step keeps
    the grouped form on CUDA too (`llama.decode_block` says why).
    """
    if q.device.type == "cuda":
        return heads_as_rows(q, k, v, mask)
    return attention(q[:, :, None, :], k, v, mask)[:, :, 0, :]


def heads_as_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
    """`attend_one_row_each` with the query heads that share a key head (heads / kv_heads
    of them: GQA) passed as that head's rows: they see the same keys under the same mask."""
    n, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.reshape(n, kv_heads, heads // kv_heads, head_dim)  # query head = kv head × group
    return attention(grouped, k, v, mask).reshape(n, heads, head_dim)


class KVCache:
    """A stage's KV as a pool of pages (`engine.kv_pages`): K and V are
    [layers, pages, kv_heads, page, head_dim], and `table` [slots, pages a slot] says which
    page holds each slot's positions [j x page, (j + 1) x page). The table lives on the
    device, is changed in place only, and is read by every path (so a captured graph sees
    the pages a slot took after its capture). `pages`: the pool's size (FLEET_KV_PAGES),
    which the stage's slot table keeps every plan within; 0: every slot's whole context."""

    def __init__(self, layers: int, slots: int, kv_heads: int, context: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, pages: int = 0) -> None:
        self.positions = allocated_positions(context)  # what a slot can hold, aligned
        pages_a_slot = self.positions // PAGE_POSITIONS
        self.pages = PageAllocator(slots, pages_a_slot, pages)
        shape = (layers, self.pages.pages, kv_heads, PAGE_POSITIONS, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.table = torch.zeros(slots, pages_a_slot, dtype=torch.int64, device=device)

    @property
    def nbytes(self) -> int:
        """K and V: what placement charges (supervisor.memory). The page table beside them,
        8 bytes a page of a slot's whole context, is left out as the slot table is."""
        return self.k.nbytes + self.v.nbytes

    def cover(self, layout: RowLayout) -> None:
        """Pages for every position the round's rows write, taken before any layer runs
        (and before a captured graph replays: its rows write through the table)."""
        taken = self.pages.cover_round(layout)
        if taken:
            slots, columns, pages = (torch.tensor(values, dtype=torch.int64,
                                                  device=self.table.device)
                                     for values in zip(*taken, strict=True))
            self.table[slots, columns] = pages

    def release(self, slot: int) -> None:
        """The slot's state is dropped: its pages go back to the pool."""
        self.pages.release(slot)

    def pages_of(self, slots: torch.Tensor, keys: int) -> torch.Tensor:
        """[n, pages] the pages holding positions [0, keys) of each of `slots` [n]."""
        return self.table[slots, :pages_for(keys)]

    def gather(self, layer: int, slots: torch.Tensor, keys: int,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [0, keys) of each of `slots` [n], as SDPA takes them:
        [n, kv_heads, keys, head_dim] each, copied out of their pages. On a CPU a
        half-precision cache is widened to float32 in that copy, which `attention` would
        make next (it says why)."""
        widened = torch.float32 if attends_in_float32(self.k) else None
        runs = self._consecutive_runs(slots, keys)
        pages = self.pages_of(slots, keys)
        if runs is not None:
            return (in_runs(self.k[layer], runs, pages, keys, widened),
                    in_runs(self.v[layer], runs, pages, keys, widened))
        return (in_order(self.k[layer], pages, keys, widened),
                in_order(self.v[layer], pages, keys, widened))

    def _consecutive_runs(self, slots: torch.Tensor, keys: int,
                          ) -> list[tuple[int, int]] | None:
        """On a CPU, where every one of `slots` holds consecutive pages: each one's (first
        page, pages of [0, keys) it holds). None on other devices (reading the slots on
        the host would wait for the device) or where a slot's pages are scattered.

        The gather copies the pages out, then again to put heads first (and widen); a view
        of a run is copied once. On the demo model's widths, 8,000 keys, one thread: 253 ->
        61 µs a layer's K (a window's view widened: 53)."""
        if self.k.device.type != "cpu":
            return None
        wanted = pages_for(keys)
        runs = []
        for slot in slots.tolist():
            first = self.pages.run_start(slot)
            if first is None:
                return None
            runs.append((first, min(wanted, len(self.pages.held[slot]))))
        return runs

    def write(self, layer: int, index: RoundIndex, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [rows, kv_heads, head_dim] at each row's (slot, position)."""
        pages, within = located(self.table, index.slots, index.positions)
        self.k[layer, pages, :, within] = k
        self.v[layer, pages, :, within] = v

    def attend(self, layer: int, index: RoundIndex, q: torch.Tensor) -> torch.Tensor:
        """q: [rows, heads, head_dim] -> [rows, heads, head_dim]."""
        out = torch.empty_like(q)
        if index.single_lengths is not None:
            from engine.backends.pytorch.decode_attention_triton import decode_attention

            rows = index.single_rows
            out[rows] = decode_attention(q[rows], self.k[layer], self.v[layer], self.table,
                                         index.single_slots, index.single_lengths,
                                         index.single_keys, index.window)
        elif index.single_mask is not None:
            k, v = self.gather(layer, index.single_slots, index.single_mask.shape[-1])
            out[index.single_rows] = attend_one_row_each(q[index.single_rows], k, v,
                                                          index.single_mask)
        for span in index.spans:
            keys = span.keys
            k, v = self.gather(layer, index.slots[span.start:span.start + 1], keys)
            qs = q[span.start:span.stop].transpose(0, 1)[None]  # [1, heads, rows, head_dim]
            if span.mask is None and index.spans_by_cudnn:
                from engine.backends.pytorch.prompt_attention import chunk_attention

                o = chunk_attention(qs, k, v)
            elif span.mask is None:
                from torch.nn.attention.bias import causal_lower_right  # CUDA only: see above

                o = attention(qs, k, v, causal_lower_right(span.stop - span.start, keys))
            else:
                o = attention(qs, k, v, span.mask)
            out[span.start:span.stop] = o[0].transpose(0, 1)
        return out


def in_runs(layer: torch.Tensor, runs: list[tuple[int, int]], pages: torch.Tensor, keys: int,
            dtype: torch.dtype | None = None) -> torch.Tensor:
    """`in_order` for rows whose pages are runs of the pool: (first page, pages held) a row,
    each run copied from a view. Columns of `pages` past what a row holds (a shorter slot
    in a batch) are read through the table as `in_order` reads them: stale, finite pages
    that no row's mask weighs, the same bytes either way."""
    _, kv_heads, page, head_dim = layer.shape
    p = pages.shape[1]
    out = torch.empty((len(runs), kv_heads, p, page, head_dim), dtype=dtype or layer.dtype,
                      device=layer.device)
    for row, (first, held) in enumerate(runs):
        out[row, :, :held].copy_(layer[first:first + held].transpose(0, 1))
        if held < p:
            out[row, :, held:].copy_(layer[pages[row, held:]].transpose(0, 1))
    return out.view(len(runs), kv_heads, p * page, head_dim)[:, :, :keys]


def in_order(layer: torch.Tensor, pages: torch.Tensor, keys: int,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """A layer's pages [pages, kv_heads, page, head_dim] read at `pages` [n, p] as
    [n, kv_heads, keys, head_dim]: each row's positions [0, keys), in order. `dtype`: the
    copy's element type, where it is not the cache's (converted in the same pass)."""
    n, p = pages.shape
    _, kv_heads, page, head_dim = layer.shape
    by_head = layer[pages].transpose(1, 2)  # [n, kv_heads, p, page, head_dim]
    if dtype is None or dtype == layer.dtype:
        return by_head.reshape(n, kv_heads, p * page, head_dim)[:, :, :keys]
    run = torch.empty(by_head.shape, dtype=dtype, device=layer.device)
    run.copy_(by_head)
    return run.view(n, kv_heads, p * page, head_dim)[:, :, :keys]

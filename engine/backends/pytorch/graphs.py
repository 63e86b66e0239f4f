"""Decode rounds replayed as CUDA graphs: one graph per run of consecutive slots and bucket.

An eager decode step launches a few hundred small kernels from Python, and on a GPU that
host work, not memory, sets the pace. A decode round whose streams sit in consecutive
slots [a, b) (the usual case) has fixed shapes once its key count is fixed: one row per
slot, attention over keys [0, bucket) under a mask, where the bucket is the round's live
length rounded up (`kv_cache.key_bucket`). Its layers are captured once per ([a, b),
bucket), lazily, and replayed with new rows and positions copied into its static inputs
(a first stage embeds its token ids eagerly, one gather, before). Rounds of any other
shape (prompt chunks, scattered slots) run eagerly. Whole model and pipeline stages
compute the same bucket from the same plan and take the same path, so a pipeline still
gives one process's bits. At most `MAX_GRAPHS` are kept; the one replayed least
recently goes first.

Every graph of a stage draws its buffers from one memory pool instead of a private pool
each (there can be parallel x (parallel + 1) / 2 runs times the buckets), so the pool
holds what the largest one needs, not the sum. Sharing is safe in any replay
order because graphs replay one at a time on one stream, each writes its intermediates
before reading them, static inputs and the KV cache live outside the pool, and a
replay's output is cloned at once, before another graph may reuse its memory.

A hybrid's recurrent state, unlike KV, is changed by running a step again (each step
decays and writes it), so the warm-up steps run on a copy's behalf: the run's slots are
kept aside before them and put back after, and the round's own step is the replay. A
hybrid's verify rows are decode rows too; its recurrence runs them in as many steps as
the most rows a slot holds, so that count is part of a hybrid's key (a dense model's is 1).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine.backends.pytorch.kv_cache import allocated_positions, decode_index, key_bucket
from engine.backends.pytorch.llama import DecodeBlock, LlamaRange
from engine.backends.pytorch.recurrent_state import RecurrentState

WARMUP_STEPS = 2  # cuBLAS and the caching allocator settle before capture
# A bound on captured graphs: each holds its kernels' parameters and a capture costs a
# few warm-up steps, and a long-lived stage meets many (run, bucket) pairs.
MAX_GRAPHS = 64

# (run of slots [a, b), rows, keys read, the recurrence's steps: the most rows of a slot)
GraphKey = tuple[tuple[int, int], int, int, int]


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [n, hidden] rows
    positions: torch.Tensor  # [n]
    offsets: torch.Tensor  # [n]: each row's slot in the run
    output: torch.Tensor  # [n, hidden]


class DecodeGraphs:
    def __init__(self, model: LlamaRange, context: int, window: int | None,
                 recurrent: RecurrentState | None = None, *, live_keys: bool = True,
                 max_graphs: int = MAX_GRAPHS, step: DecodeBlock | None = None) -> None:
        self.model = model
        # The compiled decode layer (compiled_step.py), captured like the eager layers:
        # its first warm-up step compiles (or finds the compiled graph), the capture
        # records its fused kernels. None: the eager layers.
        self.step = step
        self.recurrent = recurrent
        self.positions = allocated_positions(context)  # what the cache holds per slot
        self.window = window
        # False: every step reads the whole context (the path before live-length buckets,
        # kept so that bench/decode.py can time both in one run).
        self.live_keys = live_keys
        self.max_graphs = max_graphs
        self.captured: OrderedDict[GraphKey, Captured] = OrderedDict()  # least recent first
        self.pool = torch.cuda.graph_pool_handle()  # shared by every capture below
        # One stream for every warm-up: the caching allocator reuses a freed block only on
        # the stream that allocated it, so a fresh stream per capture kept a fresh set of
        # warm-up buffers per captured run.
        self.warmup_stream = torch.cuda.Stream()

    def keys_read(self, keys_needed: int) -> int:
        """Keys a step reads when its rows need [0, keys_needed): a bucket, or every one."""
        if not self.live_keys:
            return self.positions
        return key_bucket(keys_needed, self.positions)

    def replay(self, run: tuple[int, int], keys_needed: int, inputs: torch.Tensor,
               positions: torch.Tensor, offsets: torch.Tensor,
               rows_a_slot: int = 1) -> torch.Tensor:
        """One decode round of the slots in `run`, row i in slot a + offsets[i], at most
        `rows_a_slot` rows in one slot; its rows need keys [0, keys_needed)."""
        steps = rows_a_slot if self.recurrent is not None else 1  # attention needs none
        key = (run, len(offsets), self.keys_read(keys_needed), steps)
        captured = self.captured.get(key)
        if captured is None:
            captured = self._capture(key, inputs, positions, offsets)
        self.captured.move_to_end(key)
        captured.inputs.copy_(inputs)
        captured.positions.copy_(positions)
        captured.offsets.copy_(offsets)
        captured.graph.replay()
        return captured.output.clone()  # the next replay reuses the output buffer

    def _step(self, key: GraphKey, rows: torch.Tensor, positions: torch.Tensor,
              offsets: torch.Tensor) -> torch.Tensor:
        run, _rows, keys, steps = key
        if self.step is not None:
            return self.model.run_decode(rows, positions, run, keys, self.step, offsets=offsets)
        return self.model.run_layers(rows, decode_index(positions, run, keys, self.window,
                                                        offsets, steps))

    def _capture(self, key: GraphKey, inputs: torch.Tensor, positions: torch.Tensor,
                 offsets: torch.Tensor) -> Captured:
        while len(self.captured) >= self.max_graphs:
            self.captured.popitem(last=False)  # its pool blocks return to the shared pool
        # Static inputs hold this round's values, so the warm-up steps write the same K and V
        # the captured step will: running them changes no slot's state.
        static_inputs, static_positions = inputs.clone(), positions.clone()
        static_offsets = offsets.clone()
        run = key[0]
        kept = self.recurrent.keep_aside(run) if self.recurrent is not None else None
        side = self.warmup_stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self._step(key, static_inputs, static_positions, static_offsets)
        torch.cuda.current_stream().wait_stream(side)
        if kept is not None:
            self.recurrent.put_back(run, kept)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = self._step(key, static_inputs, static_positions, static_offsets)
        captured = Captured(graph, static_inputs, static_positions, static_offsets, output)
        self.captured[key] = captured
        return captured

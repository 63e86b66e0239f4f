"""Decode rounds replayed as CUDA graphs: one graph per run of consecutive slots.

An eager decode step launches a few hundred small kernels from Python, and on a GPU that
host work, not memory, sets the pace. A decode round whose streams sit in consecutive
slots [a, b) (the usual case) has fixed shapes: one row per slot, attention over the
whole preallocated context under a mask. Its layers are captured once per [a, b) and
replayed with new rows and positions copied into its static inputs (a first stage embeds
its token ids eagerly, one gather, before). Rounds of any other shape (prompt chunks,
scattered slots) run eagerly. Whole model and pipeline stages take the same path for the
same round, so a pipeline still gives one process's bits.

Every graph of a stage draws its buffers from one memory pool instead of a private pool
each (there can be parallel x (parallel + 1) / 2 of them). Sharing is safe in any replay
order because graphs replay one at a time on one stream, each writes its intermediates
before reading them, static inputs and the KV cache live outside the pool, and a
replay's output is cloned at once, before another graph may reuse its memory.

A hybrid's recurrent state, unlike KV, is changed by running a step again (each step
decays and writes it), so the warm-up steps run on a copy's behalf: the run's slots are
kept aside before them and put back after, and the round's own step is the replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.backends.pytorch.kv_cache import decode_index
from engine.backends.pytorch.llama import LlamaRange
from engine.backends.pytorch.recurrent_state import RecurrentState

WARMUP_STEPS = 2  # cuBLAS and the caching allocator settle before capture


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [n, hidden] rows
    positions: torch.Tensor  # [n]
    output: torch.Tensor  # [n, hidden]


class DecodeGraphs:
    def __init__(self, model: LlamaRange, context: int, window: int | None,
                 recurrent: RecurrentState | None = None) -> None:
        self.model = model
        self.recurrent = recurrent
        self.context = context
        self.window = window
        self.captured: dict[tuple[int, int], Captured] = {}
        self.pool = torch.cuda.graph_pool_handle()  # shared by every capture below
        # One stream for every warm-up: the caching allocator reuses a freed block only on
        # the stream that allocated it, so a fresh stream per capture kept a fresh set of
        # warm-up buffers per captured run.
        self.warmup_stream = torch.cuda.Stream()

    def replay(self, run: tuple[int, int], inputs: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        captured = self.captured.get(run) or self._capture(run, inputs, positions)
        captured.inputs.copy_(inputs)
        captured.positions.copy_(positions)
        captured.graph.replay()
        return captured.output.clone()  # the next replay reuses the output buffer

    def _step(self, run: tuple[int, int], rows: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor:
        return self.model.run_layers(rows, decode_index(positions, run, self.context,
                                                        self.window))

    def _capture(self, run: tuple[int, int], inputs: torch.Tensor,
                 positions: torch.Tensor) -> Captured:
        # Static inputs hold this round's values, so the warm-up steps write the same K and V
        # the captured step will: running them changes no slot's state.
        static_inputs, static_positions = inputs.clone(), positions.clone()
        kept = self.recurrent.keep_aside(run) if self.recurrent is not None else None
        side = self.warmup_stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self._step(run, static_inputs, static_positions)
        torch.cuda.current_stream().wait_stream(side)
        if kept is not None:
            self.recurrent.put_back(run, kept)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = self._step(run, static_inputs, static_positions)
        captured = Captured(graph, static_inputs, static_positions, output)
        self.captured[run] = captured
        return captured

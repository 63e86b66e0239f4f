"""A PyTorch stage: one layer range on CUDA, MPS or the CPU, with its slots' state (KV, and
a hybrid's recurrent state)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from engine.backends.base import (
    BackendError,
    OpenedRange,
    Stage,
    StageSpec,
    require_draft_head,
)
from engine.backends.family_modules import family_module
from engine.backends.pytorch import dequant, packed_linear, sampling, stacked
from engine.backends.pytorch.compiled_step import (
    compiled_decode_block,
    compiled_layer_parts,
    compiles,
)
from engine.backends.pytorch.graphs import DecodeGraphs
from engine.backends.pytorch.kv_cache import RoundIndex
from engine.backends.pytorch.row_transfer import RowTransfer
from engine.config import ModelConfig
from engine.rounds import RowLayout
from engine.row_format import RowFormat
from engine.sampling import SampledRows, SamplingBatch


def torch_dtype(row_format: RowFormat) -> torch.dtype:
    return getattr(torch, row_format.name)  # the wire's labels are PyTorch's names


class TorchStage(Stage):
    def __init__(self, spec: StageSpec, config: ModelConfig, model: Any,
                 device: torch.device, *, int4_packed: bool = False) -> None:
        # `model`: the family module's range (engine.backends.family_modules).
        super().__init__(spec, config, model)
        self.device = device
        self.dtype = torch_dtype(self.row_format)
        self.graphs = None
        # FLEET_COMPILE: decode rounds of consecutive slots run their layers compiled.
        self.decode_step = None
        if compiles(spec.compile, device, config, int4_packed, spec.cuda_graphs):
            self.decode_step = compiled_decode_block()
            model.parts = compiled_layer_parts()  # the rounds the graphs do not take
        if device.type == "cuda":
            # cuDNN's attention built an execution plan on every masked call here (0.3 s of
            # host time a call on an H200, torch 2.11: the fixed cost of eager rounds); the
            # other SDPA kernels need no plan. One stage a process, so the switch is ours.
            torch.backends.cuda.enable_cudnn_sdp(False)
        if device.type == "cuda" and spec.cuda_graphs:
            self.graphs = DecodeGraphs(model, spec.context, config.sliding_window, model.recurrent,
                                       live_keys=spec.live_keys, step=self.decode_step)

    @staticmethod
    def _device(backend: str) -> torch.device:
        kind = backend.removeprefix("torch-")
        if kind == "cuda" and not torch.cuda.is_available():
            raise BackendError("backend torch-cuda: this PyTorch build sees no CUDA device")
        if kind == "mps" and not torch.backends.mps.is_available():
            raise BackendError("backend torch-mps: Metal is not available to this PyTorch")
        return torch.device(kind)

    @classmethod
    def _build(cls, spec: StageSpec, opened: OpenedRange, device: torch.device,
               on_layer: Callable[[int], None] | None) -> TorchStage:
        checkpoint, config, quant = opened.checkpoint, opened.config, opened.quant
        dtype = torch_dtype(RowFormat.of(config))

        packed = quant is not None and packed_linear.holds_packed(spec.quant, spec.backend,
                                                                  device, dtype, quant)
        # The embeddings are looked up by row; tied, they are the head's matmul too.
        lookups = {f"{config.weight_prefix}embed_tokens.weight": config.tie_word_embeddings}

        def load(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
            if quant is not None:  # mlx-lm's packed weights: kept packed, or made dense
                return dequant.load_range_tensors(checkpoint, shapes, quant, dtype, device,
                                                  packed=packed, lookups=lookups)
            for name, shape in shapes.items():
                checkpoint.check_shape(name, shape)
            tensors = checkpoint.load_tensors(list(shapes), "pt", str(device))
            return {n: t.to(dtype) for n, t in tensors.items()}

        family = family_module("engine.backends.pytorch", config)
        model = family.build_range(config, spec, load, device, dtype, on_layer)
        stacked.stack_on(device, model.layers)  # one matmul a group of projections
        int4_packed = packed and not packed_linear.traceable(model.layers)
        stage = cls(spec, config, model, device, int4_packed=int4_packed)
        if spec.draft_head and stage.is_first:
            stage.draft_head = load_draft_head(config, spec, load, model)
        return stage

    def recurrent_states(self) -> int:
        if self.model.recurrent is not None:  # what was preallocated, not what was asked for
            return self.model.recurrent.slots
        return super().recurrent_states()

    def _computing(self) -> torch.inference_mode:
        return torch.inference_mode()

    def _embed(self, token_ids: Sequence[int]) -> torch.Tensor:
        return self.model.embed_tokens(torch.tensor(token_ids, dtype=torch.int64,
                                                    device=self.device))

    def _run_layers(self, rows: torch.Tensor, layout: RowLayout) -> torch.Tensor:
        self.model.cache.cover(layout)  # pages for every position the rows write
        run = layout.single_span
        if run and not layout.spans and (self.graphs or self.decode_step):
            # Decode rows (verify rows among them) through a run of consecutive slots.
            positions = torch.tensor(layout.single_positions, dtype=torch.int64,
                                     device=self.device)
            offsets = torch.tensor([s - run[0] for s in layout.single_slots],
                                   dtype=torch.int64, device=self.device)
            if self.graphs:  # a shape the graphs have (or now capture)
                return self.graphs.replay(run, layout.single_keys, rows, positions, offsets,
                                          layout.rows_a_slot)
            # Compiled without graphs (the CPU, or CUDA with FLEET_CUDA_GRAPHS=0): the live
            # keys, whose count the compiled layer takes as a symbolic size.
            return self.model.run_decode(rows, positions, run, layout.single_keys,
                                         self.decode_step, offsets=offsets)
        index = RoundIndex.build(layout, self.device, self.config.sliding_window,
                                 recurrent=self.model.recurrent is not None)
        return self.model.run_layers(rows, index)

    def _finish(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device.type == "mps":
            torch.mps.synchronize()

    def _take_rows(self, rows: torch.Tensor, indices: list[int]) -> torch.Tensor:
        return rows[indices]

    def _empty_rows(self) -> torch.Tensor:
        return torch.empty(0, self.hidden_size, dtype=self.dtype, device=self.device)

    def rows_to_bytes(self, rows: torch.Tensor) -> memoryview:
        return self._row_transfer.to_wire(rows)

    def rows_landing(self, buffer: bytearray | memoryview) -> memoryview:
        return self._row_transfer.landing(buffer)

    def _rows_from_raw(self, raw: memoryview, n_rows: int) -> torch.Tensor:
        return self._row_transfer.from_wire(raw, n_rows)

    @functools.cached_property
    def _row_transfer(self) -> RowTransfer:
        # Pinned staging and landing memory on CUDA, sized for the largest round.
        bound = self.row_format.nbytes(self.spec.parallel + self.spec.chunk)
        return RowTransfer(self.device, self.dtype, bound)

    def _to_numpy(self, logits: torch.Tensor) -> np.ndarray:
        return logits.cpu().numpy()

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampledRows:
        return sampling.sample(logits, batch)


def load_draft_head(config: ModelConfig, spec: StageSpec,
                    load: Callable[[dict[str, tuple[int, ...]]], dict[str, torch.Tensor]],
                    model: Any) -> Any:
    """The checkpoint's MTP head on the first stage, sharing its embeddings, final norm,
    head and rotary tables; a BackendError where the checkpoint has none."""
    from engine.backends.pytorch.mtp_head import MtpHead

    require_draft_head(config, spec)
    with torch.inference_mode():
        return MtpHead.load(config, load, model.embed, model.head, model.norm, model.rope,
                            spec.parallel, spec.context)

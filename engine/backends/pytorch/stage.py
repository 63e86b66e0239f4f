"""A PyTorch stage: one layer range on CUDA, MPS or the CPU, with its slots' KV state."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from engine.backends.base import BackendError, RangeStage, StageSpec, layer_progress, open_range
from engine.backends.pytorch import dequant
from engine.backends.pytorch.graphs import DecodeGraphs
from engine.backends.pytorch.kv_cache import KVCache, RoundIndex
from engine.backends.pytorch.llama import LlamaRange, Rope
from engine.config import ModelConfig
from engine.rounds import RoundPlan, RowLayout

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_device(backend: str) -> torch.device:
    kind = backend.removeprefix("torch-")
    if kind == "cuda" and not torch.cuda.is_available():
        raise BackendError("backend torch-cuda: this PyTorch build sees no CUDA device")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise BackendError("backend torch-mps: Metal is not available to this PyTorch")
    return torch.device(kind)


class TorchStage(RangeStage):
    def __init__(self, spec: StageSpec, config: ModelConfig, model: LlamaRange,
                 device: torch.device) -> None:
        super().__init__(spec, config)
        self.model = model
        self.device = device
        self.dtype = TORCH_DTYPES[config.dtype]
        self.graphs = None
        if device.type == "cuda" and spec.cuda_graphs:
            self.graphs = DecodeGraphs(model, spec.context, config.sliding_window,
                                       takes_tokens=self.is_first)

    @classmethod
    def load(cls, spec: StageSpec,
             progress: Callable[[int, int, str], None] | None = None) -> TorchStage:
        opened = open_range(spec, TORCH_DTYPES)
        checkpoint, config, quant = opened.checkpoint, opened.config, opened.quant
        device = torch_device(spec.backend)
        dtype = TORCH_DTYPES[config.dtype]

        def load(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
            if quant is not None:  # mlx-lm's packed weights, made dense for this range
                return dequant.load_range_tensors(checkpoint, shapes, quant, dtype, device)
            for name, shape in shapes.items():
                checkpoint.check_shape(name, shape)
            tensors = checkpoint.load_tensors(list(shapes), "pt", str(device))
            return {n: t.to(dtype) for n, t in tensors.items()}

        layers = spec.layer_range[1] - spec.layer_range[0]
        cache = KVCache(layers, spec.parallel, config.num_key_value_heads, spec.context,
                        config.head_dim, dtype, device)
        rope = Rope(config, spec.context, device, dtype)
        with torch.inference_mode():
            model = LlamaRange(config, spec.layer_range, load, cache, rope,
                               layer_progress(spec, progress))
        return cls(spec, config, model, device)

    @torch.inference_mode()
    def forward(self, plan: RoundPlan, rows: torch.Tensor | None,
                token_ids: Sequence[int] | None) -> torch.Tensor:
        given = len(token_ids or ()) if self.is_first else (0 if rows is None else len(rows))
        self.check_rows_given(plan, given)
        self.slots.apply(plan)
        if not plan.total_rows:  # only closes and cancels: nothing to compute
            return torch.empty(0, self.hidden_size, dtype=self.dtype, device=self.device)
        layout = RowLayout.of(plan)
        if self.graphs and layout.single_run and not layout.spans:
            # Decode rows of consecutive slots, each returned: the graph's rows are the output.
            positions = torch.tensor(layout.single_positions, dtype=torch.int64,
                                     device=self.device)
            inputs = (torch.tensor(token_ids, dtype=torch.int64, device=self.device)
                      if self.is_first else rows)
            return self.graphs.replay(layout.single_run, inputs, positions)
        if self.is_first:
            ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
            rows = self.model.embed_tokens(ids)
        index = RoundIndex.build(layout, self.device, self.config.sliding_window)
        rows = self.model.run_layers(rows, index)
        if self.is_last:
            rows = rows[plan.returned_rows()]
        return rows

    @torch.inference_mode()
    def logits(self, rows: torch.Tensor) -> np.ndarray:
        return self.model.logits(rows).cpu().numpy()

    def rows_to_bytes(self, rows: torch.Tensor) -> memoryview:
        return memoryview(rows.contiguous().view(torch.uint8).cpu().numpy()).cast("B")

    def rows_from_bytes(self, data: Any, n_rows: int, dtype: str) -> torch.Tensor:
        if n_rows == 0:
            return torch.empty(0, self.hidden_size, dtype=self.dtype, device=self.device)
        if memoryview(data).readonly:  # torch views only writable memory without a warning
            data = bytearray(data)
        rows = torch.frombuffer(data, dtype=TORCH_DTYPES[dtype]).view(n_rows, self.hidden_size)
        # frombuffer aliases the receive buffer, which the link reuses: always take a copy.
        return rows.to(self.device, self.dtype, copy=True)

    @property
    def state_nbytes(self) -> int:
        return self.model.cache.nbytes

"""A PyTorch stage: one layer range on CUDA, MPS or the CPU, with its slots' KV state."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from engine.backends.base import BackendError, StageSpec
from engine.backends.pytorch import dequant
from engine.backends.pytorch.kv_cache import KVCache, RoundIndex
from engine.backends.pytorch.llama import LlamaRange, Rope
from engine.checkpoint.quantize import QuantConfig, QuantConfigError
from engine.checkpoint.reader import open_checkpoint
from engine.config import ModelConfig
from engine.rounds import RoundPlan
from engine.slots import SlotTable

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_device(backend: str) -> torch.device:
    kind = backend.removeprefix("torch-")
    if kind == "cuda" and not torch.cuda.is_available():
        raise BackendError("backend torch-cuda: this PyTorch build sees no CUDA device")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise BackendError("backend torch-mps: Metal is not available to this PyTorch")
    return torch.device(kind)


class TorchStage:
    planes = 1  # Llama-style rows carry one plane: the residual stream

    def __init__(self, spec: StageSpec, config: ModelConfig, model: LlamaRange,
                 device: torch.device) -> None:
        self.spec = spec
        self.config = config
        self.model = model
        self.device = device
        self.dtype = TORCH_DTYPES[config.dtype]
        self.layer_range = spec.layer_range
        self.is_first = spec.layer_range[0] == 0
        self.is_last = spec.layer_range[1] == config.num_hidden_layers
        self.hidden_size = config.hidden_size
        self.row_dtype = config.dtype
        self.slots = SlotTable(spec.parallel, spec.context)

    @classmethod
    def load(cls, spec: StageSpec,
             progress: Callable[[int, int, str], None] | None = None) -> TorchStage:
        checkpoint = open_checkpoint(spec.model_dir)
        config = ModelConfig.from_dict(checkpoint.config)
        if config.dtype not in TORCH_DTYPES:
            raise BackendError(f"config.json: dtype {config.dtype!r} is not supported")
        device = torch_device(spec.backend)
        dtype = TORCH_DTYPES[config.dtype]
        try:
            quant = QuantConfig.from_config(checkpoint.config)
        except QuantConfigError as exc:
            raise BackendError(str(exc)) from exc
        start, end = spec.layer_range
        if not 0 <= start < end <= config.num_hidden_layers:
            raise BackendError(
                f"layer range {start}:{end} is outside the model's {config.num_hidden_layers} layers"
            )

        def load(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
            if quant is not None:  # mlx-lm's packed weights, made dense for this range
                return dequant.load_range_tensors(checkpoint, shapes, quant, dtype, device)
            for name, shape in shapes.items():
                checkpoint.check_shape(name, shape)
            tensors = checkpoint.load_tensors(list(shapes), "pt", str(device))
            return {n: t.to(dtype) for n, t in tensors.items()}

        total = end - start
        cache = KVCache(total, spec.parallel, config.num_key_value_heads, spec.context,
                        config.head_dim, dtype, device)
        rope = Rope(config, spec.context, device, dtype)
        on_layer = (lambda layer: progress(layer - start + 1, total, "layers")) if progress else None
        with torch.inference_mode():
            model = LlamaRange(config, spec.layer_range, load, cache, rope, on_layer)
        return cls(spec, config, model, device)

    @torch.inference_mode()
    def forward(self, plan: RoundPlan, rows: torch.Tensor | None,
                token_ids: Sequence[int] | None) -> torch.Tensor:
        self.slots.apply(plan)
        if not plan.total_rows:  # only closes and cancels: nothing to compute
            return torch.empty(0, self.hidden_size, dtype=self.dtype, device=self.device)
        if self.is_first:
            ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
            rows = self.model.embed_tokens(ids)
        index = RoundIndex.build(plan, self.device, self.config.sliding_window)
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
        rows = torch.frombuffer(data, dtype=TORCH_DTYPES[dtype]).view(n_rows, self.hidden_size)
        # frombuffer aliases the receive buffer, which the link reuses: always take a copy.
        return rows.to(self.device, self.dtype, copy=True)

    def kv_capacity_rows(self) -> int:
        return self.spec.context

    @property
    def state_nbytes(self) -> int:
        return self.model.cache.nbytes

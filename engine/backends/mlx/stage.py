"""An MLX stage: one layer range on Metal, CUDA or the CPU, with its slots' KV state."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine.backends.base import (
    ROW_DTYPES,
    BackendError,
    RangeStage,
    StageSpec,
    layer_progress,
    open_range,
)
from engine.backends.mlx.kv_cache import KVCache, RoundIndex
from engine.backends.mlx.llama import LlamaRange, Rope
from engine.backends.mlx.quant import QuantizedWeight, Weight
from engine.checkpoint.quantize import QuantConfig
from engine.config import ModelConfig
from engine.rounds import RoundPlan, RowLayout

MLX_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
# numpy has no bfloat16: its rows cross numpy as their raw 16-bit patterns.
WIRE_NUMPY = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.float16}


def mlx_device(backend: str) -> mx.Device:
    kind = backend.removeprefix("mlx-")
    if kind == "cpu":
        return mx.cpu
    if kind == "metal" and not mx.metal.is_available():
        raise BackendError("backend mlx-metal: this MLX build sees no Metal device")
    cuda = getattr(mx, "cuda", None)  # absent from builds without the CUDA back end
    if kind == "cuda" and not (cuda and cuda.is_available()):
        raise BackendError("backend mlx-cuda: this MLX build sees no CUDA device")
    return mx.gpu


def load_range_tensors(checkpoint: Any, shapes: dict[str, tuple[int, ...]], dtype: mx.Dtype,
                       quant: QuantConfig | None = None) -> dict[str, Weight]:
    """The named tensors, shape-checked, in `dtype`, read from their safetensors files.

    `mx.load` maps a safetensors file lazily: an array is read from disk only when it is
    evaluated, so a range reads only its own tensors however the shards are cut. It also
    reads bfloat16 natively, which safetensors' numpy route (and so its "mlx" one) cannot.
    A weight stored packed by mlx-lm (uint32) comes back as a `QuantizedWeight` under its
    `.weight` name, its scales and biases checked and read beside it.
    """
    files: dict[Path, dict[str, mx.array]] = {}

    def lazy(name: str) -> mx.array:
        path = Path(checkpoint.tensor_file(name))
        if path not in files:
            files[path] = mx.load(str(path))
        return files[path][name]

    out: dict[str, Weight] = {}
    for name, shape in shapes.items():
        layer = name.removesuffix(".weight")
        packed = len(shape) == 2 and lazy(name).dtype == mx.uint32
        params = quant.params(layer, packed) if quant else None
        if params is None:
            checkpoint.check_shape(name, shape)
            out[name] = lazy(name).astype(dtype)
            continue
        packed_shapes = params.packed_shapes(layer, *shape)
        for packed_name, packed_shape in packed_shapes.items():
            checkpoint.check_shape(packed_name, packed_shape)
        out[name] = QuantizedWeight(lazy(name), lazy(layer + ".scales").astype(dtype),
                                    lazy(layer + ".biases").astype(dtype),
                                    params.group_size, params.bits)
    mx.eval([[w.weight, w.scales, w.biases] if isinstance(w, QuantizedWeight) else w
             for w in out.values()])
    return out


class MlxStage(RangeStage):
    def __init__(self, spec: StageSpec, config: ModelConfig, model: LlamaRange,
                 device: mx.Device) -> None:
        super().__init__(spec, config)
        self.model = model
        self.device = device
        self.dtype = MLX_DTYPES[config.dtype]

    @classmethod
    def load(cls, spec: StageSpec,
             progress: Callable[[int, int, str], None] | None = None) -> MlxStage:
        device = mlx_device(spec.backend)
        opened = open_range(spec, MLX_DTYPES)
        checkpoint, config, quant = opened.checkpoint, opened.config, opened.quant
        dtype = MLX_DTYPES[config.dtype]
        total = spec.layer_range[1] - spec.layer_range[0]
        on_layer = layer_progress(spec, progress)
        # Streams follow the device, so two stages in one process (tests) can sit on
        # different devices without touching the process-wide default.
        with mx.stream(device):
            cache = KVCache(total, spec.parallel, config.num_key_value_heads, spec.context,
                            config.head_dim, dtype)
            model = LlamaRange(config, spec.layer_range,
                               lambda shapes: load_range_tensors(checkpoint, shapes, dtype, quant),
                               cache, Rope(config), on_layer)
        return cls(spec, config, model, device)

    def forward(self, plan: RoundPlan, rows: mx.array | None,
                token_ids: Sequence[int] | None) -> mx.array:
        given = len(token_ids or ()) if self.is_first else (0 if rows is None else rows.shape[0])
        self.check_rows_given(plan, given)
        self.slots.apply(plan)
        with mx.stream(self.device):
            if self.is_first and token_ids:
                rows = self.model.embed_tokens(mx.array(list(token_ids), dtype=mx.int32))
            elif not given:  # a round without rows: keep-alive, close, cancel
                rows = mx.zeros((0, self.hidden_size), dtype=self.dtype)
            if plan.total_rows:
                index = RoundIndex.build(RowLayout.of(plan), self.config.sliding_window)
                rows = self.model.run_layers(rows, index)
            if self.is_last:
                rows = rows[mx.array(plan.returned_rows(), dtype=mx.int32)]
            # MLX is lazy: evaluate the rows and every cache write now, so the round's time
            # is spent here and the next round starts from settled buffers.
            mx.eval(rows, self.model.cache.arrays())
        return rows

    def logits(self, rows: mx.array) -> np.ndarray:
        with mx.stream(self.device):
            logits = self.model.logits(rows)
            mx.eval(logits)
        return np.array(logits, copy=True)  # [rows, vocab] float32

    def rows_to_bytes(self, rows: mx.array) -> memoryview:
        # Viewed as bytes inside MLX, so bfloat16 never passes through a float type numpy has.
        raw = np.ascontiguousarray(np.array(rows.view(mx.uint8), copy=True))
        return memoryview(raw).cast("B")

    def rows_from_bytes(self, data: Any, n_rows: int, dtype: str) -> mx.array:
        if dtype not in ROW_DTYPES:
            raise BackendError(f"rows in unknown dtype {dtype!r} (known: {', '.join(ROW_DTYPES)})")
        expected = n_rows * self.hidden_size * ROW_DTYPES[dtype]
        if len(memoryview(data).cast("B")) != expected:
            raise BackendError(f"{n_rows} rows of {self.hidden_size} {dtype} values need "
                               f"{expected} bytes, got {len(memoryview(data).cast('B'))}")
        if n_rows == 0:
            return mx.zeros((0, self.hidden_size), dtype=self.dtype)
        values = np.frombuffer(data, dtype=WIRE_NUMPY[dtype]).reshape(n_rows, self.hidden_size)
        with mx.stream(self.device):
            # mx.array copies, so the link may reuse its receive buffer once this returns.
            rows = mx.array(values)
            if dtype == "bfloat16":
                rows = rows.view(mx.bfloat16)
            rows = rows.astype(self.dtype)
            mx.eval(rows)
        return rows

    @property
    def state_nbytes(self) -> int:
        return self.model.cache.nbytes

"""An MLX stage: one layer range on Metal, CUDA or the CPU, with its slots' state (KV, and a
hybrid's recurrent state)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine.backends.base import (
    BackendError,
    OpenedRange,
    Stage,
    StageSpec,
    require_draft_head,
)
from engine.backends.family_modules import family_module
from engine.backends.mlx import sampling
from engine.backends.mlx.quant import QuantizedWeight, Weight
from engine.checkpoint.quant_config import QuantConfig
from engine.config import ModelConfig
from engine.rounds import RowLayout
from engine.row_format import RowFormat
from engine.sampling import SampledRows, SamplingBatch


def mlx_dtype(row_format: RowFormat) -> mx.Dtype:
    return getattr(mx, row_format.name)  # the wire's labels are MLX's names


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


class MlxStage(Stage):
    def __init__(self, spec: StageSpec, config: ModelConfig, model: Any,
                 device: mx.Device) -> None:
        # `model`: the family module's range (engine.backends.family_modules).
        super().__init__(spec, config, model)
        self.device = device
        self.dtype = mlx_dtype(self.row_format)

    @staticmethod
    def _device(backend: str) -> mx.Device:
        kind = backend.removeprefix("mlx-")
        if kind == "cpu":
            return mx.cpu
        if kind == "metal" and not mx.metal.is_available():
            raise BackendError("backend mlx-metal: this MLX build sees no Metal device")
        cuda = getattr(mx, "cuda", None)  # absent from builds without the CUDA back end
        if kind == "cuda" and not (cuda and cuda.is_available()):
            raise BackendError("backend mlx-cuda: this MLX build sees no CUDA device")
        return mx.gpu

    @classmethod
    def _build(cls, spec: StageSpec, opened: OpenedRange, device: mx.Device,
               on_layer: Callable[[int], None] | None) -> MlxStage:
        checkpoint, config, quant = opened.checkpoint, opened.config, opened.quant
        dtype = mlx_dtype(RowFormat.of(config))

        def load(shapes: dict[str, tuple[int, ...]]) -> dict[str, Weight]:
            return load_range_tensors(checkpoint, shapes, dtype, quant)

        family = family_module("engine.backends.mlx", config)
        # Streams follow the device, so two stages in one process (tests) can sit on
        # different devices without touching the process-wide default.
        with mx.stream(device):
            model = family.build_range(config, spec, load, dtype, on_layer)
            stage = cls(spec, config, model, device)
            if spec.draft_head and stage.is_first:
                stage.draft_head = load_draft_head(config, spec, load, model, dtype)
        return stage

    def _computing(self) -> Any:
        return mx.stream(self.device)

    def _embed(self, token_ids: Sequence[int]) -> mx.array:
        return self.model.embed_tokens(mx.array(list(token_ids), dtype=mx.int32))

    def _run_layers(self, rows: mx.array, layout: RowLayout) -> mx.array:
        self.model.cache.cover(layout)  # pages for every position the rows write
        return self.model.run_layers(rows, self.model.round_index(layout))

    def _take_rows(self, rows: mx.array, indices: list[int]) -> mx.array:
        return rows[mx.array(indices, dtype=mx.int32)]

    def _settle(self, rows: mx.array) -> mx.array:
        # MLX is lazy: evaluate the rows and every cache write now, so the round's time
        # is spent here and the next round starts from settled buffers.
        mx.eval(rows, self.model.cache.arrays())
        return rows

    def _empty_rows(self) -> mx.array:
        return mx.zeros((0, self.hidden_size), dtype=self.dtype)

    def rows_to_bytes(self, rows: mx.array) -> memoryview:
        # Viewed as bytes inside MLX, so bfloat16 never passes through a float type numpy has.
        raw = np.ascontiguousarray(np.array(rows.view(mx.uint8), copy=True))
        return memoryview(raw).cast("B")

    def _rows_from_raw(self, raw: memoryview, n_rows: int) -> mx.array:
        # Unsigned integers of the value's width carry the bits through numpy (which has no
        # bfloat16), and mx.array copies them, so the link may reuse its buffer at once.
        values = np.frombuffer(raw, dtype=self.row_format.raw_numpy).reshape(n_rows, -1)
        return mx.array(values).view(self.dtype)

    def _to_numpy(self, logits: mx.array) -> np.ndarray:
        mx.eval(logits)
        return np.array(logits, copy=True)  # [rows, vocab] float32

    def _sample(self, logits: mx.array, batch: SamplingBatch) -> SampledRows:
        return sampling.sample(logits, batch)


def load_draft_head(config: ModelConfig, spec: StageSpec,
                    load: Callable[[dict[str, tuple[int, ...]]], dict[str, Weight]],
                    model: Any, dtype: mx.Dtype) -> Any:
    """The checkpoint's MTP head on the first stage, sharing its embeddings, final norm,
    head and rotary; a BackendError where the checkpoint has none."""
    from engine.backends.mlx.mtp_head import MtpHead

    require_draft_head(config, spec)
    return MtpHead.load(config, load, model, spec.parallel, spec.context, dtype)

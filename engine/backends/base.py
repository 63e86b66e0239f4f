"""The interface every backend's stage offers, and how a backend is picked by name."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from engine.checkpoint.quantize import QuantConfig, QuantConfigError
from engine.checkpoint.reader import Checkpoint, open_checkpoint
from engine.config import ModelConfig
from engine.rounds import RoundPlan
from engine.slots import SlotTable

if sys.byteorder != "little":  # rows and frames are little-endian raw values
    raise ImportError("ringfleet needs a little-endian host")

BACKENDS = ("torch-cuda", "torch-mps", "torch-cpu", "mlx-metal", "mlx-cuda", "mlx-cpu")
ROW_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}  # name -> bytes per value


class BackendError(RuntimeError):
    """A backend that is not installed, or a device it cannot use."""


@dataclass(frozen=True)
class StageSpec:
    """What one engine process runs: a layer range of a checkpoint on a backend."""

    model_dir: Path
    layer_range: tuple[int, int]  # half-open, global layer indices
    backend: str
    parallel: int  # slots
    context: int  # positions a slot can hold
    chunk: int  # most prompt rows a round
    cuda_graphs: bool = True  # replay decode rounds as CUDA graphs where the device has them


class Stage(Protocol):
    """One layer range, loaded and holding per-slot state.

    Rows are backend tensors of shape [rows, hidden] in the engine's row dtype.
    """

    layer_range: tuple[int, int]
    is_first: bool  # holds the embeddings, final norm and head (rank 0)
    is_last: bool  # sends only the rows rank 0 needs back
    hidden_size: int
    row_dtype: str
    planes: int  # hidden planes on the wire (1 for Llama-style families)

    def forward(self, plan: RoundPlan, rows: Any | None, token_ids: Sequence[int] | None) -> Any:
        """Embed (first stage), run this range over the round, keep the returned rows (last)."""

    def logits(self, rows: Any) -> Any:
        """Final norm and head over returned rows: float32 numpy array [rows, vocab]."""

    def rows_to_bytes(self, rows: Any) -> memoryview:
        """Rows as raw little-endian values, plane-major (the engine's dtype, bit for bit)."""

    def rows_from_bytes(self, data: bytes | bytearray | memoryview, n_rows: int,
                        dtype: str) -> Any:
        """Rows from a neighbour's bytes in `dtype`, converted bit-exactly to this stage's."""

    def kv_capacity_rows(self) -> int:
        """Positions one slot can hold."""


@dataclass(frozen=True)
class OpenedRange:
    """A checkpoint opened for one stage, its range checked against the model."""

    checkpoint: Checkpoint
    config: ModelConfig
    quant: QuantConfig | None  # None: a dense checkpoint


def open_range(spec: StageSpec, dtypes: Iterable[str]) -> OpenedRange:
    """Open the checkpoint and refuse what no backend could run, before any tensor is read."""
    checkpoint = open_checkpoint(spec.model_dir)
    config = ModelConfig.from_dict(checkpoint.config)
    if config.dtype not in dtypes:
        raise BackendError(f"config.json: dtype {config.dtype!r} is not supported")
    try:
        quant = QuantConfig.from_config(checkpoint.config)
    except QuantConfigError as exc:
        raise BackendError(str(exc)) from exc
    start, end = spec.layer_range
    if not 0 <= start < end <= config.num_hidden_layers:
        raise BackendError(
            f"layer range {start}:{end} is outside the model's {config.num_hidden_layers} layers")
    return OpenedRange(checkpoint, config, quant)


class RangeStage:
    """What every backend's stage knows of its place: the Stage protocol's plain fields."""

    planes = 1  # Llama-style rows carry one plane: the residual stream

    def __init__(self, spec: StageSpec, config: ModelConfig) -> None:
        self.spec = spec
        self.config = config
        self.layer_range = spec.layer_range
        self.is_first = spec.layer_range[0] == 0
        self.is_last = spec.layer_range[1] == config.num_hidden_layers
        self.hidden_size = config.hidden_size
        self.row_dtype = config.dtype
        self.slots = SlotTable(spec.parallel, spec.context)

    def kv_capacity_rows(self) -> int:
        return self.spec.context

    def check_rows_given(self, plan: RoundPlan, given: int) -> None:
        """Refuse a round whose row count is not the plan's, before the slot table moves."""
        if given != plan.total_rows:
            raise BackendError(f"round {plan.round_no}: the plan runs {plan.total_rows} rows, "
                               f"this stage was given {given}")



def layer_progress(spec: StageSpec, progress: Callable[[int, int, str], None] | None
                   ) -> Callable[[int], None] | None:
    """A per-layer callback reporting (layers done, layers in range, "layers"), or None."""
    if progress is None:
        return None
    start, end = spec.layer_range
    return lambda layer: progress(layer - start + 1, end - start, "layers")


def load_stage(spec: StageSpec, *, progress: Any = None) -> Stage:
    """Load a stage on the named backend; imports the framework only when asked for."""
    if spec.backend not in BACKENDS:
        raise BackendError(f"unknown backend {spec.backend!r} (known: {', '.join(BACKENDS)})")
    if spec.backend.startswith("torch-"):
        from engine.backends.pytorch.stage import TorchStage

        return TorchStage.load(spec, progress=progress)
    try:
        from engine.backends.mlx.stage import MlxStage
    except ImportError as exc:
        raise BackendError(f"backend {spec.backend} needs MLX: {exc}") from exc
    return MlxStage.load(spec, progress=progress)

"""The interface every backend's stage offers, and how a backend is picked by name."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from engine.rounds import RoundPlan

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

"""Calibration's timer: a real engine stage over a synthetic layer range, one round at a time.

The stage is the one serving would load (`engine.backends.base.load_stage`: the same
classes, CUDA graphs, compiled decode step and packed kernels), over a checkpoint of random
weights that holds only the timed range (`engine.checkpoint.synthetic`). So a layer's
milliseconds are those of the code a ring runs, not of a rebuilt copy of it.

The range is [1, 1 + layers) of a model cut to 2 + layers layers all of one type: neither
the first nor the last range, so it builds no embeddings, norm or head, and a hybrid's
DeltaNet and attention layers are timed apart (they cost differently, and the gap moves
with context and rows). Rank 0's head is timed on a stage of its own, layer 0 with the
embeddings, final norm and head, through `sample` as a round's returned rows are.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from engine.config import ConfigError, ModelConfig
from engine.rounds import Op, RoundPlan, RowLayout, StreamEntry

WEIGHT_STD = 0.02


class TimerError(RuntimeError):
    """The stage cannot be built here: no such device, a dtype the backend lacks, a bad shape."""


def cut_config(raw: dict[str, Any], layer_type: str, layers: int, dtype: str = "") -> dict:
    """config.json's dict cut to 2 + `layers` layers all of `layer_type`, in `dtype` if given.

    A conditional-generation config (Qwen3.5's) keeps its text model's fields in
    `text_config`: the layers are cut there.
    """
    raw = copy.deepcopy(raw)
    text = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    text["num_hidden_layers"] = 2 + layers
    text["layer_types"] = [layer_type] * (2 + layers)
    text.pop("full_attention_interval", None)
    if dtype:
        for where in (raw, text):
            where.pop("dtype", None)
            where["torch_dtype"] = dtype
    return raw


def decode_plan(context: int, rows: int) -> RoundPlan:
    """`rows` streams (slots 0..rows-1) of one row each, attending over `context` keys."""
    return RoundPlan(1, tuple(StreamEntry(slot, Op.CONTINUE, context - 1, 1, 1, 0, 0)
                              for slot in range(rows)))


def decode_layout(context: int, rows: int) -> RowLayout:
    """`decode_plan`'s layout."""
    return RowLayout.of(decode_plan(context, rows))


def prefill_layout(context: int, rows: int) -> RowLayout:
    """One prompt chunk of `rows` rows at positions [context - rows, context)."""
    return RowLayout.of(RoundPlan(1, (StreamEntry(0, Op.OPEN, context - rows, rows, 0, 0, 0),)))


def random_row_bytes(rows: int, hidden: int, dtype: str, seed: int = 0) -> bytes:
    """`rows` rows of N(0, 0.5) values as the wire carries them (`dtype`, little-endian)."""
    values = np.random.default_rng(seed).standard_normal((rows, hidden), dtype=np.float32) * 0.5
    if dtype == "bfloat16":  # the top half of each float32 (numpy has no bfloat16)
        return (values.view("<u4") >> np.uint32(16)).astype("<u2").tobytes()
    return values.astype({"float32": "<f4", "float16": "<f2"}[dtype]).tobytes()


class StageTimer:
    """One real stage over a synthetic range of `layer_type` layers, written under `workdir`."""

    def __init__(self, raw_config: dict[str, Any], backend: str, layers: int, slots: int,
                 context: int, chunk: int, workdir: Path, *, layer_type: str, dtype: str = "",
                 threads: int = 0, stage_options: dict[str, Any] | None = None,
                 head: bool = False) -> None:
        """`head`: the stage is rank 0's, layer 0 of two, holding the embeddings, final norm
        and head, and its rounds are `sample`'s (`make_round("head", ...)`)."""
        from engine.backends.base import BackendError, StageSpec, load_stage
        from engine.checkpoint.quant_config import QuantConfigError
        from engine.checkpoint.reader import CheckpointError
        from engine.checkpoint.synthetic import write_range

        self.threads = 0  # a torch stage's intra-op threads, as recorded; MLX keeps its own
        if backend.startswith("torch-"):
            import torch

            if threads:
                torch.set_num_threads(threads)
            self.threads = torch.get_num_threads()
        raw = cut_config(raw_config, layer_type, 0 if head else layers, dtype)
        layer_range = (0, 1) if head else (1, 1 + layers)
        try:
            self.config = ModelConfig.from_dict(raw)
            checkpoint = write_range(workdir, raw, layer_range, WEIGHT_STD, ends=head)
            spec = StageSpec(Path(workdir), layer_range, backend, parallel=slots,
                             context=context, chunk=chunk, **(stage_options or {}))
            self.stage = load_stage(spec, checkpoint=checkpoint)
        except BackendError as exc:  # names the backend already
            raise TimerError(str(exc)) from exc
        except (ConfigError, QuantConfigError, CheckpointError, ValueError) as exc:
            raise TimerError(f"{backend}: {exc}") from exc

    @property
    def model(self) -> Any:
        """The stage's family range (its layers, as the stage holds them)."""
        return self.stage.model

    def make_round(self, kind: str, context: int, rows: int) -> Callable[[], None]:
        """One decode round of `rows` streams over `context` keys, or one prompt chunk of
        `rows` rows ending at `context`, run to completion each call; "round": the decode
        round as a serving stage runs it, plan and all (`_serving_round`); "head": rank 0's final
        norm, head and sampling of `rows` returned rows (a head timer's only round), each row
        drawn with the default parameters, as a request that sets none is."""
        raw = random_row_bytes(rows, self.config.hidden_size, self.stage.row_format.name)
        x = self.stage.rows_from_bytes(raw, rows)
        if kind == "head":
            from engine.sampling import RowDraw, SamplingBatch, SamplingParams

            batch = SamplingBatch.of([RowDraw(i, SamplingParams(), 0.5) for i in range(rows)])
            return lambda: self.stage.sample(x, batch)
        if kind == "round":
            return self._serving_round(x, context, rows)
        layout = (decode_layout if kind == "decode" else prefill_layout)(context, rows)
        return lambda: self.stage.run_layers_again(x, layout)

    def _serving_round(self, x: Any, context: int, rows: int) -> Callable[[], None]:
        """A decode round as a serving stage runs it (`Stage.forward_again`), each time from
        its slots open at `context - 1` positions, where the plan's rows expect them."""
        from engine.slots import Slot

        start = [Slot(open=True, offset=context - 1, last_rows=1)] * rows
        plan = decode_plan(context, rows)
        return lambda: self.stage.forward_again(plan, x, start)

"""The stage every backend offers: one layer range's skeleton, and how a backend is picked.

`Stage` writes the round once (checks, slot table, embed, layers, returned rows, bytes in
and out); a backend supplies only the framework's operations, as the hooks at the end
of the class. Two backends then cannot drift apart on what a round means.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.backend_names import BACKENDS, HEAD_DRAFTERS, drafts
from engine.checkpoint.quant_config import QuantConfig, QuantConfigError
from engine.checkpoint.reader import Checkpoint, open_checkpoint
from engine.config import ConfigError, ModelConfig
from engine.families.kinds import VERIFY_STATES
from engine.heap import release_freed
from engine.rounds import Op, RoundPlan, RowLayout
from engine.row_format import RowFormat
from engine.sampling import SampledRows, SamplingBatch
from engine.slots import Slot, SlotTable

if TYPE_CHECKING:
    from engine.draft_head import DraftAsk, DraftHead
    from engine.env import EngineEnv

if sys.byteorder != "little":  # rows and frames are little-endian raw values
    raise ImportError("ringfleet needs a little-endian host")

Progress = Callable[[int, int, str], None]  # (done, total, unit), as load_progress reports


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
    # False: captured decode steps read the whole context instead of the live length's
    # bucket (the earlier path, kept for bench/decode.py to time beside the new one).
    live_keys: bool = True
    delta_kernel: str = "auto"  # the gated delta rule's kernels: one of DELTA_KERNELS
    quant: str = "auto"  # FLEET_QUANT: how mlx-lm's packed weights are held (quant_policy)
    compile: str = "auto"  # FLEET_COMPILE: one of COMPILE_MODES
    # Rank 0 drafts (FLEET_DRAFTER): a hybrid's stages keep a recurrent state per verify row.
    drafting: bool = False
    # Rank 0 drafts with the checkpoint's draft head (FLEET_DRAFTER=mtp): its first stage
    # loads the head (engine.draft_head) beside the embeddings, and the last stage returns
    # every row of a round, since the head reads a prompt's rows too.
    draft_head: bool = False
    # KV pages of the stage's pool (FLEET_KV_PAGES), counted in its slot table; 0: every
    # slot's whole context.
    kv_pages: int = 0

    @property
    def verify_states(self) -> int:
        """Recurrent states a hybrid's stage keeps per slot for verify rows: one after each
        row but the last where the model drafts, else none."""
        return VERIFY_STATES if self.drafting else 0

    @classmethod
    def of(cls, env: EngineEnv, n_layers: int) -> StageSpec:
        """The stage an engine's environment contract asks for, of a model of `n_layers`."""
        return cls(env.model_dir, env.layer_range or (0, n_layers), env.backend, env.slots,
                   env.context, env.chunk, env.cuda_graphs, delta_kernel=env.delta_kernel,
                   quant=env.quant, compile=env.compile, drafting=drafts(env.drafter),
                   draft_head=env.drafter in HEAD_DRAFTERS, kv_pages=env.kv_pages)


@dataclass(frozen=True)
class OpenedRange:
    """A checkpoint opened for one stage, its range checked against the model."""

    checkpoint: Checkpoint
    config: ModelConfig
    quant: QuantConfig | None  # None: a dense checkpoint


def open_range(spec: StageSpec, checkpoint: Checkpoint | None = None) -> OpenedRange:
    """Refuse what no backend could run, before any tensor is read.

    `checkpoint` is the caller's, already opened (the engine opens it once per start);
    without it the spec's directory is opened here.
    """
    if checkpoint is None:
        checkpoint = open_checkpoint(spec.model_dir)
    elif Path(checkpoint.dir).resolve() != Path(spec.model_dir).resolve():
        raise ValueError(f"the checkpoint given is {checkpoint.dir}, the stage's is "
                         f"{spec.model_dir}")
    config = ModelConfig.from_dict(checkpoint.config)
    try:
        RowFormat.of(config)
        quant = QuantConfig.from_config(checkpoint.config)
    except (ConfigError, QuantConfigError) as exc:
        raise BackendError(str(exc)) from exc
    start, end = spec.layer_range
    if not 0 <= start < end <= config.num_hidden_layers:
        raise BackendError(
            f"layer range {start}:{end} is outside the model's {config.num_hidden_layers} layers")
    return OpenedRange(checkpoint, config, quant)


def require_draft_head(config: ModelConfig, spec: StageSpec) -> None:
    """A BackendError naming the checkpoint where FLEET_DRAFTER=mtp finds no MTP head in it:
    what both backends check before they load one."""
    if not config.family.draft_head_tensors(config):
        raise BackendError(f"FLEET_DRAFTER=mtp needs a checkpoint with an MTP head: "
                           f"{spec.model_dir}/config.json gives mtp_num_hidden_layers "
                           f"{config.mtp_num_hidden_layers} for model_type {config.model_type}")


def layer_progress(spec: StageSpec, progress: Progress | None) -> Callable[[int], None] | None:
    """A per-layer callback reporting (layers done, layers in range, "layers"), or None."""
    if progress is None:
        return None
    start, end = spec.layer_range
    return lambda layer: progress(layer - start + 1, end - start, "layers")


class Stage(ABC):
    """One layer range, loaded and holding per-slot state: what the round runners drive.

    Rows are backend tensors of shape [rows, hidden] in the row format's dtype. `model`
    is the backend's family range (`embed_tokens`, `run_layers`, `logits`, `cache`).
    """

    def __init__(self, spec: StageSpec, config: ModelConfig, model: Any) -> None:
        self.spec = spec
        self.config = config
        self.model = model
        self.layer_range = spec.layer_range
        self.is_first = spec.layer_range[0] == 0  # holds the embeddings, final norm and head
        self.is_last = spec.layer_range[1] == config.num_hidden_layers  # returns few rows
        self.hidden_size = config.hidden_size
        self.row_format = RowFormat.of(config)  # what goes on the wire, both ways
        self.slots = SlotTable(spec.parallel, spec.context, can_roll_back=not config.is_hybrid,
                               chunk=spec.chunk, keeps_verify_rows=spec.drafting,
                               pages=spec.kv_pages)
        # The checkpoint's draft head (engine.draft_head) where rank 0 drafts with it.
        self.draft_head: DraftHead | None = None

    @classmethod
    def load(cls, spec: StageSpec, checkpoint: Checkpoint | None = None,
             progress: Progress | None = None) -> Stage:
        """The device first (a missing one is named before any file is read), then the range."""
        device = cls._device(spec.backend)
        stage = cls._build(spec, open_range(spec, checkpoint), device,
                           layer_progress(spec, progress))
        # What loading freed (read buffers, unpacked codes) goes back to the system, or the
        # process stays resident at its loading high-water mark (engine/heap.py).
        release_freed()
        return stage

    @property
    def weights_nbytes(self) -> int:
        """Bytes of every weight this stage holds, a tied table counted once: what placement
        charges for its weights (tests/engine/test_packed_memory.py checks it byte for byte),
        and what `fleetctl status` sets its resident set against."""
        model = self.model
        weights = [w for layer in model.layers for w in vars(layer).values() if w is not None]
        weights += [w for w in (model.embed, model.norm) if w is not None]
        if model.head is not None and model.head is not model.embed:
            weights.append(model.head)
        return sum(int(w.nbytes) for w in weights)

    @property
    def state_nbytes(self) -> int:
        """Bytes of per-slot state this stage holds: KV, and a hybrid's recurrent state
        (and on rank 0, a draft head's weights and KV)."""
        head = self.draft_head.nbytes if self.draft_head is not None else 0
        return self.model.cache.nbytes + head

    def kv_capacity_rows(self) -> int:
        """Positions one slot can hold."""
        return self.spec.context

    def recurrent_states(self) -> int:
        """Recurrent states this stage holds (RFC 6.4's floor: at least --parallel).

        A hybrid preallocates one per slot; a dense model needs none, so any stream count
        fits and its slots are the bound.
        """
        return self.spec.parallel

    def forward(self, plan: RoundPlan, rows: Any | None, token_ids: Sequence[int] | None) -> Any:
        """Embed (first stage), run this range over the round, keep the returned rows (last).

        A round whose row count is not the plan's is refused before the slot table moves.
        """
        given = (len(token_ids) if token_ids is not None else 0) if self.is_first \
            else (len(rows) if rows is not None else 0)
        if given != plan.total_rows:
            raise BackendError(f"round {plan.round_no}: the plan runs {plan.total_rows} rows, "
                               f"this stage was given {given}")
        saving = [e.stream_id for e in plan.entries if self.slots.saves_snapshot(e)]
        # Read before the table moves: whether each slot's last entry was a verify entry.
        keeping = [e for e in plan.entries if self.slots.restores_draft(e)]
        self.slots.apply(plan)
        self._drop_state([e.stream_id for e in plan.entries if e.op in (Op.OPEN, Op.CANCEL)])
        # A hybrid keeps part of a verify entry from the states kept after its rows; before
        # the return below, since the table moved even for an entry of no rows.
        with self._computing():
            for entry in keeping:
                self.model.cache.keep_verified(entry.stream_id, entry.accepted)
        if not plan.total_rows:  # only closes and cancels: nothing to compute
            return self._empty_rows()
        with self._computing():
            if not self.slots.can_roll_back:  # a recurrent state resumes from its snapshot
                for entry in plan.entries:
                    if entry.op == Op.RESUME:
                        self.model.cache.restore_recurrent(entry.stream_id)
            x = self._embed(token_ids) if self.is_first else rows  # [rows, hidden]
            layout = RowLayout.of(plan)
            x = self._run_layers(x, layout)
            for slot in saving:  # where a full prompt chunk ended: a later RESUME's start
                self.model.cache.save_recurrent(slot)
            returned = plan.returned_rows(self.spec.draft_head)
            if self.is_last and len(returned) < plan.total_rows:
                x = self._take_rows(x, returned)  # [streams, hidden]
            return self._settle(x)

    def run_layers_again(self, rows: Any, layout: RowLayout) -> Any:
        """This range's layers over `rows` as a round of `layout` runs them, finished, with
        the slot table left as it was: what calibration times, as often as it likes.

        The path is a serving round's (CUDA graphs, the compiled step, packed kernels); the
        state it writes (KV rows, a hybrid's recurrent state) lands where the round's would,
        over and over.
        """
        with self._computing():
            rows = self._settle(self._run_layers(rows, layout))
            self._finish()
            return rows

    def forward_again(self, plan: RoundPlan, rows: Any, start: Sequence[Slot]) -> None:
        """`forward` over `plan`, finished, from the slot table's first slots set to `start`:
        a served round (the plan checked and applied, the layout built, the rows settled)
        that calibration can time against `run_layers_again` as often as it likes."""
        self.slots.slots[:len(start)] = start
        self.forward(plan, rows, None)
        with self._computing():
            self._finish()

    def logits(self, rows: Any) -> Any:
        """Final norm and head over returned rows: float32 numpy array [rows, vocab]."""
        with self._computing():
            return self._to_numpy(self.model.logits(rows))

    def sample(self, rows: Any, batch: SamplingBatch) -> SampledRows:
        """Final norm, head and sampling over returned rows, all on this stage's device.

        Only token ids and the logprobs asked for come to the host (and every row's logits
        when `batch.keep_logits`, for tests and traces)."""
        with self._computing():
            logits = self.model.logits(rows)
            sampled = self._sample(logits, batch)
            if batch.keep_logits:
                sampled = replace(sampled, logits=self._to_numpy(logits))
            return sampled

    def take_rows(self, rows: Any, indices: list[int]) -> Any:
        """rows[indices], a new array: the rows the head scores among every returned row
        where rank 0 drafts with a draft head (RoundPlan.returned_rows)."""
        with self._computing():
            return self._settle(self._take_rows(rows, indices))

    def draft_rows(self, rows: Any) -> Any:
        """What the draft head reads of a round's returned rows (their final norm), held
        apart from the stage's buffers so the drafter may read them after the next launch."""
        with self._computing():
            return self._settle(self.draft_head.normed(rows))

    def draft(self, asks: Sequence[DraftAsk]) -> list[tuple[int, ...]]:
        """The draft head's proposals for a round's streams (engine.draft_head)."""
        with self._computing():
            return self.draft_head.draft(asks)

    def rows_from_bytes(self, data: bytes | bytearray | memoryview, n_rows: int) -> Any:
        """Rows from a neighbour's bytes in this stage's row format, bit for bit.

        Always a copy: the link reuses its receive buffer for the next round.
        """
        raw = memoryview(data).cast("B")
        expected = self.row_format.nbytes(n_rows)
        if len(raw) != expected:
            raise BackendError(f"{n_rows} rows of {self.hidden_size} {self.row_format.name} "
                               f"values need {expected} bytes, got {len(raw)}")
        if not n_rows:
            return self._empty_rows()
        with self._computing():
            return self._settle(self._rows_from_raw(raw, n_rows))

    def rows_landing(self, buffer: bytearray | memoryview) -> memoryview:
        """Where the link should receive rows meant for `buffer` (the ring's receive buffer):
        the buffer itself, or memory of the stage's own of the same size that its device
        copies from faster (pinned host memory on CUDA), free for the link to write now."""
        return memoryview(buffer).cast("B")

    @abstractmethod
    def rows_to_bytes(self, rows: Any) -> memoryview:
        """Rows as raw little-endian values, plane-major (the row format's dtype, bit for bit)."""

    # The framework's part ------------------------------------------------------------

    @staticmethod
    @abstractmethod
    def _device(backend: str) -> Any:
        """The device the backend names, or a BackendError saying why it is unusable."""

    @classmethod
    @abstractmethod
    def _build(cls, spec: StageSpec, opened: OpenedRange, device: Any,
               on_layer: Callable[[int], None] | None) -> Stage:
        """The range's weights and state on `device`."""

    @abstractmethod
    def _computing(self) -> AbstractContextManager[Any]:
        """The context every computation of this stage runs in (no autograd; its device)."""

    @abstractmethod
    def _embed(self, token_ids: Sequence[int]) -> Any:
        """Token ids -> rows [len(token_ids), hidden]."""

    @abstractmethod
    def _run_layers(self, rows: Any, layout: RowLayout) -> Any:
        """This range's layers over a round's rows, writing the round's K and V."""

    @abstractmethod
    def _take_rows(self, rows: Any, indices: list[int]) -> Any:
        """rows[indices]."""

    def _settle(self, rows: Any) -> Any:
        """Rows whose computation has been issued (a lazy framework evaluates them here)."""
        return rows

    def _drop_state(self, slots: list[int]) -> None:
        """What `slots` held is dropped (an OPEN over a closed slot's kept state, a CANCEL):
        a KV cache in pages hands theirs back (one of whole windows has nothing to)."""
        for slot in slots:
            self.model.cache.release(slot)

    def _finish(self) -> None:
        """Wait until the device has done all this stage issued (an asynchronous device)."""

    @abstractmethod
    def _empty_rows(self) -> Any:
        """Rows [0, hidden] in the row format's dtype."""

    @abstractmethod
    def _rows_from_raw(self, raw: memoryview, n_rows: int) -> Any:
        """A copy of `raw` (the row format's values, length checked) as rows [n_rows, hidden]."""

    @abstractmethod
    def _to_numpy(self, logits: Any) -> Any:
        """Logits [rows, vocab] float32 as a numpy array the caller owns."""

    @abstractmethod
    def _sample(self, logits: Any, batch: SamplingBatch) -> SampledRows:
        """The batch's draws from logits [rows, vocab] on the device (engine.lanes.sampler's rule)."""


def load_stage(spec: StageSpec, *, checkpoint: Checkpoint | None = None,
               progress: Progress | None = None) -> Stage:
    """Load a stage on the named backend; imports the framework only when asked for.

    `checkpoint`: the spec's checkpoint, already opened by the caller, so it is not opened
    again here.
    """
    if spec.backend not in BACKENDS:
        raise BackendError(f"unknown backend {spec.backend!r} (known: {', '.join(BACKENDS)})")
    if spec.backend.startswith("torch-"):
        from engine.backends.pytorch.stage import TorchStage

        return TorchStage.load(spec, checkpoint, progress)
    try:
        from engine.backends.mlx.stage import MlxStage
    except ImportError as exc:
        raise BackendError(f"backend {spec.backend} needs MLX: {exc}") from exc
    return MlxStage.load(spec, checkpoint, progress)

"""Calibration: ms per layer for one family shape on one backend, measured on synthetic weights.

For each (family shape, dtype, backend, engine version) the agent times the engine's own
layer code — decode at 1 row and at B rows for each given context, and one prompt chunk of
`chunk_rows` rows, and rank 0's final norm, head and sampling of 1 and B rows (its own
cost every round, which a ring of any cut pays once) — with random weights of that shape
(no checkpoint needed), warmed up,
taking the median of several runs inside a time budget, and caches the numbers on disk.
Each layer type is timed on its own (a hybrid's DeltaNet and full-attention layers cost
differently, and the gap moves with context and rows): a range of layers all of that type.
Numbers are reported as measured: no smoothing, so the supervisor plans with what it got.
The CPU threads are decided as the engine's are (the request's count, else OMP_NUM_THREADS,
which the agent passes to its engines, else the framework's default) and are part of the
cache key: on a machine whose cores are shared, a layer on all of them costs 2-3x what it
does on one, so a number taken under one setting predicts nothing under the other.

Run as a child (`python -m agent.calibrate REQUEST.json CACHE_DIR`) it reports progress and
the result as JSON lines; `fleet-agent calibrate` runs it in-process with a progress bar.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import FULL_ATTENTION

if TYPE_CHECKING:  # the timer imports numpy and, building a stage, a framework
    from agent.stage_timer import StageTimer

PROGRESS_EVENT = "calibration_progress"
HEAD = "head"  # a Timing's kind (and layer type) for rank 0's final norm, head and sampling
# Timings' kinds of host work beyond the layers, each a whole figure in ms: a serving
# round's beyond its layers (at 1 row), and one hop's beyond the wire (loopback, 1 row).
ROUND, HOP = "round", "hop"
# Pairs of a serving round and its bare layers timed back to back for the round's host
# work: a tenth of a ms beside layers of several, so it takes many pairs to see it.
ROUND_PAIRS = 40
RESULT_EVENT = "calibration_done"
SHAPE_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "attention_bias", "qk_norm", "sliding_window")
HYBRID_SHAPE_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                       "linear_value_head_dim", "linear_conv_kernel_dim",
                       "partial_rotary_factor")

Progress = Callable[[int, int, str], None]


class CalibrationError(RuntimeError):
    """A calibration that cannot run here: unknown backend, absent framework, bad shape."""


@dataclass(frozen=True)
class CalibrationRequest:
    config: dict[str, Any]  # config.json's fields (only the family shape matters)
    backend: str = "torch-cpu"
    dtype: str = ""  # empty: the config's dtype
    contexts: tuple[int, ...] = (512, 4096)
    batch_rows: int = 8  # B
    chunk_rows: int = 4096
    # Where the timed prompt chunk ends: 0, at the longest context (the costliest chunk);
    # the supervisor asks for its prompt's mean chunk (supervisor.measurements.mean_chunk_end),
    # whose time is the mean of the chunks that prompt runs, as attention grows with position.
    prefill_end: int = 0
    layers: int = 2  # synthetic layers built and timed together (then divided)
    runs: int = 5
    warmup: int = 2
    budget_s: float = 30.0
    threads: int = 0  # CPU threads for the framework; 0: its default (all cores)
    # How the stage runs, as the engine's FLEET_QUANT, FLEET_COMPILE, FLEET_DELTA_KERNEL and
    # FLEET_CUDA_GRAPHS would have it (engine.backends.base.StageSpec): timed as served.
    quant_mode: str = "auto"
    compile: str = "auto"
    delta_kernel: str = "auto"
    cuda_graphs: bool = True
    # The CUDA kernel switches, FLEET_DECODE_ATTENTION, FLEET_PACKED_KERNEL and
    # FLEET_PROMPT_ATTENTION (engine.env's SWITCHES): set in this process's environment while
    # it times, where the stage reads them.
    decode_attention: str = "triton"
    packed_kernel: str = "triton"
    prompt_attention: str = "flash"

    def __post_init__(self) -> None:
        from engine.backend_names import BACKENDS
        from engine.env import KERNEL_CHOICES

        if self.backend not in BACKENDS:
            raise CalibrationError(f"unknown backend {self.backend!r} (known: "
                                   f"{', '.join(BACKENDS)})")
        object.__setattr__(self, "contexts", tuple(sorted(int(c) for c in self.contexts)))
        if not self.contexts or min(self.contexts) < 1:
            raise CalibrationError(f"contexts {self.contexts}: expected positive integers")
        for name in ("batch_rows", "chunk_rows", "layers", "runs"):
            if int(getattr(self, name)) < 1:
                raise CalibrationError(f"{name}={getattr(self, name)}: must be at least 1")
        if self.prefill_end < 0:
            raise CalibrationError(f"prefill_end={self.prefill_end}: must be at least 0")
        if self.warmup < 0 or not self.budget_s > 0:
            raise CalibrationError("warmup must be >= 0 and budget_s > 0")
        for attr, allowed in KERNEL_CHOICES.items():
            name = "quant_mode" if attr == "quant" else attr
            if getattr(self, name) not in allowed:
                raise CalibrationError(f"{name}={getattr(self, name)!r}: expected one of "
                                       f"{', '.join(allowed)}")

    @property
    def context_needed(self) -> int:
        """Positions a slot of the timed stage holds: the longest context or the chunk."""
        return max(max(self.contexts), self.chunk_rows)

    @property
    def prefill_at(self) -> int:
        """The position the timed prompt chunk ends at: `prefill_end` within [chunk_rows,
        context_needed], else the longest context."""
        if not self.prefill_end:
            return self.context_needed
        return min(self.context_needed, max(self.chunk_rows, self.prefill_end))

    def stage_options(self) -> dict[str, Any]:
        """The StageSpec fields that decide which kernels the timed stage runs."""
        return {"quant": self.quant_mode, "compile": self.compile,
                "delta_kernel": self.delta_kernel, "cuda_graphs": self.cuda_graphs}

    def switches(self) -> dict[str, str]:
        """The kernel switches as the engine's environment spells them (engine.env.SWITCHES)."""
        from engine.env import SWITCHES, VARIABLE_OF

        return {VARIABLE_OF[attr]: getattr(self, attr) for attr in SWITCHES}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> CalibrationRequest:
        raw = dict(raw)
        if "model_dir" in raw:
            path = Path(raw.pop("model_dir")) / "config.json"
            try:
                raw["config"] = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise CalibrationError(f"{path}: cannot read ({exc})") from exc
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown or "config" not in raw:
            raise CalibrationError(f"calibration request: unknown {unknown} or no config/model_dir")
        try:
            return cls(**raw)
        except TypeError as exc:
            raise CalibrationError(f"calibration request: {exc}") from exc

    def model_config(self):
        from engine.config import ConfigError, ModelConfig

        try:
            config = ModelConfig.from_dict(self.config)
        except (ConfigError, TypeError) as exc:
            raise CalibrationError(f"family shape: {exc}") from exc
        return replace(config, dtype=self.dtype) if self.dtype else config

    def quant(self):
        """The checkpoint's mlx-lm quantization (QuantConfig), None for a dense one."""
        from engine.checkpoint.quant_config import QuantConfig, QuantConfigError

        try:
            return QuantConfig.from_config(self.config)
        except QuantConfigError as exc:
            raise CalibrationError(f"quantization: {exc}") from exc

    def shape(self) -> dict[str, Any]:
        config = self.model_config()
        shape = {name: getattr(config, name) for name in SHAPE_FIELDS}
        if config.is_hybrid:  # a dense shape's key stays what it was
            shape.update({name: getattr(config, name) for name in HYBRID_SHAPE_FIELDS},
                         layer_types=layer_types(config))
        return shape

    def thread_setting(self) -> str:
        """What decides the CPU threads timed, as it decides the engine's: "N" asked for,
        "OMP_NUM_THREADS=N", or "" (the framework's default, all the cores it sees)."""
        if self.threads:
            return str(self.threads)
        omp = os.environ.get("OMP_NUM_THREADS", "").strip()
        return f"OMP_NUM_THREADS={omp}" if omp else ""

    def key(self, engine_version: str) -> str:
        """Cache key: the family shape, dtype, backend, engine version and what is measured."""
        from engine.env import SWITCHES

        config = self.model_config()
        what = {"shape": self.shape(), "dtype": config.dtype, "backend": self.backend,
                "engine_version": engine_version, "contexts": list(self.contexts),
                "batch_rows": self.batch_rows, "chunk_rows": self.chunk_rows,
                "threads": self.thread_setting(), "stage": self.stage_options(),
                "head": True,  # rank 0's head is timed too: a key from before it is not
                "host": True}  # and a round's and a hop's host work
        if self.prefill_end:  # a key timing the chunk at the context's end stays what it was
            what["prefill_at"] = self.prefill_at
        if any(getattr(self, attr) != allowed[0] for attr, allowed in SWITCHES.items()):
            what["switches"] = self.switches()  # a key at the defaults stays what it was
        if self.quant() is not None:  # packed weights time differently (a dense key stays)
            what["quantization"] = self.config.get("quantization") or \
                self.config.get("quantization_config")
        digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:20]
        return f"{config.model_type}-{config.dtype}-{self.backend}-{digest}"


def layer_types(config) -> list[str]:
    """The model's layer types, each once, in the order its layers first use them."""
    return list(dict.fromkeys(config.layer_types))


@dataclass(frozen=True)
class Timing:
    # "decode", "prefill", "head" (rank 0's final norm, head and sampling), or host work:
    # "round" (a serving round beyond its layers) or "hop" (one hop beyond the wire)
    kind: str
    context: int  # keys each row attends over (decode) / positions of the chunk (prefill)
    rows: int
    ms_per_layer: float  # median over `runs`; a head's, round's or hop's: its whole ms
    runs: int
    spread_ms: float  # max - min over the runs, per layer
    layer_type: str = FULL_ATTENTION  # config.json's name; a dense family's layers all are


@dataclass(frozen=True)
class Calibration:
    key: str
    family: str
    shape: dict[str, Any]
    dtype: str
    backend: str
    engine_version: str
    timings: tuple[Timing, ...]
    layers_timed: int
    warmup: int
    elapsed_s: float
    measured_at: float
    budget_exhausted: bool = False
    threads: int = 0  # the torch timer's intra-op threads; 0: not a torch timer (MLX's own)
    cached: bool = field(default=False, compare=False)

    def decode_ms(self, context: int, rows: int, layer_type: str | None = None) -> float:
        """ms per layer of `layer_type` (None: the first type timed) at one decode point."""
        layer_type = layer_type or self.timings[0].layer_type
        return next(t.ms_per_layer for t in self.timings
                    if t.kind == "decode" and t.context == context and t.rows == rows
                    and t.layer_type == layer_type)

    @property
    def prefill_ms(self) -> float:
        return next(t.ms_per_layer for t in self.timings if t.kind == "prefill")

    def head_ms(self, rows: int) -> float:
        """Rank 0's final norm, head and sampling of `rows` rows, ms a round."""
        return next(t.ms_per_layer for t in self.timings if t.kind == "head" and t.rows == rows)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Calibration:
        raw = dict(raw)
        raw["timings"] = tuple(Timing(**t) for t in raw["timings"])
        return cls(**raw)


def make_timer(request: CalibrationRequest, layer_type: str, workdir: Path,
               head: bool = False) -> StageTimer:
    """The real stage that times `request`'s `layer_type` layers, its range written under
    `workdir` (slots for the batch, positions for the longest context or chunk); with
    `head`, rank 0's final norm, head and sampling instead."""
    from agent.stage_timer import StageTimer, TimerError

    config = request.model_config()
    if layer_type not in config.layer_types:
        raise CalibrationError(f"layer type {layer_type!r} is not among the model's "
                               f"({', '.join(layer_types(config))})")
    try:
        return StageTimer(request.config, request.backend, request.layers, request.batch_rows,
                          request.context_needed, request.chunk_rows, workdir,
                          layer_type=layer_type, dtype=request.dtype, threads=request.threads,
                          stage_options=request.stage_options(), head=head)
    except TimerError as exc:
        raise CalibrationError(str(exc)) from exc


# --- measuring --------------------------------------------------------------------------

@contextmanager
def kernel_switches(variables: dict[str, str]) -> Iterator[None]:
    """This process's environment with the kernel switches set, then as it was: a serving
    stage reads its switches from its own environment (engine.env.read_switch), so the timed
    one must find the request's there, not whatever the agent happened to start with."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def measure(runs_by_point: list[Callable[[], None]], warmup: int, runs: int, budget_s: float,
            on_round: Callable[[int], None] | None = None) -> tuple[list[list[float]], bool]:
    """Seconds per run for every point: `warmup` untimed runs each, then rounds that time each
    point once (right after an untimed run of the same point, so no point pays for the cache
    the one before it evicted), so a burst of load elsewhere lands on all points alike.
    Stops after `runs` rounds or when the budget is spent (after at least one round);
    returns the samples and whether the budget cut the rounds short."""
    started = time.perf_counter()
    for run in runs_by_point:
        for _ in range(warmup):
            run()
            if time.perf_counter() - started > budget_s / 2:
                break
    samples: list[list[float]] = [[] for _ in runs_by_point]
    for round_no in range(runs):
        for run, out in zip(runs_by_point, samples, strict=True):
            run()
            t0 = time.perf_counter()
            run()
            out.append(time.perf_counter() - t0)
        if on_round:
            on_round(round_no + 1)
        if time.perf_counter() - started > budget_s and round_no + 1 < runs:
            return samples, True
    return samples, False


def calibrate(request: CalibrationRequest, engine_version: str,
              progress: Progress | None = None) -> Calibration:
    """Time every point of `request`; a few seconds for tiny shapes, about budget_s at most
    (plus building the weights) for real ones."""
    config = request.model_config()
    started = time.perf_counter()
    points = [("decode", c, r) for c in request.contexts
              for r in dict.fromkeys((1, request.batch_rows))]
    points.append(("prefill", request.prefill_at, request.chunk_rows))
    total = request.runs + 2  # building, each timed round, done
    if progress:
        progress(0, total, "building a stage over synthetic layers")

    def on_round(done: int) -> None:
        if progress:
            progress(1 + done, total, f"timed round {done} of {request.runs}")

    # The packed matmul's switch is read as the stage loads, decode attention's as each
    # round is built: both under the request's switches.
    with kernel_switches(request.switches()):
        # The stages hold their weights once built, so the synthetic files can go at once.
        with tempfile.TemporaryDirectory(prefix="calibration-") as workdir:
            timers = {layer_type: make_timer(request, layer_type, Path(workdir) / layer_type)
                      for layer_type in layer_types(config)}
            head = make_timer(request, layer_types(config)[0], Path(workdir) / HEAD, head=True)
        if progress:
            progress(1, total, "built the stage")
        # Every type's points, the head's and a hop's in one measurement, so a burst of load
        # lands on all alike. The head's: its rows at decode, as rank 0 samples every round's.
        typed = [(layer_type, point) for layer_type in timers for point in points]
        typed += [(HEAD, (HEAD, 0, rows)) for rows in dict.fromkeys((1, request.batch_rows))]
        first = layer_types(config)[0]
        hop = hop_timer(timers[first], request.batch_rows)
        if hop is not None:
            typed.append((HOP, (HOP, 0, 1)))
        try:
            samples, exhausted = measure(
                [hop.make_round(point[2]) if t == HOP
                 else (head if t == HEAD else timers[t]).make_round(*point)
                 for t, point in typed],
                request.warmup, request.runs, request.budget_s, on_round)
        finally:
            if hop is not None:
                hop.close()
        # The round's host work: the first type's decode point at 1 row and the shortest
        # context (the least layer time, so the least noise beside it), as served and bare.
        # Within what the budget has left, a tenth of it at least.
        left_s = request.budget_s - (time.perf_counter() - started)
        round_ms = round_host_ms(timers[first].make_round(ROUND, request.contexts[0], 1),
                                 timers[first].make_round("decode", request.contexts[0], 1),
                                 ROUND_PAIRS, max(left_s, request.budget_s / 10))
    timings = [layer_timing(typed_point, seconds, request.layers)
               for typed_point, seconds in zip(typed, samples, strict=True)
               if typed_point[0] != HOP]
    timings.append(host_timing(ROUND, first, request.contexts[0], round_ms))
    hop_ms = [x * 1000.0 / 2 for typed_point, seconds in zip(typed, samples, strict=True)
              if typed_point[0] == HOP for x in seconds]  # half a ping-pong: one hop
    if hop_ms:
        timings.append(host_timing(HOP, HOP, 0, hop_ms))
    if progress:
        progress(total, total, "done")
    return Calibration(
        key=request.key(engine_version), family=config.model_type, shape=request.shape(),
        dtype=config.dtype, backend=request.backend, engine_version=engine_version,
        timings=tuple(timings), layers_timed=request.layers, warmup=request.warmup,
        elapsed_s=round(time.perf_counter() - started, 3), measured_at=time.time(),
        budget_exhausted=exhausted,
        threads=max(timer.threads for timer in timers.values()))


def layer_timing(typed_point: tuple[str, tuple[str, int, int]], seconds: list[float],
                 layers: int) -> Timing:
    """A layer point's ms per layer (a head's: the whole head's ms)."""
    layer_type, (kind, context, rows) = typed_point
    per_layer = [x * 1000.0 / (1 if kind == HEAD else layers) for x in seconds]
    return Timing(kind, context, rows, statistics.median(per_layer), len(seconds),
                  max(per_layer) - min(per_layer), layer_type)


def host_timing(kind: str, layer_type: str, context: int, ms: list[float]) -> Timing:
    """A host-work point at 1 row: the median of its samples, whole ms (0 at least: a
    difference under the noise is no host work)."""
    return Timing(kind, context, 1, max(0.0, statistics.median(ms)), len(ms),
                  max(ms) - min(ms), layer_type)


def round_host_ms(served: Callable[[], None], bare: Callable[[], None], pairs: int,
                  budget_s: float) -> list[float]:
    """ms of a serving round beyond its bare layers, one figure a pair: the two run back to
    back (each after an untimed run of itself, as `measure` does; in turns which goes
    first, so neither always follows the other), so a pair sees one load. At least one
    pair, then as many of `pairs` as `budget_s` allows."""
    started = time.perf_counter()
    out = []
    for i in range(pairs):
        took = {}
        order = (("served", served), ("bare", bare))
        for name, run in order if i % 2 else order[::-1]:
            run()
            t0 = time.perf_counter()
            run()
            took[name] = time.perf_counter() - t0
        out.append((took["served"] - took["bare"]) * 1000.0)
        if time.perf_counter() - started > budget_s:
            break
    return out


def hop_timer(timer: StageTimer, max_rows: int):
    """A `HopTimer` over `timer`'s stage, or None where this machine cannot open a loopback
    link (the hop then goes unpriced, as before it was timed)."""
    from agent.hop_timer import HopTimer
    from engine.link.errors import ProtocolError

    try:
        return HopTimer(timer.stage, max_rows)
    except (OSError, ProtocolError):
        return None


class CalibrationCache:
    """`<dir>/<key>.json`, one file per calibration."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def get(self, key: str) -> Calibration | None:
        try:
            raw = json.loads(self.path(key).read_text())
            return replace(Calibration.from_dict(raw), cached=True)
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def put(self, calibration: Calibration) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.path(calibration.key).with_suffix(".tmp")
        tmp.write_text(json.dumps(replace(calibration, cached=False).to_dict(), indent=1))
        tmp.replace(self.path(calibration.key))

    def all(self) -> list[Calibration]:
        out = []
        for path in sorted(self.directory.glob("*.json")):
            found = self.get(path.stem)
            if found:
                out.append(found)
        return out


def calibrate_cached(request: CalibrationRequest, cache: CalibrationCache, engine_version: str,
                     progress: Progress | None = None, force: bool = False) -> Calibration:
    key = request.key(engine_version)
    if not force:
        found = cache.get(key)
        if found is not None:
            return found
    result = calibrate(request, engine_version, progress)
    cache.put(result)
    return result


def main(argv: list[str] | None = None) -> int:
    """The calibration child: REQUEST_JSON CACHE_DIR [--force]; JSON lines on stdout."""
    from agent.facts import engine_version

    args = sys.argv[1:] if argv is None else argv

    def emit(event: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()

    try:
        request = CalibrationRequest.from_dict(json.loads(args[0]))
        result = calibrate_cached(
            request, CalibrationCache(Path(args[1])), engine_version(),
            lambda done, total, what: emit({"event": PROGRESS_EVENT, "done": done,
                                            "total": total, "what": what}),
            force="--force" in args)
    except CalibrationError as exc:
        emit({"event": "exiting", "code": 2, "reason": str(exc)})
        return 2
    emit({"event": RESULT_EVENT, "result": result.to_dict()})
    emit({"event": "exiting", "code": 0, "reason": "calibrated"})
    return 0


if __name__ == "__main__":
    sys.exit(main())

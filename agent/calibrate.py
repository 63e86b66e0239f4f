"""Calibration: ms per layer for one family shape on one backend, measured on synthetic weights.

For each (family shape, dtype, backend, engine version) the agent times the engine's own
layer code — decode at 1 row and at B rows for each given context, and one prompt chunk of
`chunk_rows` rows — with random weights of that shape (no checkpoint needed), warmed up,
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
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.config import FULL_ATTENTION

PROGRESS_EVENT = "calibration_progress"
RESULT_EVENT = "calibration_done"
SHAPE_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "attention_bias", "qk_norm", "sliding_window")
HYBRID_SHAPE_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                       "linear_value_head_dim", "linear_conv_kernel_dim",
                       "partial_rotary_factor")
WEIGHT_STD = 0.02

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
    layers: int = 2  # synthetic layers built and timed together (then divided)
    runs: int = 5
    warmup: int = 2
    budget_s: float = 30.0
    threads: int = 0  # CPU threads for the framework; 0: its default (all cores)

    def __post_init__(self) -> None:
        from engine.backend_names import BACKENDS

        if self.backend not in BACKENDS:
            raise CalibrationError(f"unknown backend {self.backend!r} (known: "
                                   f"{', '.join(BACKENDS)})")
        object.__setattr__(self, "contexts", tuple(sorted(int(c) for c in self.contexts)))
        if not self.contexts or min(self.contexts) < 1:
            raise CalibrationError(f"contexts {self.contexts}: expected positive integers")
        for name in ("batch_rows", "chunk_rows", "layers", "runs"):
            if int(getattr(self, name)) < 1:
                raise CalibrationError(f"{name}={getattr(self, name)}: must be at least 1")
        if self.warmup < 0 or not self.budget_s > 0:
            raise CalibrationError("warmup must be >= 0 and budget_s > 0")

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
        config = self.model_config()
        what = {"shape": self.shape(), "dtype": config.dtype, "backend": self.backend,
                "engine_version": engine_version, "contexts": list(self.contexts),
                "batch_rows": self.batch_rows, "chunk_rows": self.chunk_rows,
                "threads": self.thread_setting()}
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
    kind: str  # "decode" or "prefill"
    context: int  # keys each row attends over (decode) / positions of the chunk (prefill)
    rows: int
    ms_per_layer: float  # median over `runs`
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Calibration:
        raw = dict(raw)
        raw["timings"] = tuple(Timing(**t) for t in raw["timings"])
        return cls(**raw)


# --- the torch timer --------------------------------------------------------------------

class TorchTimer:
    """The engine's PyTorch layers, built from random weights, timed one round at a time.

    For a quantized checkpoint the weights are quantized as mlx-lm would and held as the
    stage would hold them (packed where engine.backends.quant_policy says it runs packed),
    so the ms per layer are those of the kernels that will run."""

    def __init__(self, config, backend: str, layers: int, slots: int, context: int,
                 threads: int = 0, layer_type: str = FULL_ATTENTION, quant=None) -> None:
        import torch

        from engine.backends.pytorch.kv_cache import KVCache
        from engine.backends.pytorch.llama import LlamaRange, Rope
        from engine.backends.pytorch.qwen3_5 import Qwen35Range
        from engine.backends.pytorch.recurrent_state import HybridState, RecurrentState
        config = one_type(config, layer_type, layers)
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        kind = backend.removeprefix("torch-")
        if (kind == "cuda" and not torch.cuda.is_available()) or (
                kind == "mps" and not torch.backends.mps.is_available()):
            raise CalibrationError(f"{backend}: this PyTorch sees no {kind} device")
        if config.dtype not in dtypes:
            raise CalibrationError(f"dtype {config.dtype!r} is not supported by {backend}")
        self.device = torch.device(kind)
        self.torch = torch
        if threads:
            torch.set_num_threads(threads)
        self.threads = torch.get_num_threads()  # what the rounds run on, as recorded
        self.dtype = dtypes[config.dtype]
        self.config = config
        generator = torch.Generator(device="cpu").manual_seed(0)
        from engine.backends.pytorch.packed_linear import quantize_and_pack
        from engine.backends.quant_policy import packed_params, runs_packed
        packed = quant is not None and runs_packed(backend, config.dtype)

        def load(shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
            out = {}
            for name, shape in shapes.items():
                if name.endswith("norm.weight"):
                    t = torch.ones(shape)
                else:
                    t = torch.empty(shape).normal_(0.0, WEIGHT_STD, generator=generator)
                params = packed_params(quant, name, shape) if packed else None
                out[name] = (t.to(self.device, self.dtype) if params is None
                             else quantize_and_pack(t, params, self.dtype, self.device))
            return out

        # Layer indices from 1 so the range is not the first: no embeddings or head to build.
        attention = layers if layer_type == FULL_ATTENTION else 0
        cache = KVCache(attention, slots, config.num_key_value_heads, context, config.head_dim,
                        self.dtype, self.device)
        rope = Rope(config, context, self.device, self.dtype)
        with torch.inference_mode():
            if config.is_hybrid:
                state = HybridState(cache, RecurrentState(config, layers - attention, slots,
                                                          self.dtype, self.device))
                self.model = Qwen35Range(config, (1, 1 + layers), load, state, rope)
            else:
                self.model = LlamaRange(config, (1, 1 + layers), load, cache, rope)

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()
        elif self.device.type == "mps":
            self.torch.mps.synchronize()

    def make_round(self, kind: str, context: int, rows: int) -> Callable[[], None]:
        from engine.backends.pytorch.kv_cache import RoundIndex

        torch = self.torch
        index = RoundIndex.build(_round_layout(kind, context, rows), self.device,
                                 self.config.sliding_window)
        x = (torch.randn(rows, self.config.hidden_size) * 0.5).to(self.device, self.dtype)

        def run() -> None:
            with torch.inference_mode():
                self.model.run_layers(x, index)
            self.sync()

        return run


class MlxTimer:
    """The engine's MLX layers (the PyTorch family's twin), timed the same way."""

    def __init__(self, config, backend: str, layers: int, slots: int, context: int,
                 layer_type: str = FULL_ATTENTION, quant=None) -> None:
        config = one_type(config, layer_type, layers)
        try:
            import mlx.core as mx

            from engine.backends.mlx.kv_cache import KVCache
            from engine.backends.mlx.llama import LlamaRange, Rope
            from engine.backends.mlx.quant import QuantizedWeight
            from engine.backends.mlx.qwen3_5 import Qwen35Range
            from engine.backends.quant_policy import packed_params
        except ImportError as exc:
            raise CalibrationError(f"{backend}: MLX or the engine's MLX backend is not "
                                   f"importable ({exc})") from exc
        kind = backend.removeprefix("mlx-")
        cuda = getattr(mx, "cuda", None)
        if (kind == "metal" and not mx.metal.is_available()) or (
                kind == "cuda" and not (cuda and cuda.is_available())):
            raise CalibrationError(f"{backend}: this MLX build sees no {kind} device")
        mx.set_default_device(mx.cpu if kind == "cpu" else mx.gpu)
        dtypes = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
        if config.dtype not in dtypes:
            raise CalibrationError(f"dtype {config.dtype!r} is not supported by {backend}")
        self.mx = mx
        self.dtype = dtypes[config.dtype]
        self.config = config
        mx.random.seed(0)

        def load(shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
            out = {}
            for name, shape in shapes.items():
                if name.endswith("norm.weight"):
                    out[name] = mx.ones(shape, dtype=self.dtype)
                else:
                    out[name] = (mx.random.normal(shape) * WEIGHT_STD).astype(self.dtype)
                params = packed_params(quant, name, shape)
                if params is not None:  # as a quantized checkpoint's stage runs it
                    out[name] = QuantizedWeight(*mx.quantize(out[name], params.group_size,
                                                             params.bits), params.group_size,
                                                params.bits)
            mx.eval([a for w in out.values() for a in
                     ((w.weight, w.scales, w.biases) if isinstance(w, QuantizedWeight) else (w,))])
            return out

        if config.is_hybrid:
            self.cache = Qwen35Range.state_for(config, (1, 1 + layers), slots, context,
                                               self.dtype)
            self.model = Qwen35Range(config, (1, 1 + layers), load, self.cache, Rope(config))
        else:
            self.cache = KVCache(layers, slots, config.num_key_value_heads, context,
                                 config.head_dim, self.dtype)
            self.model = LlamaRange(config, (1, 1 + layers), load, self.cache, Rope(config))

    def make_round(self, kind: str, context: int, rows: int) -> Callable[[], None]:
        from engine.backends.mlx.kv_cache import RoundIndex

        mx = self.mx
        layout = _round_layout(kind, context, rows)
        index = (self.model.round_index(layout) if self.config.is_hybrid
                 else RoundIndex.build(layout, self.config.sliding_window))
        x = (mx.random.normal((rows, self.config.hidden_size)) * 0.5).astype(self.dtype)
        mx.eval(x)

        def run() -> None:
            out = self.model.run_layers(x, index)
            mx.eval(out, *self.cache.arrays())

        return run


def _round_layout(kind: str, context: int, rows: int):
    """Decode: `rows` streams of one row attending over `context` keys. Prefill: one prompt
    chunk of `rows` rows at positions [context - rows, context)."""
    from engine.rounds import Op, RoundPlan, RowLayout, StreamEntry

    if kind == "decode":
        entries = tuple(StreamEntry(slot, Op.CONTINUE, context - 1, 1, 1, 0, 0)
                        for slot in range(rows))
    else:
        entries = (StreamEntry(0, Op.OPEN, context - rows, rows, 0, 0, 0),)
    return RowLayout.of(RoundPlan(1, entries))


def one_type(config, layer_type: str, layers: int):
    """`config` cut to 2 + `layers` layers all of `layer_type`: the timed range is [1, 1 +
    layers), neither the first nor the last, so it builds no embeddings, norm or head."""
    if layer_type not in config.layer_types:
        raise CalibrationError(f"layer type {layer_type!r} is not among the model's "
                               f"({', '.join(layer_types(config))})")
    return replace(config, num_hidden_layers=2 + layers, layer_types=(layer_type,) * (2 + layers))


def make_timer(config, backend: str, layers: int, slots: int, context: int, threads: int = 0,
               layer_type: str = FULL_ATTENTION, quant=None):
    if backend.startswith("torch-"):
        return TorchTimer(config, backend, layers, slots, context, threads, layer_type, quant)
    if backend.startswith("mlx-"):
        return MlxTimer(config, backend, layers, slots, context, layer_type, quant)
    raise CalibrationError(f"unknown backend {backend!r}")


# --- measuring --------------------------------------------------------------------------

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
    context_needed = max(max(request.contexts), request.chunk_rows)
    points = [("decode", c, r) for c in request.contexts
              for r in dict.fromkeys((1, request.batch_rows))]
    points.append(("prefill", context_needed, request.chunk_rows))
    total = request.runs + 2  # building, each timed round, done
    if progress:
        progress(0, total, "building synthetic layers")
    timers = {layer_type: make_timer(config, request.backend, request.layers,
                                     request.batch_rows, context_needed, request.threads,
                                     layer_type, request.quant())
              for layer_type in layer_types(config)}
    if progress:
        progress(1, total, "built synthetic layers")
    def on_round(done: int) -> None:
        if progress:
            progress(1 + done, total, f"timed round {done} of {request.runs}")

    # Every type's points in one measurement, so a burst of load lands on all of them alike.
    typed = [(layer_type, point) for layer_type in timers for point in points]
    samples, exhausted = measure([timers[t].make_round(*point) for t, point in typed],
                                 request.warmup, request.runs, request.budget_s, on_round)
    timings = []
    for (layer_type, (kind, context, rows)), seconds in zip(typed, samples, strict=True):
        per_layer = [x * 1000.0 / request.layers for x in seconds]
        timings.append(Timing(kind, context, rows, statistics.median(per_layer), len(seconds),
                              max(per_layer) - min(per_layer), layer_type))
    if progress:
        progress(total, total, "done")
    return Calibration(
        key=request.key(engine_version), family=config.model_type, shape=request.shape(),
        dtype=config.dtype, backend=request.backend, engine_version=engine_version,
        timings=tuple(timings), layers_timed=request.layers, warmup=request.warmup,
        elapsed_s=round(time.perf_counter() - started, 3), measured_at=time.time(),
        budget_exhausted=exhausted,
        threads=max(getattr(timer, "threads", 0) for timer in timers.values()))


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

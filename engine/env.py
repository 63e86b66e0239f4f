"""The environment contract an agent starts an engine with (DESIGN.md), parsed and checked."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from engine.backends.base import BACKENDS, StageSpec
from engine.link.messages import is_wildcard_host


class EnvError(ValueError):
    """A missing or malformed FLEET_* / torch.distributed variable."""


def split_host_port(value: str, name: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise EnvError(f"{name}={value!r}: expected host:port")
    return host.strip("[]"), int(port)


def parse_layers(value: str, name: str = "FLEET_LAYERS") -> tuple[int, int]:
    start, sep, end = value.partition(":")
    if not sep or not start.isdigit() or not end.isdigit() or int(start) >= int(end):
        raise EnvError(f"{name}={value!r}: expected start:end with start < end (half-open)")
    return int(start), int(end)


@dataclass(frozen=True)
class EngineEnv:
    rank: int
    world_size: int
    master: tuple[str, int]  # rank 0's control address
    layer_range: tuple[int, int] | None  # None: the whole model (WORLD_SIZE=1 only)
    layout: tuple[tuple[int, int], ...]  # every rank's range (FLEET_LAYOUT), for the fingerprint
    model_dir: Path
    backend: str
    listen: tuple[str, int] | None  # this stage's ring listener
    key_file: Path | None
    placement: str
    http: tuple[str, int] | None  # rank 0's API
    context: int
    parallel: int
    chunk: int
    max_waiting: int
    model_id: str
    drain_s: float  # SIGTERM: finish in-flight requests for up to this long, then exit
    keepalive_s: float  # an empty plan once this passes without one
    dead_after: int  # silent keep-alive intervals before the ring counts as dead
    round_deadline_s: float  # bounds each send and receive of a round's frames
    boot_deadline_s: float  # how long bootstrap waits for the other stages
    cpu_threads: int  # 0: the framework's default; stages sharing a CPU should split it
    log_level: str  # debug adds each round's timing per stage
    cuda_graphs: bool  # FLEET_CUDA_GRAPHS=0 runs every round eagerly

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> EngineEnv:
        env = os.environ if env is None else env

        def need(name: str) -> str:
            if not env.get(name):
                raise EnvError(f"{name} is not set")
            return env[name]

        def integer(name: str, default: int, low: int = 1) -> int:
            raw = env.get(name, str(default))
            if not raw.lstrip("-").isdigit() or int(raw) < low:
                raise EnvError(f"{name}={raw!r}: expected an integer >= {low}")
            return int(raw)

        def number(name: str, default: float, *, zero_ok: bool = False) -> float:
            raw = env.get(name, str(default))
            try:
                value = float(raw)
            except ValueError:
                value = -1.0
            if not (value >= 0 if zero_ok else value > 0) or value == float("inf"):
                raise EnvError(f"{name}={raw!r}: expected a {'' if zero_ok else 'positive '}"
                               "number of seconds")
            return value

        log_level = env.get("FLEET_LOG_LEVEL", "info").lower()
        if log_level not in ("debug", "info", "warning", "error"):
            raise EnvError(f"FLEET_LOG_LEVEL={log_level!r}: expected debug, info, warning or error")
        rank, world = integer("RANK", 0, 0), integer("WORLD_SIZE", 1)
        if rank >= world:
            raise EnvError(f"RANK={rank} must be below WORLD_SIZE={world}")
        backend = env.get("FLEET_BACKEND", "torch-cpu")
        if backend not in BACKENDS:
            raise EnvError(f"FLEET_BACKEND={backend!r}: expected one of {', '.join(BACKENDS)}")
        model_dir = Path(need("FLEET_MODEL"))
        layers = parse_layers(env["FLEET_LAYERS"]) if env.get("FLEET_LAYERS") else None
        if layers is None and world > 1:
            raise EnvError("FLEET_LAYERS is required when WORLD_SIZE > 1")
        layout: tuple[tuple[int, int], ...] = ()
        if world > 1:
            layout = tuple(parse_layers(part, "FLEET_LAYOUT")
                           for part in need("FLEET_LAYOUT").split(","))
            if len(layout) != world or layout[rank] != layers:
                raise EnvError(f"FLEET_LAYOUT={env['FLEET_LAYOUT']!r} must list WORLD_SIZE={world} "
                               f"ranges with FLEET_LAYERS={env['FLEET_LAYERS']!r} at rank {rank}")
        listen = http = None
        if world > 1:
            listen = split_host_port(need("FLEET_LISTEN"), "FLEET_LISTEN")
            if is_wildcard_host(listen[0]):
                raise EnvError(f"FLEET_LISTEN={env['FLEET_LISTEN']!r}: a wildcard address is "
                               "refused; bind the stage link to one interface's address")
        if rank == 0:
            http = split_host_port(env.get("FLEET_HTTP", "127.0.0.1:8000"), "FLEET_HTTP")
        master = split_host_port(env.get("MASTER_ADDR", "127.0.0.1") + ":"
                                 + env.get("MASTER_PORT", "29500"), "MASTER_ADDR:MASTER_PORT")
        return cls(
            rank=rank, world_size=world, master=master, layer_range=layers, layout=layout,
            model_dir=model_dir, backend=backend, listen=listen,
            key_file=Path(need("FLEET_KEY_FILE")) if world > 1 else None,
            placement=env.get("FLEET_PLACEMENT", "local"), http=http,
            context=integer("FLEET_CONTEXT", 2048), parallel=integer("FLEET_PARALLEL", 4),
            chunk=integer("FLEET_CHUNK", 256), max_waiting=integer("FLEET_MAX_WAITING", 64, 0),
            model_id=env.get("FLEET_MODEL_ID") or model_dir.resolve().name,
            drain_s=number("FLEET_DRAIN_S", 180.0, zero_ok=True),
            keepalive_s=number("FLEET_KEEPALIVE_S", 2.0),
            dead_after=integer("FLEET_DEAD_AFTER", 3),
            round_deadline_s=number("FLEET_ROUND_DEADLINE_S", 300.0),
            boot_deadline_s=number("FLEET_BOOT_DEADLINE_S", 300.0),
            cpu_threads=integer("FLEET_CPU_THREADS", 0, 0),
            log_level=log_level,
            cuda_graphs=env.get("FLEET_CUDA_GRAPHS", "1") != "0",
        )

    def stage_spec(self, n_layers: int) -> StageSpec:
        return StageSpec(self.model_dir, self.layer_range or (0, n_layers), self.backend,
                         self.parallel, self.context, self.chunk, self.cuda_graphs)

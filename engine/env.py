"""The environment contract an agent starts an engine with (DESIGN.md), parsed and checked."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from engine.backends.base import BACKENDS, StageSpec
from engine.link.accept_loop import HANDSHAKE_DEADLINE_S
from engine.wildcard import wildcard_refusal

MIN_API_SECRET_CHARS = 16


class EnvError(ValueError):
    """A missing or malformed FLEET_* / torch.distributed variable."""


def split_host_port(value: str, name: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise EnvError(f"{name}={value!r}: expected host:port")
    return host.strip("[]"), int(port)


def listen_address(env: Mapping[str, str], name: str, default: str = "") -> tuple[str, int]:
    """A host:port some listener binds: never a wildcard, literally or once resolved."""
    value = env.get(name) or default
    if not value:
        raise EnvError(f"{name} is not set")
    host, port = split_host_port(value, name)
    refusal = wildcard_refusal(host, f"{name}={value!r}")
    if refusal:
        raise EnvError(refusal)
    return host, port


def read_api_secret(path: Path, name: str = "FLEET_API_SECRET_FILE") -> str:
    """The bearer secret rank 0's API requires, from the 0600 file its agent wrote."""
    try:
        secret = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise EnvError(f"{name}={str(path)!r}: cannot read the API secret: {exc}") from exc
    if len(secret) < MIN_API_SECRET_CHARS or not secret.isascii() or not secret.isprintable():
        raise EnvError(f"{name}={str(path)!r}: expected a secret of at least "
                       f"{MIN_API_SECRET_CHARS} printable ASCII characters")
    return secret


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
    handshake_deadline_s: float  # a connection to a ring listener must authenticate within it
    cpu_threads: int  # 0: the framework's default; stages sharing a CPU should split it
    log_level: str  # debug adds each round's timing per stage
    cuda_graphs: bool  # FLEET_CUDA_GRAPHS=0 runs every round eagerly
    # Rank 0's API answers only requests bearing it (FLEET_API_SECRET_FILE); "" keeps it open,
    # as a standalone engine is. Kept out of repr so no log line can carry it.
    api_secret: str = field(default="", repr=False)
    # Rank 0's API connections (engine.api.connections): 0 connections = half the fd limit.
    http_max_connections: int = 0
    http_header_s: float = 5.0  # a new connection must send its first request's headers by then
    http_idle_s: float = 15.0  # an idle keep-alive connection closes this long after a response
    http_body_s: float = 30.0  # a request body must arrive within this

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
        api_secret = ""
        if world > 1:
            listen = listen_address(env, "FLEET_LISTEN")
        if rank == 0:
            http = listen_address(env, "FLEET_HTTP", "127.0.0.1:8000")
            if env.get("FLEET_API_SECRET_FILE"):
                api_secret = read_api_secret(Path(env["FLEET_API_SECRET_FILE"]))
        master_value = (env.get("MASTER_ADDR", "127.0.0.1") + ":"
                        + env.get("MASTER_PORT", "29500"))
        if world > 1:  # rank 0 binds it; the others dial it
            master = listen_address({"MASTER_ADDR:MASTER_PORT": master_value},
                                    "MASTER_ADDR:MASTER_PORT")
        else:
            master = split_host_port(master_value, "MASTER_ADDR:MASTER_PORT")
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
            handshake_deadline_s=number("FLEET_HANDSHAKE_DEADLINE_S", HANDSHAKE_DEADLINE_S),
            cpu_threads=integer("FLEET_CPU_THREADS", 0, 0),
            log_level=log_level,
            cuda_graphs=env.get("FLEET_CUDA_GRAPHS", "1") != "0",
            api_secret=api_secret,
            http_max_connections=integer("FLEET_HTTP_MAX_CONNECTIONS", 0, 0),
            http_header_s=number("FLEET_HTTP_HEADER_S", 5.0),
            http_idle_s=number("FLEET_HTTP_IDLE_S", 15.0),
            http_body_s=number("FLEET_HTTP_BODY_S", 30.0),
        )

    def stage_spec(self, n_layers: int) -> StageSpec:
        return StageSpec(self.model_dir, self.layer_range or (0, n_layers), self.backend,
                         self.parallel, self.context, self.chunk, self.cuda_graphs)

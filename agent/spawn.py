"""A spawn request: one stage's environment contract, the pure checks that refuse a
request that cannot work (naming the field to fix) before any process starts, and which old
engine logs a spawn prunes."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.addresses import AddressError, format_host_port, parse_host_port

if TYPE_CHECKING:
    from engine.env import EngineEnv

ENGINE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
# What an engine inherits from the agent besides its contract: what a process needs to run.
PASSED_THROUGH = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TMPDIR", "TZ",
                  "PYTHONPATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES",
                  "CUDA_HOME", "HF_HOME", "OMP_NUM_THREADS")
PASSED_PREFIXES = ("OPENBLAS_", "MKL_", "NCCL_", "PYTORCH_", "MLX_", "METAL_")


# The environment contract's names -> the spawn request's fields, so a refusal names what
# the caller sent.
ENV_FIELDS = {"RANK": "rank", "WORLD_SIZE": "world_size", "MASTER_ADDR": "master_addr",
              "MASTER_PORT": "master_port", "MASTER_ADDR:MASTER_PORT": "master_port",
              "FLEET_MODEL": "model_dir", "FLEET_BACKEND": "backend", "FLEET_LAYERS": "layers",
              "FLEET_LAYOUT": "layout", "FLEET_LISTEN": "listen", "FLEET_HTTP": "http",
              "FLEET_KEY_FILE": "key_file", "FLEET_PLACEMENT": "placement",
              "FLEET_CONTEXT": "context", "FLEET_PARALLEL": "parallel", "FLEET_CHUNK": "chunk",
              "FLEET_PROMPT_CACHE_SLOTS": "prompt_cache_slots",
              "FLEET_DRAIN_S": "drain_s", "FLEET_MODEL_ID": "model_id",
              "FLEET_API_SECRET_FILE": "api_secret", "FLEET_HOP_TRANSPORT": "hop_transport"}


class SpawnRefused(ValueError):
    """A spawn request the agent will not act on; `field` names what to fix."""

    def __init__(self, field_name: str, message: str, status: int = 422) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message
        self.status = status


@dataclass(frozen=True)
class EngineSpec:
    """One stage to run: the environment contract's values, as the supervisor sends them."""

    engine_id: str
    model_dir: str
    backend: str = "torch-cpu"
    replica: str = ""
    rank: int = 0
    world_size: int = 1
    layers: str = ""  # "start:end", half-open; empty: the whole model (WORLD_SIZE=1 only)
    layout: str = ""  # every rank's range, "0:2,2:4" (WORLD_SIZE>1)
    listen: str = ""  # this stage's ring listener host:port (WORLD_SIZE>1), never a wildcard
    http: str = ""  # rank 0's API host:port
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    key_file: str = ""  # a link key already on this machine, or:
    link_key: str = ""  # the key itself (hex), written to the agent's own keys/ at spawn
    # Rank 0's API secret, written like the link key (0600, keys/); its file is all the run
    # record keeps. Empty: rank 0's API is open (a standalone stage).
    api_secret: str = field(default="", repr=False)
    api_secret_file: str = ""
    placement: str = ""
    model_id: str = ""
    context: int = 2048
    parallel: int = 4
    prompt_cache_slots: int = 0  # slots past `parallel` that keep finished conversations
    chunk: int = 256
    drain_s: float | None = None  # None: the agent's drain_s
    hop_transport: str = "auto"  # how each hop's rows travel (docs/hop-transport.md)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> EngineSpec:
        if not isinstance(raw, Mapping):
            raise SpawnRefused("body", "expected a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise SpawnRefused(unknown[0], f"unknown field (known: {', '.join(sorted(known))})")
        for name in ("engine_id", "model_dir"):
            if not raw.get(name):
                raise SpawnRefused(name, "is required")
        try:
            spec = cls(**raw)
        except TypeError as exc:
            raise SpawnRefused("body", str(exc)) from exc
        for name, value in raw.items():
            kind = cls.__dataclass_fields__[name].type
            if kind == "int" and (not isinstance(value, int) or isinstance(value, bool)):
                raise SpawnRefused(name, f"expected an integer, got {value!r}")
            if kind == "str" and not isinstance(value, str):
                raise SpawnRefused(name, f"expected a string, got {value!r}")
            if name == "drain_s" and value is not None and (
                    not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0):
                raise SpawnRefused(name, f"expected seconds >= 0, got {value!r}")
        return spec

    def engine_env(self, drain_s: float) -> EngineEnv:
        """The request as the environment contract, read by the contract's own parser: a
        refusal names the request's field for the variable that is wrong. `drain_s` is the
        agent's, for a request that names none."""
        raw = {
            "RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port),
            "FLEET_MODEL": self.model_dir, "FLEET_BACKEND": self.backend,
            "FLEET_PLACEMENT": self.placement or self.replica or "local",
            "FLEET_CONTEXT": str(self.context), "FLEET_PARALLEL": str(self.parallel),
            "FLEET_CHUNK": str(self.chunk),
            "FLEET_PROMPT_CACHE_SLOTS": str(self.prompt_cache_slots),
            "FLEET_DRAIN_S": str(self.drain_s if self.drain_s is not None else drain_s),
        }
        optional = {"FLEET_LAYERS": self.layers, "FLEET_LAYOUT": self.layout,
                    "FLEET_LISTEN": self.listen, "FLEET_HTTP": self.http,
                    "FLEET_KEY_FILE": self.key_file, "FLEET_MODEL_ID": self.model_id,
                    "FLEET_API_SECRET_FILE": self.api_secret_file if self.rank == 0 else "",
                    "FLEET_HOP_TRANSPORT": self.hop_transport}
        raw.update({k: v for k, v in optional.items() if v})
        from engine.env import EngineEnv, EnvError  # the engine's imports, only when asked

        try:
            return EngineEnv.from_environ(raw)
        except EnvError as exc:
            raise SpawnRefused(ENV_FIELDS.get(exc.variable, exc.variable), str(exc)) from exc

    def bound_ports(self) -> list[tuple[str, str, int]]:
        """(field, host, port) of every port this stage will listen on."""
        out = []
        for name, value in (("http", self.http if self.rank == 0 else ""),
                            ("listen", self.listen if self.world_size > 1 else "")):
            if value:
                try:
                    host, port = parse_host_port(value, name)
                except AddressError:
                    continue  # check_spawn refuses it, naming the field
                out.append((name, host, port))
        if self.rank == 0 and self.world_size > 1:
            host, port = parse_host_port(format_host_port(self.master_addr, self.master_port),
                                         "master_addr")
            out.append(("master_port", host, port))
        return out


@dataclass(frozen=True)
class CheckpointInfo:
    """What a spawn check needs to know about the checkpoint directory."""

    model_dir: str
    n_layers: int
    weight_files: int


def read_checkpoint_info(model_dir: str) -> CheckpointInfo:
    """Read config.json's layer count and see that weights are there; SpawnRefused if not."""
    from engine.config import ConfigError, ModelConfig

    path = Path(model_dir)
    if not path.is_dir():
        raise SpawnRefused("model_dir", f"{model_dir}: no such checkpoint directory")
    config_path = path / "config.json"
    try:
        raw = json.loads(config_path.read_text())
        config = ModelConfig.from_dict(raw)
    except FileNotFoundError as exc:
        raise SpawnRefused("model_dir", f"{config_path}: missing (not a checkpoint)") from exc
    except (OSError, ValueError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise SpawnRefused("model_dir", str(exc)) from exc
        raise SpawnRefused("model_dir", f"{config_path}: unreadable ({exc})") from exc
    weights = list(path.glob("*.safetensors"))
    if not weights:
        raise SpawnRefused("model_dir", f"{model_dir}: no *.safetensors weight files")
    return CheckpointInfo(str(path), config.num_hidden_layers, len(weights))


def check_spawn(spec: EngineSpec, info: CheckpointInfo, backends_present: frozenset[str],
                running: tuple[EngineSpec, ...], drain_s: float) -> None:
    """Refuse a spawn that cannot work, naming the field. Pure (ports are checked apart)."""
    if not ENGINE_ID.match(spec.engine_id):
        raise SpawnRefused("engine_id", f"{spec.engine_id!r}: use letters, digits, '-', '_', "
                           "'.' (at most 96)")
    if any(r.engine_id == spec.engine_id for r in running):
        raise SpawnRefused("engine_id", f"{spec.engine_id!r} is already running here", 409)
    if backends_present and spec.backend not in backends_present:
        raise SpawnRefused("backend", f"{spec.backend!r} is not available on this node "
                           f"(present: {', '.join(sorted(backends_present)) or 'none'})")
    env = spec.engine_env(drain_s)
    start, end = env.layer_range or (0, info.n_layers)
    if not 0 <= start < end <= info.n_layers:
        raise SpawnRefused("layers", f"{start}:{end} is outside the model's {info.n_layers} "
                           f"layers (valid: a half-open range within 0:{info.n_layers})")
    if env.world_size > 1:  # the contract saw WORLD_SIZE ranges with this rank's at its place
        from engine.link.errors import ProtocolError
        from engine.link.layout import check_layout

        try:
            check_layout(list(env.layout), info.n_layers)
        except (ProtocolError, ValueError) as exc:
            raise SpawnRefused("layout", str(exc)) from exc
        if not Path(spec.key_file).is_file():
            raise SpawnRefused("key_file", f"{spec.key_file}: no such link key file")
    taken = {(h, p): r.engine_id for r in running for _, h, p in r.bound_ports()}
    for name, host, port in spec.bound_ports():
        if (host, port) in taken:
            raise SpawnRefused(name, f"{host}:{port} is already used by engine "
                               f"{taken[(host, port)]}", 409)


ENGINE_LOG = re.compile(r"^engine-(?P<engine_id>[A-Za-z0-9][A-Za-z0-9_.-]{0,95})\.log(\.\d+)?$")


@dataclass(frozen=True)
class LogFile:
    """One file of an engine's log (the live file or a rotated copy) as found on disk."""

    name: str
    modified_at: float


def engine_logs_to_prune(files: list[LogFile], running: frozenset[str], keep: int,
                         max_age_s: float, now: float) -> list[str]:
    """The engine log files to delete: every file (live and rotated) of each engine that is
    not running and either is not among the `keep` engines logged to most recently or was
    last written more than `max_age_s` ago. The count bounds a crash loop's logs, the age a
    quiet fleet's. Pure: the agent lists the directory and deletes."""
    last: dict[str, float] = {}
    names: dict[str, list[str]] = {}
    for f in files:
        found = ENGINE_LOG.match(f.name)
        if found is None:
            continue
        engine_id = found["engine_id"]
        last[engine_id] = max(last.get(engine_id, 0.0), f.modified_at)
        names.setdefault(engine_id, []).append(f.name)
    newest_first = sorted(last, key=lambda e: (-last[e], e))
    kept = {e for e in newest_first[:keep] if now - last[e] <= max_age_s} | running
    return sorted(name for engine_id in newest_first if engine_id not in kept
                  for name in names[engine_id])


def port_in_use(host: str, port: int) -> bool:
    """Would a listener on host:port fail to bind? (SO_REUSEADDR, as aiohttp binds.)"""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def engine_pythonpath() -> str:
    """PYTHONPATH that lets `python -m engine.main` import the engine this agent uses."""
    spec = importlib.util.find_spec("engine")
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if spec and spec.origin:
        root = str(Path(spec.origin).resolve().parent.parent)
        if root not in parts:
            parts.insert(0, root)
    return os.pathsep.join(parts)


def child_environment(spec: EngineSpec, drain_s: float) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k in PASSED_THROUGH or k.startswith(PASSED_PREFIXES)}
    env["PYTHONPATH"] = engine_pythonpath()
    env["PYTHONUNBUFFERED"] = "1"
    env.update(spec.engine_env(drain_s).to_environ())
    return env

"""A spawn request: the engine's environment contract as the supervisor sends it (the
mapping `engine.env.EngineEnv.to_environ` writes) beside the few fields that are the
agent's own, the pure checks that refuse a request that cannot work (naming the field or
variable to fix) before any process starts, and which old engine logs a spawn prunes."""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from engine.env import VARIABLE_OF, VARIABLES, EngineEnv, EnvError

ENGINE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
# What an engine inherits from the agent besides its contract: what a process needs to run.
PASSED_THROUGH = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TMPDIR", "TZ",
                  "PYTHONPATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES",
                  "CUDA_HOME", "HF_HOME", "OMP_NUM_THREADS")
PASSED_PREFIXES = ("OPENBLAS_", "MKL_", "NCCL_", "PYTORCH_", "MLX_", "METAL_")


class SpawnRefused(ValueError):
    """A spawn request the agent will not act on; `field` names what to fix: one of the
    request's own fields, or the contract's variable."""

    def __init__(self, field_name: str, message: str, status: int = 422) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message
        self.status = status


@dataclass(frozen=True)
class SpawnRequest:
    """`POST /v1/engines`: one stage to run. `env` is the engine's environment contract by
    its own variable names, read by the engine's own parser; the rest is the agent's: the
    engine's id (it names the run record, the log and the key files) and replica, and the
    secrets that arrive inside the mutual-TLS request, which the agent writes to 0600
    files and names in the contract (FLEET_KEY_FILE, FLEET_API_SECRET_FILE)."""

    engine_id: str
    env: Mapping[str, str]
    replica: str = ""
    link_key: str = ""  # the ring's link key, hex
    api_secret: str = field(default="", repr=False)  # rank 0's API secret

    @classmethod
    def from_dict(cls, raw: Any) -> SpawnRequest:
        if not isinstance(raw, Mapping):
            raise SpawnRefused("body", "expected a JSON object")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise SpawnRefused(unknown[0], f"unknown field (known: {', '.join(known)}; the "
                               "engine's settings go in env, by their variables)")
        for name in ("engine_id", "env"):
            if not raw.get(name):
                raise SpawnRefused(name, "is required")
        for name in ("engine_id", "replica", "link_key", "api_secret"):
            if not isinstance(raw.get(name, ""), str):
                raise SpawnRefused(name, f"expected a string, got {raw[name]!r}")
        env = raw["env"]
        if not isinstance(env, Mapping):
            raise SpawnRefused("env", "expected an object of the engine's variables")
        for variable, value in env.items():
            if variable not in VARIABLES:
                near = difflib.get_close_matches(variable, sorted(VARIABLES), 1)
                raise SpawnRefused(variable, "not a variable of the engine's contract" + (
                    f" (did you mean {near[0]}?)" if near else " (engine/env.py)"))
            if not isinstance(value, str):
                raise SpawnRefused(variable, f"expected a string, got {value!r}")
        for sent, attr in (("link_key", "key_file"), ("api_secret", "api_secret_file")):
            if raw.get(sent) and VARIABLE_OF[attr] in env:
                raise SpawnRefused(sent, f"send the secret or {VARIABLE_OF[attr]}, not both")
        return cls(raw["engine_id"], dict(env), raw.get("replica", ""),
                   raw.get("link_key", ""), raw.get("api_secret", ""))

    def to_dict(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id, "replica": self.replica, "env": dict(self.env),
                "link_key": self.link_key, "api_secret": self.api_secret}

    def spec(self, drain_s: float, key_file: Path | None = None,
             api_secret_file: Path | None = None) -> EngineSpec:
        """The stage as the engine will start: the request's contract, with the agent's
        `drain_s` where it sets none and the files the agent wrote its secrets to, read by
        the contract's own parser, so a refusal names the variable that is wrong."""
        env = dict(self.env)
        env.setdefault(VARIABLE_OF["drain_s"], repr(drain_s))
        for attr, path in (("key_file", key_file), ("api_secret_file", api_secret_file)):
            if path is not None:
                env[VARIABLE_OF[attr]] = str(path)
        try:
            engine = EngineEnv.from_environ(env)
        except EnvError as exc:
            sent = api_secret_file and exc.variable == VARIABLE_OF["api_secret_file"]
            raise SpawnRefused("api_secret" if sent else exc.variable, str(exc)) from exc
        if self.api_secret and engine.rank != 0:
            raise SpawnRefused("api_secret", "only rank 0 serves the API")
        # The secret was read to check its file; the engine reads it again, the agent never.
        return EngineSpec(self.engine_id, replace(engine, api_secret=""), self.replica)


class RecordError(ValueError):
    """A spec in a run record that this agent cannot read back."""


@dataclass(frozen=True)
class EngineSpec:
    """One stage as this agent runs it: its id and replica, and the engine's contract, read
    and checked. A view or a run record shows the contract as the variables the engine was
    started with (its secrets by their files alone)."""

    engine_id: str
    engine: EngineEnv
    replica: str = ""

    @property
    def rank(self) -> int:
        return self.engine.rank

    def to_dict(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id, "replica": self.replica,
                "env": self.engine.to_environ()}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> EngineSpec:
        """A run record's spec. The API secret's file is not read: its engine read it at
        start, and the record must stay readable while the engine runs."""
        if "env" not in raw:
            raise RecordError(f"engine {raw.get('engine_id')!r}: a spec of fields "
                              "(model_dir, rank, ...) from an agent before the contract "
                              "travelled whole; this agent reads only its env")
        try:
            engine = EngineEnv.from_environ(raw["env"], read_secret=False)
        except EnvError as exc:
            raise RecordError(f"engine {raw.get('engine_id')!r}: {exc}") from exc
        return cls(str(raw["engine_id"]), engine, str(raw.get("replica", "")))

    def bound_ports(self) -> list[tuple[str, str, int]]:
        """(variable, host, port) of every port this stage will listen on: rank 0's API
        (its default address too) and, in a ring, its ring listener and rank 0's control
        port."""
        e = self.engine
        out = []
        if e.rank == 0 and e.http:
            out.append((VARIABLE_OF["http"], *e.http))
        if e.world_size > 1 and e.listen:
            out.append((VARIABLE_OF["listen"], *e.listen))
        if e.rank == 0 and e.world_size > 1:
            out.append((VARIABLE_OF["master"], *e.master))
        return out


MODEL_DIR = VARIABLE_OF["model_dir"]


@dataclass(frozen=True)
class CheckpointInfo:
    """What a spawn check needs to know about the checkpoint directory."""

    model_dir: str
    n_layers: int
    weight_files: int


def read_checkpoint_info(model_dir: str) -> CheckpointInfo:
    """Read config.json's layer count and see that weights are there; SpawnRefused (naming
    FLEET_MODEL) if not."""
    from engine.config import ConfigError, ModelConfig

    path = Path(model_dir)
    if not path.is_dir():
        raise SpawnRefused(MODEL_DIR, f"{model_dir}: no such checkpoint directory")
    config_path = path / "config.json"
    try:
        raw = json.loads(config_path.read_text())
        config = ModelConfig.from_dict(raw)
    except FileNotFoundError as exc:
        raise SpawnRefused(MODEL_DIR, f"{config_path}: missing (not a checkpoint)") from exc
    except (OSError, ValueError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise SpawnRefused(MODEL_DIR, str(exc)) from exc
        raise SpawnRefused(MODEL_DIR, f"{config_path}: unreadable ({exc})") from exc
    weights = list(path.glob("*.safetensors"))
    if not weights:
        raise SpawnRefused(MODEL_DIR, f"{model_dir}: no *.safetensors weight files")
    return CheckpointInfo(str(path), config.num_hidden_layers, len(weights))


def check_spawn(spec: EngineSpec, info: CheckpointInfo, backends_present: frozenset[str],
                running: tuple[EngineSpec, ...]) -> None:
    """Refuse a spawn that cannot work on this node, naming the field or variable. Pure
    (ports are checked apart): the contract itself was checked when it was read."""
    if not ENGINE_ID.match(spec.engine_id):
        raise SpawnRefused("engine_id", f"{spec.engine_id!r}: use letters, digits, '-', '_', "
                           "'.' (at most 96)")
    if any(r.engine_id == spec.engine_id for r in running):
        raise SpawnRefused("engine_id", f"{spec.engine_id!r} is already running here", 409)
    env = spec.engine
    if backends_present and env.backend not in backends_present:
        raise SpawnRefused(VARIABLE_OF["backend"], f"{env.backend!r} is not available on this "
                           f"node (present: {', '.join(sorted(backends_present)) or 'none'})")
    start, end = env.layer_range or (0, info.n_layers)
    if not 0 <= start < end <= info.n_layers:
        raise SpawnRefused(VARIABLE_OF["layer_range"], f"{start}:{end} is outside the model's "
                           f"{info.n_layers} layers (valid: a half-open range within "
                           f"0:{info.n_layers})")
    if env.world_size > 1:  # the contract saw WORLD_SIZE ranges with this rank's at its place
        from engine.link.errors import ProtocolError
        from engine.link.layout import check_layout

        try:
            check_layout(list(env.layout), info.n_layers)
        except (ProtocolError, ValueError) as exc:
            raise SpawnRefused(VARIABLE_OF["layout"], str(exc)) from exc
        if env.key_file is None or not env.key_file.is_file():
            raise SpawnRefused(VARIABLE_OF["key_file"], f"{env.key_file}: no such link key file")
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


def engine_pythonpath() -> str:
    """PYTHONPATH that lets `python -m engine.main` import the engine this agent uses."""
    spec = importlib.util.find_spec("engine")
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if spec and spec.origin:
        root = str(Path(spec.origin).resolve().parent.parent)
        if root not in parts:
            parts.insert(0, root)
    return os.pathsep.join(parts)


def child_environment(spec: EngineSpec) -> dict[str, str]:
    """What the engine starts with: what a process needs to run, and its contract."""
    env = {k: v for k, v in os.environ.items()
           if k in PASSED_THROUGH or k.startswith(PASSED_PREFIXES)}
    env["PYTHONPATH"] = engine_pythonpath()
    env["PYTHONUNBUFFERED"] = "1"
    env.update(spec.engine.to_environ())
    return env

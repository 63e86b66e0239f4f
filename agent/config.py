"""The agent's settings: one frozen dataclass, read from a YAML file, with the paths it derives."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

GIB = 1 << 30


class ConfigError(ValueError):
    """The agent's YAML file is missing, unreadable, or holds a bad key or value."""


def default_state_dir() -> Path:
    """Where the agent keeps certificates, run records, calibrations and engine logs."""
    if sys.platform == "darwin":
        if os.geteuid() == 0:
            return Path("/Library/Application Support/ringfleet")
        return Path.home() / "Library/Application Support/ringfleet"
    if os.geteuid() == 0:
        return Path("/var/lib/ringfleet")
    return Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local/state")) / "ringfleet"


def default_config_path() -> Path:
    if sys.platform == "darwin":
        return default_state_dir() / "agent.yaml"
    return Path("/etc/ringfleet/agent.yaml") if os.geteuid() == 0 else (
        default_state_dir() / "agent.yaml")


@dataclass(frozen=True)
class AgentConfig:
    node: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    state_dir: Path = field(default_factory=default_state_dir)
    # The API (mutual TLS). Never a wildcard (engine.addresses): the API can spawn processes.
    listen_host: str = "127.0.0.1"
    listen_port: int = 7700
    advertise_url: str = ""  # how peers and the supervisor reach this agent; derived if empty
    supervisor_url: str = ""  # empty: no heartbeats (a standalone agent)
    heartbeat_interval_s: float = 5.0
    facts_refresh_s: float = 60.0
    backend_probe_timeout_s: float = 120.0
    # Memory the OS and everything else keeps: never offered for weights and KV.
    os_floor_bytes: int = 4 * GIB
    gpu_reserve_bytes: int = 1 * GIB  # per discrete GPU: the framework's context and workspace
    # Engine lifecycle.
    drain_s: float = 180.0  # in-flight requests get this long after SIGTERM
    term_grace_s: float = 10.0  # then this much more before SIGKILL
    kill_grace_s: float = 5.0  # after SIGKILL, to see the process gone
    ready_timeout_s: float = 900.0  # a stage that never reports ready is stopped
    adopt_engines: bool = True  # after a restart: adopt live engines (False: drain them)
    engine_command: tuple[str, ...] = (sys.executable, "-m", "engine.main")
    engine_log_max_bytes: int = 16 << 20
    engine_log_backups: int = 3
    # Logs of engines that exited: those of the newest `engine_logs_keep` engines are kept,
    # none older than `engine_logs_max_age_s` (pruned whenever an engine starts).
    engine_logs_keep: int = 20
    engine_logs_max_age_s: float = 14 * 86400.0
    # Ports the stages and the link probe use (inclusive range).
    stage_port_first: int = 29500
    stage_port_last: int = 29599
    probe_max_bytes: int = 256 << 20
    probe_max_s: float = 20.0
    # Calibration defaults (a request may narrow them).
    calibration_budget_s: float = 30.0
    calibration_runs: int = 5
    calibration_warmup: int = 2
    calibration_contexts: tuple[int, ...] = (512, 4096)
    calibration_batch_rows: int = 8
    calibration_chunk_rows: int = 4096
    log_level: str = "info"
    # The agent's own log: empty for standard error (journald, a terminal); a path for a file
    # the agent rotates itself (launchd, or Linux without journald), like the engines' logs.
    log_file: str = ""
    log_max_bytes: int = 16 << 20
    log_backups: int = 3

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)
        set_("state_dir", Path(self.state_dir).expanduser())
        set_("engine_command", tuple(self.engine_command))
        set_("calibration_contexts", tuple(int(c) for c in self.calibration_contexts))
        if not self.node or "/" in self.node:
            raise ConfigError(f"node={self.node!r}: a node name is a non-empty word without '/'")
        from engine.addresses import wildcard_refusal

        refusal = wildcard_refusal(self.listen_host, f"listen_host={self.listen_host!r}")
        if refusal:
            raise ConfigError(refusal)
        if not 0 < self.listen_port < 65536:
            raise ConfigError(f"listen_port={self.listen_port}: expected 1..65535")
        if not 0 < self.stage_port_first <= self.stage_port_last < 65536:
            raise ConfigError(f"stage ports {self.stage_port_first}..{self.stage_port_last}: "
                              "expected 1 <= first <= last <= 65535")
        for name in ("heartbeat_interval_s", "facts_refresh_s", "drain_s", "term_grace_s",
                     "kill_grace_s", "ready_timeout_s", "probe_max_s", "calibration_budget_s",
                     "engine_logs_keep", "engine_logs_max_age_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)!r}: must be positive")
        if not self.engine_command:
            raise ConfigError("engine_command is empty")
        if self.supervisor_url and not self.supervisor_url.startswith("https://"):
            raise ConfigError(f"supervisor_url={self.supervisor_url!r}: expected "
                              "https://SUPERVISOR:PORT (the address `fleet-agent join` used)")

    # Files on disk, all under state_dir.
    @property
    def pki_dir(self) -> Path:
        return self.state_dir / "pki"

    @property
    def run_dir(self) -> Path:
        return self.state_dir / "run"

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def calibration_dir(self) -> Path:
        return self.state_dir / "calibration"

    @property
    def stage_ports(self) -> range:
        return range(self.stage_port_first, self.stage_port_last + 1)

    @property
    def stop_timeout_s(self) -> float:
        """The longest a graceful stop of the agent can take: what a service manager must allow."""
        return self.drain_s + self.term_grace_s + self.kill_grace_s + 30.0

    @property
    def url(self) -> str:
        from engine.addresses import format_host_port

        return self.advertise_url or f"https://{format_host_port(self.listen_host, self.listen_port)}"

    def with_overrides(self, **overrides: Any) -> AgentConfig:
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "<dict>") -> AgentConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {', '.join(unknown)} "
                              f"(known: {', '.join(sorted(known))})")
        try:
            return cls(**raw)
        except TypeError as exc:
            raise ConfigError(f"{source}: {exc}") from exc

    @classmethod
    def load(cls, path: Path | None, **overrides: Any) -> AgentConfig:
        """Read `path` (a missing default file means all defaults), then apply overrides."""
        raw = read_settings(path) if path is not None else {}
        raw.update({k: v for k, v in overrides.items() if v is not None})
        return cls.from_dict(raw, str(path or "<defaults>"))

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = (str(value) if isinstance(value, Path)
                           else list(value) if isinstance(value, tuple) else value)
        return out


def read_settings(path: Path) -> dict[str, Any]:
    """The settings the YAML file at `path` holds; a ConfigError says what is wrong with it."""
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: no such file") from exc
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of settings at the top")
    return raw


def write_settings(path: Path, **settings: Any) -> AgentConfig:
    """Set `settings` (those not None) in the YAML file at `path`, keeping its other keys;
    a missing file is created (0600). Returns the config the file now holds, checked first:
    a bad value leaves the file as it was."""
    path = Path(path)
    raw = read_settings(path) if path.is_file() else {}
    raw.update({k: str(v) if isinstance(v, Path) else v
                for k, v in settings.items() if v is not None})
    config = AgentConfig.from_dict(raw, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(raw, f, sort_keys=True)
    os.replace(partial, path)
    return config

"""The supervisor process's own settings (fleet.yaml holds the fleet; these hold the process)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from supervisor.lifecycle import Policy
from supervisor.membership import MembershipTimes


class SettingsError(ValueError):
    """A supervisor setting is out of range; the message names it."""


def split_address(text: str, what: str) -> tuple[str, int]:
    """HOST:PORT of a listener, by the one address rule (engine.addresses): never a wildcard,
    literal or resolved."""
    from engine.addresses import AddressError, listen_address

    try:
        return listen_address(text, what, min_port=1)
    except AddressError as exc:
        raise SettingsError(str(exc)) from exc


@dataclass(frozen=True)
class SupervisorSettings:
    state_dir: Path
    listen: str = "127.0.0.1:7400"  # the mutual-TLS API for agents and fleetctl
    # The OpenAI endpoint for clients (plain HTTP), served in this process; "": none here,
    # `fleet-front-door` serves it as a process of its own (docs/supervisor.md).
    front_door: str = "127.0.0.1:8000"
    api_keys: tuple[str, ...] = ()  # empty: the front door takes any client
    membership: MembershipTimes = field(default_factory=MembershipTimes)
    policy: Policy = field(default_factory=Policy)
    tick_s: float = 0.5
    health_interval_s: float = 1.0
    calibration_budget_s: float = 30.0  # per node and model; 0: nominal timings, no probes
    measure_timeout_s: float = 300.0  # a calibration or probe not done by then counts as failed
    # A calibration or probe kept in the state is reused until this old, or until its node's
    # backend versions change (a new torch measures differently).
    measurement_max_age_s: float = 7 * 86400.0
    engine_port_first: int = 29600  # ports the supervisor gives stages, on every node
    engine_port_last: int = 29999

    def __post_init__(self) -> None:
        object.__setattr__(self, "state_dir", Path(self.state_dir).expanduser())
        split_address(self.listen, "listen")
        if self.front_door:
            split_address(self.front_door, "front_door")
        if not 0 < self.engine_port_first < self.engine_port_last < 65536:
            raise SettingsError(f"engine ports {self.engine_port_first}..{self.engine_port_last}"
                                ": expected 1 <= first < last <= 65535")
        for name in ("tick_s", "health_interval_s", "measurement_max_age_s"):
            if not getattr(self, name) > 0:
                raise SettingsError(f"{name}={getattr(self, name)!r}: must be positive")

    @property
    def db_path(self) -> Path:
        return self.state_dir / "supervisor.sqlite"

    @property
    def keys_dir(self) -> Path:
        return self.state_dir / "keys"

    @property
    def front_door_url(self) -> str:
        return f"http://{self.front_door}/v1" if self.front_door else ""

"""The records the replica lifecycle decides over and the actions it returns: a replica and
its stages as stored, what the probes of rank 0's /health heard, the frozen snapshot `decide`
reads, and the policy's timings. `supervisor/lifecycle.py` holds the decisions."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.addresses import format_host_port
from supervisor.fleet_config import FleetConfig
from supervisor.measurements import NOTHING_MEASURED, Measured
from supervisor.membership import Member
from supervisor.memory import ModelShape
from supervisor.placement import Placement
from supervisor.relays import RING_LIVENESS


@dataclass(frozen=True)
class Policy:
    backoff_first_s: float = 1.0
    backoff_max_s: float = 60.0
    start_timeout_s: float = 600.0  # placed to serving
    drain_s: float = 180.0  # in-flight requests get this long
    drain_grace_s: float = 30.0  # then the replica counts as stopped whatever the agents say
    # A serving replica whose rank 0 has not answered /health this long fails: the ring's
    # dead-ring time, the silence after which its followers would leave (and the front door
    # gives up a relay), so a frozen one-stage replica, which has no follower, fails too.
    rank0_silence_s: float = RING_LIVENESS.silence_limit_s

    def backoff_s(self, failures: int) -> float:
        return min(self.backoff_max_s, self.backoff_first_s * 2 ** max(0, failures - 1))


@dataclass(frozen=True)
class StageRecord:
    rank: int
    node: str
    backend: str
    layer_range: tuple[int, int]
    engine_id: str
    host: str  # the node's address (its member's host)
    listen_port: int
    http_port: int = 0  # rank 0 only
    memory_bytes: int = 0  # what placement charged it: held while it runs
    prompt_cache_slot_bytes: int = 0  # what one of its kept slots holds (memory counts them)
    prompt_cache_budget_bytes: int = 0  # the budget that bought them (0: a count was set)

    def ports(self) -> tuple[int, ...]:
        return (self.listen_port, self.http_port) if self.http_port else (self.listen_port,)

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self), layer_range=list(self.layer_range))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> StageRecord:
        return cls(**dict(raw, layer_range=tuple(raw["layer_range"])))


@dataclass(frozen=True)
class Replica:
    id: str
    model_id: str
    generation: int
    state: str
    since: float  # when it entered this state
    spec_digest: str
    rebalance_epoch: int = 0
    failures: int = 0  # failures in a row of this model (reset when one serves)
    next_attempt_at: float = 0.0  # failed / stopped: the next generation not before this
    reason: str = ""
    stages: tuple[StageRecord, ...] = ()
    master_port: int = 0
    placement_id: str = ""
    why: tuple[str, ...] = ()
    note: str = ""  # about the placement, e.g. an explicit one replaced while a node is gone
    slot: int = 0  # which of the model's replicas this is (a generation of that slot)
    replaces: str = ""  # the serving replica this one takes over from (make before break)
    model_replicas: int = 1  # the model's replica count when placed (0: auto, not yet counted)
    started_at: float = 0.0  # when its stages were asked to start
    load_s: float = 0.0  # from start to serving, once it served
    prompt_cache_slots: int = 0  # kept past `parallel` on every stage, as placement chose
    kv_pages: int = 0  # every stage's pool of KV pages, as placement charged it (0: none)

    @property
    def url(self) -> str:
        """Rank 0's OpenAI base URL ("" before the stages exist)."""
        if not self.stages:
            return ""
        return f"http://{format_host_port(self.stages[0].host, self.stages[0].http_port)}"

    def layout(self) -> tuple[tuple[str, str, tuple[int, int]], ...]:
        return tuple((s.node, s.backend, s.layer_range) for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self), stages=[s.to_dict() for s in self.stages], why=list(self.why),
                    url=self.url)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Replica:
        raw = {k: v for k, v in raw.items() if k != "url"}
        return cls(**dict(raw, stages=tuple(StageRecord.from_dict(s) for s in raw["stages"]),
                          why=tuple(raw.get("why", ()))))


@dataclass(frozen=True)
class Rank0Heard:
    """What the supervisor's /health probes of one replica's rank 0 heard lately."""

    heard_at: float  # its last answer (any status), or the first probe unanswered since
    silent_until: float = 0.0  # the end of the latest probe when it went unanswered; 0: answered
    silent_from: float = 0.0  # when the first probe unanswered since its last answer went out
    node_beat_at: float = 0.0  # its node's last heartbeat when the latest unanswered probe went out

    @property
    def silent_s(self) -> float:
        """How long rank 0 has gone unanswered, as far as probes saw (0: it answers)."""
        return max(0.0, self.silent_until - self.heard_at) if self.silent_until else 0.0

    @property
    def node_heard_meanwhile(self) -> bool:
        """Whether its node's agent beat after rank 0 first went unanswered and before a
        probe that went unanswered too: the supervisor's own network reached the node while
        rank 0 was silent, so the silence is rank 0's, not the supervisor's."""
        return self.silent_from < self.node_beat_at


def after_probe(heard: Rank0Heard | None, sent_at: float, ended_at: float, answered: bool,
                node_beat_at: float, probe_timeout_s: float, max_gap_s: float) -> Rank0Heard:
    """`heard` after one more probe, sent at `sent_at` (its node's agent last beat at
    `node_beat_at` then) and over at `ended_at`. Any answer counts, a 503 "draining" too:
    only no answer (a timeout, a refused or reset connection) is silence. Silence is counted
    only over time the probes covered, so a supervisor that stalled or was suspended takes
    nobody's silence for longer than it saw: a probe ends at most `probe_timeout_s` after it
    was sent (one seen ending later was held up on this side), and a probe sent more than
    `max_gap_s` after the previous one ended (more than one health round) starts the count
    again."""
    if answered:
        return Rank0Heard(ended_at)
    until = min(ended_at, sent_at + probe_timeout_s)
    if heard is None or sent_at - (heard.silent_until or heard.heard_at) > max_gap_s:
        return Rank0Heard(sent_at, until, sent_at, node_beat_at)
    return Rank0Heard(heard.heard_at, until, heard.silent_from if heard.silent_until else sent_at,
                      node_beat_at)


@dataclass(frozen=True)
class Snapshot:
    now: float
    desired: FleetConfig | None
    members: Mapping[str, Member]
    replicas: Mapping[str, Replica]  # every replica the state keeps
    shapes: Mapping[str, ModelShape | str]  # per model: its shape, or why it is unknown
    healthy: frozenset[str] = frozenset()  # replicas whose rank 0 answered /health
    rebalance_epoch: int = 0
    policy: Policy = Policy()
    measured: Measured = NOTHING_MEASURED
    engine_ports: tuple[int, int] = (29600, 29999)  # the range stages listen in, every node
    # (host, port) pairs found taken by another process when a start was about to use them
    busy_ports: frozenset[tuple[str, int]] = frozenset()
    # replica -> what the probes of its rank 0's /health heard (only replicas probed lately)
    rank0_heard: Mapping[str, Rank0Heard] = field(default_factory=dict)


# --- actions ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Record:
    """Store this replica as it is now (new, or changed state)."""

    replica: Replica


@dataclass(frozen=True)
class StartStages:
    """Write the link key and spawn every stage of `replica` (starting, its ports chosen);
    then store it."""

    replica: Replica
    placement: Placement = field(compare=False)


@dataclass(frozen=True)
class StopEngines:
    """Ask the agents to drain every engine of the replica (SIGTERM: in-flight finish)."""

    replica: Replica
    drain_s: float
    reason: str


@dataclass(frozen=True)
class ForgetEngine:
    """An ended replica's engine has exited: the agent may drop its record."""

    node: str
    engine_id: str


Action = Record | StartStages | StopEngines | ForgetEngine


def latest_by_model(replicas: Mapping[str, Replica]) -> dict[str, Replica]:
    out: dict[str, Replica] = {}
    for r in replicas.values():
        if r.model_id not in out or r.generation > out[r.model_id].generation:
            out[r.model_id] = r
    return out


def engine_owners(replicas: Mapping[str, Replica]) -> dict[str, str]:
    """engine id -> the node its stage was placed on: the one agent that may report it."""
    return {s.engine_id: s.node for r in replicas.values() for s in r.stages}


def foreign_engines(node: str, engine_ids: list[str],
                    replicas: Mapping[str, Replica]) -> dict[str, str]:
    """The engines among `engine_ids` that run on another node than `node`, with that node.
    Engines no replica names (pruned history) belong to nobody and are not foreign."""
    owners = engine_owners(replicas)
    return {e: owners[e] for e in engine_ids if owners.get(e, node) != node}


def replica_id(model_id: str, generation: int) -> str:
    safe = "".join(c if c.isalnum() or c in "._-" else "-" for c in model_id)
    return f"{safe}-g{generation}"

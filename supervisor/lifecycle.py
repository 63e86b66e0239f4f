"""Replica lifecycle: placing → starting → warming → serving → draining → stopped, or failed.

`decide(snapshot)` is a pure function of the desired state, the members (with the engines
their agents report), the replicas and the clock; it returns the actions the service loop
applies (create a replica, start its stages, change its state, stop its engines). Policy:
- fail-fast: one stage lost (its engine exited, or its node dead or gone) fails the whole
  replica; the survivors are stopped and a new generation is placed on what remains after
  a backoff that doubles with each failure in a row;
- a join changes nothing: a serving replica is re-placed only when its model's spec changes
  (`fleetctl apply`), a node it uses is cordoned (`fleetctl drain`), or a rebalance finds a
  different placement, and then it drains first (in-flight requests finish);
- a model no longer in fleet.yaml drains and stops.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from engine.addresses import format_host_port
from engine.env import placement_id
from supervisor.fleet_config import FleetConfig
from supervisor.measurements import NOTHING_MEASURED, Measured
from supervisor.membership import ALIVE, DEAD, LEFT, Member
from supervisor.memory import ModelShape
from supervisor.placement import Placement
from supervisor.planning import candidates, plan_model, same_layout, spec_digest

PLACING, STARTING, WARMING, SERVING = "placing", "starting", "warming", "serving"
DRAINING, STOPPED, FAILED = "draining", "stopped", "failed"
LIVE_STATES = (PLACING, STARTING, WARMING, SERVING, DRAINING)
RUNNING_STATES = (STARTING, WARMING, SERVING, DRAINING)


@dataclass(frozen=True)
class Policy:
    backoff_first_s: float = 1.0
    backoff_max_s: float = 60.0
    start_timeout_s: float = 600.0  # placed to serving
    drain_s: float = 180.0  # in-flight requests get this long
    drain_grace_s: float = 30.0  # then the replica counts as stopped whatever the agents say

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


def decide(s: Snapshot) -> list[Action]:
    actions: list[Action] = []
    desired_ids = {m.id for m in s.desired.models} if s.desired else set()
    latest = latest_by_model(s.replicas)
    for replica in latest.values():
        if replica.model_id not in desired_ids and replica.state in LIVE_STATES:
            actions += _retire(s, replica)
    for spec in s.desired.models if s.desired else ():
        current = latest.get(spec.id)
        digest = spec_digest(spec)
        if current is None or (current.state in (STOPPED, FAILED)
                               and s.now >= current.next_attempt_at):
            generation = current.generation + 1 if current else 1
            failures = current.failures if current else 0
            actions.append(Record(Replica(replica_id(spec.id, generation), spec.id, generation,
                                          PLACING, s.now, digest, s.rebalance_epoch, failures)))
            continue
        if current.state in (STOPPED, FAILED):
            continue
        step = {PLACING: _placing, STARTING: _starting, WARMING: _starting,
                SERVING: _serving, DRAINING: _draining}[current.state]
        actions += step(s, current, digest)
    return actions + _forget_ended(s)


def _forget_ended(s: Snapshot) -> list[Action]:
    out: list[Action] = []
    for replica in s.replicas.values():
        if replica.state not in (STOPPED, FAILED):
            continue
        for stage in replica.stages:
            member = s.members.get(stage.node)
            engine = member.engines.get(stage.engine_id) if member else None
            if member and member.state == ALIVE and engine and engine.state == "exited":
                out.append(ForgetEngine(stage.node, stage.engine_id))
    return out


def _to(replica: Replica, state: str, now: float, reason: str, **changes: Any) -> Replica:
    return replace(replica, state=state, since=now, reason=reason, **changes)


def fail_actions(replica: Replica, reason: str, now: float, policy: Policy) -> list[Action]:
    """Fail `replica`: record why, set the backoff, and stop whatever stages still run."""
    failures = replica.failures + 1
    failed = _to(replica, FAILED, now, reason, failures=failures,
                 next_attempt_at=now + policy.backoff_s(failures))
    out: list[Action] = [Record(failed)]
    if replica.stages:
        out.append(StopEngines(failed, 0.0, f"replica failed: {reason}"))
    return out


def _fail(s: Snapshot, replica: Replica, reason: str) -> list[Action]:
    return fail_actions(replica, reason, s.now, s.policy)


def _placing(s: Snapshot, replica: Replica, digest: str) -> list[Action]:
    assert s.desired is not None
    spec = s.desired.model(replica.model_id)
    shape = s.shapes.get(replica.model_id)
    if spec is None:
        return []
    if not isinstance(shape, ModelShape):
        reason = f"cannot read the checkpoint's shape: {shape}"
        return [] if reason == replica.reason else [Record(replace(replica, reason=reason))]
    if replica.spec_digest != digest:
        replica = replace(replica, spec_digest=digest)
    measuring = sorted({m.node for m, _ in candidates(spec, s.desired, s.members)}
                       & s.measured.pending)
    if measuring:
        reason = f"measuring {', '.join(measuring)} (calibration, link probes)"
        return [] if reason == replica.reason else [Record(replace(replica, reason=reason))]
    plan = plan_model(spec, shape, s.desired, s.members, s.measured)
    if plan.placement is None:
        return [] if plan.error == replica.reason else [Record(replace(replica, reason=plan.error))]
    stages = assign_ports(replica.id, plan.placement, s)
    if isinstance(stages, str):
        return _fail(s, replica, stages)
    records, master_port = stages
    starting = _to(replica, STARTING, s.now, "", note=plan.note, why=plan.placement.why,
                   stages=records, master_port=master_port,
                   placement_id=placement_id([r.layer_range for r in records],
                                             [r.backend for r in records]))
    return [StartStages(starting, plan.placement)]


def assign_ports(replica_id_: str, placement: Placement, s: Snapshot
                 ) -> tuple[tuple[StageRecord, ...], int] | str:
    """Each stage's host and ports (rank 0 also its API and its control port), or why not.

    A port is free on a host when no running replica uses it there and it was not found
    busy. The search goes round the range from just after the ports of the replica started
    last, so a port given up a moment ago is the last to be handed out again."""
    first, last = s.engine_ports
    used: dict[str, set[int]] = {}
    for r in s.replicas.values():
        if r.state in RUNNING_STATES:
            for st in r.stages:
                used.setdefault(st.host, set()).update(st.ports())
                if st.rank == 0:
                    used[st.host].add(r.master_port)
    for host, port in s.busy_ports:
        used.setdefault(host, set()).add(port)
    latest = max((r for r in s.replicas.values() if r.stages), key=lambda r: r.since,
                 default=None)
    start = max((p for st in latest.stages for p in st.ports()), default=last) + 1 \
        if latest else first
    order = [first + (start - first + i) % (last - first + 1) for i in range(last - first + 1)]
    records, master_port = [], 0
    for stage in placement.stages:
        host = s.members[stage.node].host
        taken = used.setdefault(host, set())
        free = [p for p in order if p not in taken][:3 if stage.rank == 0 else 1]
        if len(free) < (3 if stage.rank == 0 else 1):
            return f"no free engine port on {host} in {first}..{last}"
        taken.update(free)
        listen, http = free[0], free[1] if stage.rank == 0 else 0
        if stage.rank == 0:
            master_port = free[2]
        records.append(StageRecord(stage.rank, stage.node, stage.backend, stage.layer_range,
                                   f"{replica_id_}-r{stage.rank}", host, listen, http))
    return tuple(records), master_port


def _lost_stage(s: Snapshot, replica: Replica) -> str | None:
    """Why one of the replica's stages is gone, or None while all may still run."""
    for stage in replica.stages:
        member = s.members.get(stage.node)
        if member is None or member.state in (DEAD, LEFT):
            state = member.state if member else "unknown"
            return f"node {stage.node} (rank {stage.rank}) is {state}"
        engine = member.engines.get(stage.engine_id)
        if engine is None and replica.state in (WARMING, SERVING) and member.state == ALIVE:
            return f"node {stage.node} no longer reports rank {stage.rank} ({stage.engine_id})"
        if engine is not None and engine.state == "exited" and not _clean_exit(engine.exit):
            exit_ = engine.exit or {}
            detail = exit_.get("reason") or f"code {exit_.get('code')}"
            return f"rank {stage.rank} on {stage.node} exited: {detail}"
    return None


def _clean_exit(exit_: Mapping[str, Any] | None) -> bool:
    """An engine's own clean end (code 0): its drain finished, however it was asked."""
    return exit_ is not None and exit_.get("code") == 0


def _drained_stage(s: Snapshot, replica: Replica) -> str | None:
    """Why the replica ended cleanly: a stage that exited with code 0 (SIGTERM to any stage
    drains the whole replica; from outside the supervisor, or by its agent), or None."""
    for stage in replica.stages:
        member = s.members.get(stage.node)
        engine = member.engines.get(stage.engine_id) if member else None
        if engine is not None and engine.state == "exited" and _clean_exit(engine.exit):
            said = (engine.exit or {}).get("reason") or "code 0"
            return f"rank {stage.rank} on {stage.node} ended cleanly ({said})"
    return None


def _stop_drained(s: Snapshot, replica: Replica, reason: str) -> list[Action]:
    """Not a failure: no backoff and no failure counted; the next generation is placed at
    once, and whatever stage is left is stopped."""
    stopped = _to(replica, STOPPED, s.now, reason, next_attempt_at=s.now)
    return [Record(stopped), StopEngines(stopped, 0.0, f"replica drained: {reason}")]


def _engine_states(s: Snapshot, replica: Replica) -> list[str]:
    out = []
    for stage in replica.stages:
        member = s.members.get(stage.node)
        engine = member.engines.get(stage.engine_id) if member else None
        out.append(engine.state if engine else "unknown")
    return out


def _starting(s: Snapshot, replica: Replica, digest: str) -> list[Action]:
    policy = s.policy
    lost = _lost_stage(s, replica)
    if lost:
        return _fail(s, replica, lost)
    drained = _drained_stage(s, replica)
    if drained:
        return _stop_drained(s, replica, drained)
    if s.now - replica.since > policy.start_timeout_s:
        return _fail(s, replica, f"not serving {policy.start_timeout_s:g} s after start")
    states = _engine_states(s, replica)
    if replica.state == STARTING and all(st == "ready" for st in states):
        return [Record(_to(replica, WARMING, s.now, "every stage is ready; waiting for rank 0"))]
    if replica.id in s.healthy and all(st == "ready" for st in states):
        return [Record(_to(replica, SERVING, s.now, "", failures=0))]
    return []


def _serving(s: Snapshot, replica: Replica, digest: str) -> list[Action]:
    policy = s.policy
    lost = _lost_stage(s, replica)
    if lost:
        return _fail(s, replica, lost)
    drained = _drained_stage(s, replica)
    if drained:
        return _stop_drained(s, replica, drained)
    why = _replace_reason(s, replica, digest)
    if why is None:
        if replica.rebalance_epoch < s.rebalance_epoch:  # looked at: stays where it is
            return [Record(replace(replica, rebalance_epoch=s.rebalance_epoch))]
        return []
    draining = _to(replica, DRAINING, s.now, why, next_attempt_at=s.now)
    return [Record(draining), StopEngines(draining, policy.drain_s, why)]


def _replace_reason(s: Snapshot, replica: Replica, digest: str) -> str | None:
    """Why a serving replica should be re-placed at a drain boundary, or None."""
    if replica.spec_digest != digest:
        return "fleet.yaml changed this model"
    cordoned = [st.node for st in replica.stages
                if (m := s.members.get(st.node)) is not None and m.cordoned]
    if cordoned:
        return f"node {', '.join(cordoned)} is being drained"
    if s.rebalance_epoch > replica.rebalance_epoch:
        assert s.desired is not None
        spec, shape = s.desired.model(replica.model_id), s.shapes.get(replica.model_id)
        if spec is not None and isinstance(shape, ModelShape):
            plan = plan_model(spec, shape, s.desired, s.members, s.measured)
            if plan.placement is not None and not same_layout(plan.placement, replica.layout()):
                return "rebalance: " + " -> ".join(plan.placement.ring)
    return None


def _draining(s: Snapshot, replica: Replica, digest: str) -> list[Action]:
    policy = s.policy
    states = _engine_states(s, replica)
    gone = all(st in ("exited", "unknown") for st in states)
    if gone or s.now - replica.since > policy.drain_s + policy.drain_grace_s:
        return [Record(_to(replica, STOPPED, s.now, replica.reason, next_attempt_at=s.now))]
    return []


def _retire(s: Snapshot, replica: Replica) -> list[Action]:
    policy = s.policy
    reason = "model removed from fleet.yaml"
    if replica.state == DRAINING:
        return _draining(s, replica, "")
    if replica.state == PLACING or not replica.stages:
        return [Record(_to(replica, STOPPED, s.now, reason, next_attempt_at=s.now))]
    draining = _to(replica, DRAINING, s.now, reason)
    return [Record(draining), StopEngines(draining, policy.drain_s, reason)]

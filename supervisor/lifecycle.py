"""Replica lifecycle: placing → starting → warming → serving → draining → stopped, or failed.

`decide(snapshot)` is a pure function of the desired state, the members (with the engines
their agents report), the replicas and the clock; it returns the actions the service loop
applies (create a replica, start its stages, change its state, stop its engines). Policy:
- fail-fast: one stage lost (its engine exited, or its node dead or gone), or a serving
  rank 0 that has not answered /health for the ring's dead-ring time (frozen), fails the
  whole replica; its stages are stopped and a new generation is placed on what remains
  after a backoff that doubles with each failure in a row;
- a join changes nothing: a serving replica is re-placed only when its model's spec changes
  (`fleetctl apply`), a node it uses is cordoned (`fleetctl drain`), or a rebalance finds a
  different placement;
- make before break: a replica to be re-placed keeps serving while its successor is placed
  beside it (in memory its stages do not hold), started and warmed, and drains (in-flight
  requests finish) once the successor serves; with no room beside it, it drains first;
- a model has `replicas` slots, each a line of generations; its replicas placing are placed
  together (supervisor/joint_placement.py), and one slot changes at a time, so a drain, a
  new spec or a rebalance rolls through the replicas one by one;
- a model no longer in fleet.yaml (or a slot past `replicas`) drains and stops.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from engine.env import placement_id
from supervisor.fleet_config import AUTO_REPLICAS, ModelSpec
from supervisor.membership import ALIVE, DEAD, LEFT
from supervisor.memory import ModelShape
from supervisor.placement import Placement
from supervisor.planning import (
    candidates,
    held_bytes,
    plan_model,
    plan_replicas,
    same_layout,
    spec_digest,
)
from supervisor.replica_records import (  # noqa: F401 - the lifecycle's vocabulary
    Action,
    ForgetEngine,
    Policy,
    Rank0Heard,
    Record,
    Replica,
    Snapshot,
    StageRecord,
    StartStages,
    StopEngines,
    after_probe,
    engine_owners,
    foreign_engines,
    latest_by_model,
    replica_id,
)

PLACING, STARTING, WARMING, SERVING = "placing", "starting", "warming", "serving"
REBALANCE = "rebalance: "  # how a rebalance's reason starts
DRAINING, STOPPED, FAILED = "draining", "stopped", "failed"
LIVE_STATES = (PLACING, STARTING, WARMING, SERVING, DRAINING)
RUNNING_STATES = (STARTING, WARMING, SERVING, DRAINING)



def decide(s: Snapshot) -> list[Action]:
    actions: list[Action] = []
    desired = {m.id: m for m in s.desired.models} if s.desired else {}
    for replica in sorted(s.replicas.values(), key=lambda r: (r.model_id, r.generation)):
        if replica.model_id not in desired and replica.state in LIVE_STATES:
            actions += _retire(s, replica, "model removed from fleet.yaml")
    for spec in desired.values():
        actions += _model(s, spec)
    return actions + _forget_ended(s)


def replica_count(spec: ModelSpec, mine: list[Replica]) -> int:
    """How many replicas (slots) the model has: fleet.yaml's number, or for `replicas: auto`
    what its last placement from scratch found to fit (1 until then: that placement, made
    by the first slot's replica, counts the rest)."""
    if not spec.replicas_are_auto:
        return spec.replicas
    latest: dict[int, Replica] = {}
    for r in mine:
        if r.slot not in latest or r.generation > latest[r.slot].generation:
            latest[r.slot] = r
    return max((r.model_replicas for r in latest.values()), default=0) or 1


def _model(s: Snapshot, spec: ModelSpec) -> list[Action]:
    """One model's replicas, slot by slot: an empty slot gets a new generation (after its
    backoff), each live replica takes its step, and the replicas placing are placed together.
    At most one slot of a model changes at a time (make-before-break or a drain), so a change
    rolls through its replicas one by one."""
    digest = spec_digest(spec)
    mine = sorted((r for r in s.replicas.values() if r.model_id == spec.id),
                  key=lambda r: r.generation)
    count = replica_count(spec, mine)
    roll = _Roll(next_generation=(mine[-1].generation if mine else 0) + 1,
                 busy=any(_changing(r) for r in mine if r.slot < count))
    actions: list[Action] = []
    placing: list[Replica] = []
    for replica in mine:
        if replica.slot >= count and replica.state in LIVE_STATES:
            actions += _retire(s, replica, f"replicas: {count} in fleet.yaml")
    for slot in range(count):
        in_slot = [r for r in mine if r.slot == slot]
        live = [r for r in in_slot if r.state in LIVE_STATES]
        if not live:
            last = in_slot[-1] if in_slot else None
            if last is None or s.now >= last.next_attempt_at:
                # After a drain (break before make) the new generation still changes this
                # slot: the other slots wait until it serves.
                after = last.id if last is not None and last.state == STOPPED else ""
                roll.busy = roll.busy or bool(after)
                actions.append(Record(roll.new(s, spec, digest, slot, count, last, after)))
            continue
        for replica in live:
            if replica.state == PLACING:
                placing.append(replica)
            elif replica.state == SERVING:
                actions += _serving(s, spec, replica, digest, in_slot, roll)
            elif replica.state == DRAINING:
                actions += _draining(s, replica)
            else:
                actions += _starting(s, replica)
    if placing:
        actions += _place(s, spec, placing, roll)
    return actions


def _changing(replica: Replica) -> bool:
    """A replica in the middle of a slot's change: a successor on its way, or a drain."""
    return replica.state == DRAINING or (
        bool(replica.replaces) and replica.state in (PLACING, STARTING, WARMING))


@dataclass
class _Roll:
    """What one decision has done to one model so far: generations handed out, and whether
    a slot is already changing (then the others wait their turn)."""

    next_generation: int
    busy: bool

    def new(self, s: Snapshot, spec: ModelSpec, digest: str, slot: int, count: int,
            last: Replica | None, replaces: str = "") -> Replica:
        generation = self.next_generation
        self.next_generation += 1
        failures = last.failures if last and (last.replaces == replaces or not replaces) else 0
        return Replica(replica_id(spec.id, generation), spec.id, generation, PLACING, s.now,
                       digest, s.rebalance_epoch, failures, slot=slot,
                       model_replicas=0 if spec.replicas_are_auto and count == 1 and slot == 0
                       and not replaces else count, replaces=replaces)


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


def held_memory(s: Snapshot, leave_out: str = "") -> dict[str, int]:
    """Bytes per node that running replicas hold (but `leave_out`'s)."""
    return held_bytes((st.node, st.memory_bytes) for r in s.replicas.values()
                      if r.state in RUNNING_STATES and r.id != leave_out for st in r.stages)


def _place(s: Snapshot, spec: ModelSpec, placing: list[Replica], roll: _Roll) -> list[Action]:
    """Place the model's replicas that are placing, together, beside what running replicas
    hold; as many as fit, in slot order. A successor that finds no room after all (the fleet
    changed since it was made) has its predecessor drained first: break before make."""
    assert s.desired is not None
    shape = s.shapes.get(spec.id)
    if not isinstance(shape, ModelShape):
        return _wait(placing, f"cannot read the checkpoint's shape: {shape}")
    measuring = sorted({m.node for m, _ in candidates(spec, s.desired, s.members)}
                       & s.measured.pending)
    if measuring:
        return _wait(placing, f"measuring {', '.join(measuring)} (calibration, link probes)")
    placing = sorted(placing, key=lambda r: (r.slot, r.generation))
    counting = spec.replicas_are_auto and placing[0].model_replicas == 0
    held = held_memory(s)
    plan = None
    for k in range(len(placing), 0, -1):
        plan = plan_replicas(spec, shape, s.desired, s.members, s.measured,
                             AUTO_REPLICAS if counting else k, held)
        if plan.placements:
            break
    assert plan is not None
    actions: list[Action] = []
    if not plan.placements:
        actions += _wait(placing, plan.error)
        for r in placing:
            old = s.replicas.get(r.replaces)
            if old is not None and old.state == SERVING:
                actions += _drain(s, old, f"{old.reason or 'replaced'}; no room for "
                                  f"{r.id} beside it ({plan.error})")
        return actions
    chosen = list(zip(placing, plan.placements))
    if counting:  # `replicas: auto` counted now: the other slots start beside the first
        n = len(plan.placements)
        chosen = [(replace(placing[0], model_replicas=n), plan.placements[0])] + [
            (roll.new(s, spec, placing[0].spec_digest, slot, n, None), p)
            for slot, p in enumerate(plan.placements[1:], start=1)]
    started: list[Replica] = []
    for replica, placement in chosen:
        replica = replace(replica, spec_digest=spec_digest(spec))
        stages = assign_ports(replica.id, placement, s, started)
        if isinstance(stages, str):
            actions += _fail(s, replica, stages)
            continue
        records, master_port = stages
        starting = _to(replica, STARTING, s.now, "", note=plan.note, why=placement.why,
                       stages=records, master_port=master_port, started_at=s.now,
                       prompt_cache_slots=placement.prompt_cache_slots,
                       kv_pages=placement.kv_pages,
                       placement_id=placement_id([r.layer_range for r in records],
                                                 [r.backend for r in records]))
        started.append(starting)
        actions.append(StartStages(starting, placement))
    return actions + _wait(placing[len(chosen):], plan.error or
                           "waiting for room: the other replicas took what fits")


def _wait(replicas: list[Replica], reason: str) -> list[Action]:
    """Record why these replicas are still placing (only when the reason is new: no churn)."""
    return [Record(replace(r, reason=reason)) for r in replicas if r.reason != reason]


def assign_ports(replica_id_: str, placement: Placement, s: Snapshot,
                 starting: Sequence[Replica] = ()) -> tuple[tuple[StageRecord, ...], int] | str:
    """Each stage's host and ports (rank 0 also its API and its control port), or why not.

    A port is free on a host when no running replica uses it there and it was not found
    busy. The search goes round the range from just after the ports of the replica started
    last, so a port given up a moment ago is the last to be handed out again. `starting`:
    replicas given ports earlier in the same decision."""
    first, last = s.engine_ports
    used: dict[str, set[int]] = {}
    for r in (*s.replicas.values(), *starting):
        if r.state in RUNNING_STATES:
            for st in r.stages:
                used.setdefault(st.host, set()).update(st.ports())
                if st.rank == 0:
                    used[st.host].add(r.master_port)
    for host, port in s.busy_ports:
        used.setdefault(host, set()).add(port)
    latest = max((r for r in (*s.replicas.values(), *starting) if r.stages),
                  key=lambda r: r.since, default=None)
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
                                   f"{replica_id_}-r{stage.rank}", host, listen, http,
                                   stage.memory.total_bytes, stage.prompt_cache_slot_bytes,
                                   stage.prompt_cache_budget_bytes))
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


def _silent_rank0(s: Snapshot, replica: Replica) -> str | None:
    """Why a serving replica's rank 0 counts as frozen, or None. Its process runs (its agent
    reports it) but its /health went unanswered for the dead-ring time since its last
    answer: counted as the ring counts it (dead once silent that long), when a ring's
    followers leave and fail it; a one-stage replica has none to. Only asked of a serving
    replica: one still starting may not listen yet, and a draining one's 503 "draining" is
    an answer.

    And only once its node's agent was heard from while rank 0 was silent (a heartbeat
    between two unanswered probes): a supervisor cut off from the network for longer than
    the dead-ring time (and shorter than membership's suspect time) fails no replica for it."""
    heard = s.rank0_heard.get(replica.id, Rank0Heard(s.now))
    if heard.silent_s < s.policy.rank0_silence_s or not heard.node_heard_meanwhile:
        return None
    return (f"rank 0 has not answered /health for {heard.silent_s:.1f} s (frozen? the "
            f"ring's dead-ring time is {s.policy.rank0_silence_s:g} s)")


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


def _starting(s: Snapshot, replica: Replica) -> list[Action]:
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
        load_s = s.now - replica.started_at if replica.started_at else 0.0
        return [Record(_to(replica, SERVING, s.now, "", failures=0, load_s=load_s))]
    return []


def _serving(s: Snapshot, spec: ModelSpec, replica: Replica, digest: str,
             in_slot: list[Replica], roll: _Roll) -> list[Action]:
    """A serving replica stays, fails, or is replaced: make before break when the fleet has
    room for its successor beside it (the successor starts and warms while it serves, and
    it drains once the successor serves), break before make when not. One slot of a model
    changes at a time."""
    lost = _lost_stage(s, replica) or _silent_rank0(s, replica)
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
    successor = next((r for r in in_slot if r.replaces == replica.id
                      and r.state in LIVE_STATES), None)
    if successor is not None:
        if successor.state != SERVING:
            return []
        roll.busy = True  # this slot changes until the drain ends
        return _drain(s, replica, f"{why}; {successor.id} serves in its place")
    last = in_slot[-1]
    if last.replaces == replica.id and s.now < last.next_attempt_at:
        return []  # its successor failed: the next one after the backoff
    if roll.busy:
        return []  # another replica of the model is changing: this one's turn comes next
    roll.busy = True
    room = _room_beside(s, spec, replica, why)
    if room:
        return _drain(s, replica, f"{why} (no room for its successor beside it: {room}; "
                      "serving by this replica stops until the new one serves)")
    return [Record(roll.new(s, spec, digest, replica.slot, replica.model_replicas or 1,
                            last if last.replaces == replica.id else None,
                            replaces=replica.id))]


def _room_beside(s: Snapshot, spec: ModelSpec, replica: Replica, why: str) -> str:
    """Why a successor cannot start beside `replica` ("" when it can). A rebalance moves
    only to the placement it found best; a drain or a new spec takes any that fits now."""
    assert s.desired is not None
    shape = s.shapes.get(spec.id)
    if not isinstance(shape, ModelShape):
        return f"cannot read the checkpoint's shape: {shape}"
    beside = plan_model(spec, shape, s.desired, s.members, s.measured,
                        held_memory(s))
    if beside.placement is None:
        return beside.error
    if why.startswith(REBALANCE):
        best = plan_model(spec, shape, s.desired, s.members, s.measured,
                          held_memory(s, leave_out=replica.id))
        if best.placement is not None and not same_layout(
                best.placement, tuple((st.node, st.backend, st.layer_range)
                                      for st in beside.placement.stages)):
            return ("the rebalanced placement " + " -> ".join(best.placement.ring)
                    + " needs memory the replica holds")
    return ""


def _drain(s: Snapshot, replica: Replica, reason: str) -> list[Action]:
    draining = _to(replica, DRAINING, s.now, reason, next_attempt_at=s.now)
    return [Record(draining), StopEngines(draining, s.policy.drain_s, reason)]


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
            plan = plan_model(spec, shape, s.desired, s.members, s.measured,
                              held_memory(s, leave_out=replica.id))
            if plan.placement is not None and not same_layout(plan.placement, replica.layout()):
                return REBALANCE + " -> ".join(plan.placement.ring)
    return None


def _draining(s: Snapshot, replica: Replica) -> list[Action]:
    policy = s.policy
    states = _engine_states(s, replica)
    gone = all(st in ("exited", "unknown") for st in states)
    if gone or s.now - replica.since > policy.drain_s + policy.drain_grace_s:
        return [Record(_to(replica, STOPPED, s.now, replica.reason, next_attempt_at=s.now))]
    return []


def _retire(s: Snapshot, replica: Replica, reason: str) -> list[Action]:
    if replica.state == DRAINING:
        return _draining(s, replica)
    if replica.state == PLACING or not replica.stages:
        return [Record(_to(replica, STOPPED, s.now, reason, next_attempt_at=s.now))]
    return _drain(s, replica, reason)


# --- what a change would stop, said before it is made -------------------------------------

@dataclass(frozen=True)
class Outage:
    """A model whose serving would stop: its last serving replica drains with no successor
    beside it (no room), so nothing serves until the new one does."""

    model_id: str
    replica: str
    reason: str
    drain_s: float  # in-flight requests get at most this long
    start_timeout_s: float  # the new replica serves within this, or fails
    last_load_s: float  # how long the model's last start took (0: never measured)

    @property
    def max_s(self) -> float:
        return self.drain_s + self.start_timeout_s

    def text(self) -> str:
        last = f"; the last start took {self.last_load_s:.0f} s" if self.last_load_s else ""
        return (f"serving of {self.model_id} will stop: {self.replica} drains before its "
                f"successor starts ({self.reason}); for at most {self.max_s:g} s (drain up to "
                f"{self.drain_s:g} s, then start up to {self.start_timeout_s:g} s){last}")


def outages(s: Snapshot) -> list[Outage]:
    """What `decide` would stop serving in the snapshot `s` (a change not yet made: a new
    fleet.yaml, a cordoned node, a rebalance). Pure: the same decision, looked at before."""
    actions = decide(s)
    drained = {a.replica.id: a.replica.reason for a in actions if isinstance(a, Record)
               and a.replica.state == DRAINING
               and (old := s.replicas.get(a.replica.id)) is not None and old.state == SERVING}
    out = []
    for replica_id_, reason in sorted(drained.items()):
        replica = s.replicas[replica_id_]
        if reason.startswith("model removed"):
            continue
        serving = [r for r in s.replicas.values() if r.model_id == replica.model_id
                   and r.state == SERVING and r.id not in drained]
        if serving:
            continue
        last_load_s = max((r.load_s for r in s.replicas.values()
                           if r.model_id == replica.model_id), default=0.0)
        out.append(Outage(replica.model_id, replica.id, reason, s.policy.drain_s,
                          s.policy.start_timeout_s, last_load_s))
    return out

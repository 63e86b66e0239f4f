"""What the supervisor shows, read from its state: apart from the loop, as it decides nothing.

fleetctl's status (with each replica's speed and drain), the front door's route table and
the in-process router over it, and the replicas whose rank 0 metrics the speed watch reads."""

from __future__ import annotations

import time
from typing import Any

from engine.kv_pages import PAGE_POSITIONS
from supervisor import lifecycle as lc
from supervisor.control_loop import Supervisor
from supervisor.front_door import Route
from supervisor.hops import reported_hops
from supervisor.membership import ALIVE, engine_states, shown_state
from supervisor.memory import ModelShape
from supervisor.replica_secrets import API_SECRET
from supervisor.route_table import ModelRoutes, ReplicaRoute, RouteTable
from supervisor.speed import predict, speed_report

STATUS_HISTORY = 3  # generations per model that `status` shows


def status(supervisor: Supervisor) -> dict[str, Any]:
    """`fleetctl status`: members with their facts, replicas with placement, health, speed
    and drain, the applied file, the measurements and the latest events."""
    now = time.time()
    members = []
    holding = {s.node for r in supervisor.replicas.values() if r.state in lc.LIVE_STATES
               for s in r.stages}
    for m in sorted(supervisor.members.values(), key=lambda m: m.node):
        host = (m.facts or {}).get("host", {})
        members.append({
            "node": m.node, "state": shown_state(m, m.node in holding),
            "membership_state": m.state, "cordoned": m.cordoned, "url": m.url,
            "seen_s_ago": round(now - m.last_heartbeat_at, 1), "reason": m.reason,
            "platform": host.get("platform"), "arch": host.get("arch"),
            "ram_total_bytes": host.get("ram_total_bytes"),
            "backends": list(m.present_backends()),
            "engines": engine_states(m)})
    latest = lc.latest_by_model(supervisor.replicas)
    # Every live replica, and the last few ended ones: how the current one came to be.
    shown = sorted((r for r in supervisor.replicas.values() if r.state in lc.LIVE_STATES
                    or r.generation > latest[r.model_id].generation - STATUS_HISTORY),
                   key=lambda r: (r.model_id, r.generation))
    health = supervisor.rank0_health
    replicas = [dict(r.to_dict(), stages=stage_memory(supervisor, r),
                     healthy=r.id in supervisor.healthy,
                     speed=speed(supervisor, r), hops=reported_hops(health.get(r.id)),
                     prompt_cache=reported_prompt_cache(health.get(r.id)),
                     kv_pool=kv_pool(r))
                | drain_view(supervisor, r) for r in shown]
    stored = supervisor.state.desired()
    desired = supervisor.desired
    return {"members": members, "replicas": replicas,
            "models": [m.id for m in desired.models] if desired else [],
            "desired": {"source": stored.source, "applied_at": stored.applied_at}
            if stored else None,
            "front_door": supervisor.settings.front_door_url,
            "measured": supervisor.measurer.to_dict(),
            "events": supervisor.state.events(limit=15)}


def stage_memory(supervisor: Supervisor, replica: lc.Replica) -> list[dict[str, Any]]:
    """The replica's stages, each with its engine's resident set and weights' bytes as its
    agent last reported them (None where not reported, or its node's reports are not
    current: only an alive member's are)."""
    stages = []
    for stage in replica.stages:
        member = supervisor.members.get(stage.node)
        engine = member.engines.get(stage.engine_id) \
            if member is not None and member.state == ALIVE else None
        stages.append(stage.to_dict() | {
            "resident_bytes": engine.resident_bytes if engine else None,
            "weights_bytes": engine.weights_bytes if engine else None})
    return stages


def speed(supervisor: Supervisor, replica: lc.Replica) -> dict[str, Any] | None:
    """A live replica's predicted and measured decode ms per token (supervisor/speed.py)."""
    desired = supervisor.desired
    if replica.state not in lc.LIVE_STATES or not replica.stages or desired is None:
        return None
    spec, shape = desired.model(replica.model_id), supervisor.shapes.get(replica.model_id)
    predicted = (predict(spec, shape, desired, supervisor.members,
                         supervisor.measurer.snapshot(), replica.layout())
                 if spec is not None and isinstance(shape, ModelShape) else None)
    return speed_report(predicted, supervisor.speeds.rounds.get(replica.id, {}))


def speed_targets(supervisor: Supervisor) -> list[tuple[str, str, str]]:
    """Replicas whose rank 0 metrics `SpeedWatch` reads: (id, URL, API secret)."""
    return [(r.id, r.url, supervisor.secrets.read(r.id, API_SECRET) or "")
            for r in supervisor.replicas.values() if r.state in (lc.WARMING, lc.SERVING)]


def rank0_draining(supervisor: Supervisor, replica_id: str) -> dict[str, Any] | None:
    """Rank 0's drain as its /health last told it (in flight, seconds left), or None."""
    body = supervisor.rank0_health.get(replica_id)
    return body if body is not None and body.get("status") == "draining" else None


def drain_view(supervisor: Supervisor, replica: lc.Replica) -> dict[str, Any]:
    """A replica whose rank 0 says it drains (a SIGTERM from outside the supervisor, or
    the drain the supervisor asked) is shown draining, with its numbers."""
    body = (rank0_draining(supervisor, replica.id) if replica.state in lc.LIVE_STATES
            else None)
    if body is None:
        return {}
    return {"state": lc.DRAINING, "lifecycle_state": replica.state,
            "drain": {"in_flight": body.get("in_flight"),
                      "seconds_left": body.get("drain_seconds_left")}}


def kv_pool(replica: lc.Replica) -> dict[str, int] | None:
    """Every stage's pool of KV pages as placement charged it; None: a whole context a slot."""
    if not replica.kv_pages:
        return None
    return {"pages": replica.kv_pages, "positions": replica.kv_pages * PAGE_POSITIONS}


def reported_prompt_cache(health: dict[str, Any] | None) -> dict[str, Any] | None:
    """The prompt cache's figures rank 0's /health gives (engine.api.metrics), or None."""
    figures = (health or {}).get("prompt_cache")
    return figures if isinstance(figures, dict) else None


# --- the front door's view ----------------------------------------------------------------
def route_table(supervisor: Supervisor) -> RouteTable:
    """What a front door routes by (supervisor/route_table.py), from this moment's
    replicas, rank 0 health and secrets: the in-process front door reads it per request,
    a front door of its own process polls it (`GET /v1/routes`)."""
    replicas, secrets = supervisor.replicas, supervisor.secrets
    models = []
    for spec in supervisor.desired.models if supervisor.desired else ():
        serving = [r for r in replicas.values()
                   if r.model_id == spec.id and r.state == lc.SERVING]
        taking = [r for r in serving if rank0_draining(supervisor, r.id) is None]
        why = ""
        if not serving:
            replica = lc.latest_by_model(replicas).get(spec.id)
            state = replica.state if replica else "not placed"
            why = f"model {spec.id!r} has no serving replica now ({state}); retry shortly"
        elif not taking:  # they would refuse: say why here
            why = (f"model {spec.id!r}: replica {', '.join(r.id for r in serving)} is "
                   "draining and takes no new requests; retry shortly")
        models.append(ModelRoutes(spec.id, spec.parallel, bool(serving), tuple(
            ReplicaRoute(r.id, r.url, secrets.read(r.id, API_SECRET) or "", int(
                (supervisor.rank0_health.get(r.id) or {}).get("slots_in_use") or 0))
            for r in sorted(taking, key=lambda r: r.id)), why))
    failed = tuple((r.id, r.reason or "the replica failed")
                   for r in replicas.values() if r.state == lc.FAILED)
    return RouteTable(tuple(models), frozenset(supervisor.settings.api_keys), failed)


def route(supervisor: Supervisor, model: str | None, conversation: str | None = None) -> Route:
    """The in-process front door's router. Its one write, the round-robin turn, is the
    supervisor's, so that every request of this process takes the next turn."""
    supervisor.route_turn += 1
    return route_table(supervisor).route(model, supervisor.relays, supervisor.route_turn,
                                         conversation)


def models(supervisor: Supervisor) -> list[dict[str, Any]]:
    """The in-process front door's `/v1/models` entries."""
    return route_table(supervisor).model_entries()

"""Orphaned engines: running engines that no live replica of this supervisor's state owns. Pure.

An engine is an orphan when its agent reports it starting or ready and the supervisor's state
says its replica has ended (stopped or failed), does not know its replica at all, or knows
the replica but not that engine among its stages. That happens when a superseded supervisor
(a second one on the same state, before the lock) wrote a newer generation, when a drain was
never delivered (the agent was unreachable then), or when the state was restored from an
older copy. Such an engine holds memory and ports that placement believes free, and nothing
routes to it: its agent is asked to drain it. An engine already draining or exited is left
to its agent.

Only alive members are looked at: a suspect member's reports are stale, and its engines
are decided on once it beats again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from supervisor.lifecycle import LIVE_STATES, Replica
from supervisor.membership import ALIVE, Member

RUNNING_ENGINE_STATES = ("starting", "ready")
# A replica that ended this recently is still being stopped by the lifecycle's own drain
# (StopEngines): its engines are not orphans yet, only once that drain did not take.
ENDED_GRACE_S = 10.0


@dataclass(frozen=True)
class DrainOrphan:
    """Ask `node`'s agent to drain `engine_id`, for `reason`."""

    node: str
    engine_id: str
    reason: str


def orphaned_engines(members: Mapping[str, Member], replicas: Mapping[str, Replica],
                     now: float, ended_grace_s: float = ENDED_GRACE_S) -> list[DrainOrphan]:
    """The engines to drain now, each with why, in node then engine order."""
    out: list[DrainOrphan] = []
    for node in sorted(members):
        member = members[node]
        if member.state != ALIVE:
            continue
        for engine_id in sorted(member.engines):
            engine = member.engines[engine_id]
            if engine.state not in RUNNING_ENGINE_STATES:
                continue
            why = _orphan_reason(node, engine_id, engine.replica, replicas,
                                 now - ended_grace_s)
            if why:
                out.append(DrainOrphan(node, engine_id, why))
    return out


def _orphan_reason(node: str, engine_id: str, replica_id: str,
                   replicas: Mapping[str, Replica], ended_before: float) -> str | None:
    """Why the engine is an orphan, or None when a live replica has it as a stage on `node`.
    Ownership goes by the replicas' stages, not the reported replica (an agent's first event
    about an engine may not name it)."""
    owner = next((r for r in replicas.values() for st in r.stages
                  if st.engine_id == engine_id and st.node == node), None)
    if owner is not None:
        if owner.state in LIVE_STATES or owner.since > ended_before:
            return None
        return f"orphaned engine {engine_id}: its replica {owner.id} is {owner.state}"
    named = replicas.get(replica_id) if replica_id else None
    if named is not None:
        return f"orphaned engine {engine_id}: replica {replica_id} has no such stage on {node}"
    return (f"orphaned engine {engine_id}: no replica of this supervisor runs it"
            + (f" (it names replica {replica_id})" if replica_id else ""))

"""Agents' reports taken in per request: apart from the loop, which only decides over them.

A heartbeat, an engine event or a goodbye changes a member (through membership's pure
rules) and, for engine events, steps the loop at once; nothing here decides placement."""

from __future__ import annotations

import time
from typing import Any

import structlog

from agent.pki import Identity
from supervisor import lifecycle as lc
from supervisor.control_loop import Supervisor
from supervisor.issuing import check_pin
from supervisor.membership import on_events, on_goodbye, on_heartbeat
from supervisor.request_error import RequestError

log = structlog.get_logger()


def refuse_agent(supervisor: Supervisor, who: Identity) -> str | None:
    """Why an agent certificate may not speak for its node (None: it may)."""
    state = supervisor.state
    verdict = check_pin(who.node, who.fingerprint, state.pin(who.node),
                        state.is_revoked(who.fingerprint), who.node in supervisor.members)
    if verdict.pin_now:
        state.put_pin(who.node, who.fingerprint)
        supervisor.event("pin", f"{who.node}: certificate {who.fingerprint[:16]}… pinned at "
                         "its first call (it joined before certificates were pinned)",
                         node=who.node)
    return None if verdict.allowed else verdict.reason


def refuse_foreign(supervisor: Supervisor, node: str, engine_ids: list[str]) -> None:
    """An agent reports the engines it runs, never another node's (a forged "rank 0
    exited" would fail a serving replica)."""
    foreign = lc.foreign_engines(node, engine_ids, supervisor.replicas)
    if foreign:
        engine_id, owner = next(iter(foreign.items()))
        raise RequestError(403, f"node {node!r} may not report engine {engine_id!r}: it "
                           f"runs on node {owner!r}", field="engine_id")


def heartbeat(supervisor: Supervisor, node: str, beat: dict[str, Any]) -> dict[str, Any]:
    """Take one heartbeat; the reply says whether the agent should send its facts."""
    refuse_foreign(supervisor, node, [str(v.get("engine_id")) for v in beat.get("engines", ())
                                      if isinstance(v, dict)])
    result = on_heartbeat(supervisor.members.get(node), dict(beat, node=node), time.time())
    if result.changed:
        supervisor.event("member", f"{node} {result.changed} ({result.member.url})", node=node)
    supervisor.put_member(result.member)
    return {"want_facts": result.want_facts}


def engine_events(supervisor: Supervisor, node: str, events: list[dict[str, Any]]) -> None:
    """Take the engine state changes an agent pushes, and act on them at once."""
    refuse_foreign(supervisor, node, [str(e.get("engine_id")) for e in events
                                      if isinstance(e, dict)])
    member = supervisor.members.get(node)
    if member is None:
        return
    for e in events:
        log.info("engine event", node=node, engine=e.get("engine_id"), state=e.get("state"))
    supervisor.put_member(on_events(member, events))
    supervisor.step()  # a lost stage fails its replica now, not at the next tick


def goodbye(supervisor: Supervisor, node: str, reason: str) -> None:
    """A graceful goodbye: the member is `left` at once."""
    member = supervisor.members.get(node)
    if member is not None:
        supervisor.put_member(on_goodbye(member, reason))
        supervisor.event("member", f"{node} left: {reason}", node=node)

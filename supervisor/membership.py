"""Membership: alive → suspect → dead from missed heartbeats, left on a goodbye. Pure.

A member also turns suspect as soon as its heartbeats are late for its own pace (no beat
for `late_beats` of the intervals it has been beating at), or when the supervisor cannot
reach its agent: a suspect member gets no placement and its engines' states are unknown
until it beats again. Dead still takes `dead_after_s`: its engines may be serving.

A member is a frozen record of what the supervisor last heard from one agent: its URL, its
facts, its engines' states, and when it last beat. The service feeds heartbeats, events and
goodbyes through the functions here and calls `tick` on a timer; each returns new records,
so the tests drive a clock by hand and the loop only stores what comes back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

ALIVE, SUSPECT, DEAD, LEFT = "alive", "suspect", "dead", "left"
STATES = (ALIVE, SUSPECT, DEAD, LEFT)


@dataclass(frozen=True)
class MembershipTimes:
    """How long without a heartbeat makes a member suspect, then dead (seconds)."""

    suspect_after_s: float = 15.0
    dead_after_s: float = 45.0
    late_beats: float = 2.5  # this many of its own intervals without a beat: suspect
    late_floor_s: float = 2.0  # never sooner than this (a busy supervisor reads beats late)

    def late_after_s(self, beat_interval_s: float) -> float:
        """Silence that makes a member with this heartbeat pace suspect."""
        if beat_interval_s <= 0:  # not known yet (one beat so far)
            return self.suspect_after_s
        return min(self.suspect_after_s,
                   max(self.late_floor_s, self.late_beats * beat_interval_s))

    def __post_init__(self) -> None:
        if not 0 < self.suspect_after_s < self.dead_after_s:
            raise ValueError(f"need 0 < suspect_after_s ({self.suspect_after_s}) < "
                             f"dead_after_s ({self.dead_after_s})")


@dataclass(frozen=True)
class ReportedEngine:
    """One engine as its agent last reported it."""

    engine_id: str
    replica: str
    rank: int
    state: str  # starting, ready, draining, exited
    exit: Mapping[str, Any] | None = None
    weights_bytes: int | None = None  # its weights, as the engine said once it loaded
    resident_bytes: int | None = None  # its resident set at the agent's last heartbeat

    @classmethod
    def from_view(cls, view: Mapping[str, Any]) -> ReportedEngine:
        return cls(str(view["engine_id"]), str(view.get("replica", "")),
                   int(view.get("rank", 0)), str(view["state"]), view.get("exit"),
                   _count(view.get("weights_bytes")), _count(view.get("resident_bytes")))


def _count(value: Any) -> int | None:
    """A byte count from an agent's report (anything else: not known)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class Member:
    node: str
    url: str  # the agent's API
    state: str
    last_heartbeat_at: float
    joined_at: float
    facts: Mapping[str, Any] | None = None
    facts_digest: str | None = None
    engines: Mapping[str, ReportedEngine] = field(default_factory=dict)
    cordoned: bool = False  # `fleetctl drain NODE`: nothing new is placed here
    reason: str = ""  # why the state is what it is
    beat_interval_s: float = 0.0  # the pace its heartbeats arrive at (0: not known yet)

    @property
    def host(self) -> str:
        """The node's address, as its agent advertises itself (its URL's host, bare)."""
        return urlsplit(self.url).hostname or ""

    @property
    def placeable(self) -> bool:
        return self.state == ALIVE and not self.cordoned and self.facts is not None

    def present_backends(self) -> tuple[str, ...]:
        backends = (self.facts or {}).get("backends", ())
        return tuple(b["backend"] for b in backends if b.get("present"))

    def usable_memory_bytes(self, backend: str) -> int:
        for b in (self.facts or {}).get("backends", ()):
            if b.get("backend") == backend and b.get("devices"):
                return max(int(d.get("memory_usable_bytes", 0)) for d in b["devices"])
        return 0

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "url": self.url, "state": self.state,
                "last_heartbeat_at": self.last_heartbeat_at, "joined_at": self.joined_at,
                "facts": self.facts, "facts_digest": self.facts_digest,
                "engines": {k: vars(v) | {"exit": v.exit} for k, v in self.engines.items()},
                "cordoned": self.cordoned, "reason": self.reason,
                "beat_interval_s": self.beat_interval_s}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Member:
        engines = {k: ReportedEngine(**v) for k, v in (raw.get("engines") or {}).items()}
        return cls(raw["node"], raw["url"], raw["state"], float(raw["last_heartbeat_at"]),
                   float(raw["joined_at"]), raw.get("facts"), raw.get("facts_digest"), engines,
                   bool(raw.get("cordoned", False)), raw.get("reason", ""),
                   float(raw.get("beat_interval_s", 0.0)))


@dataclass(frozen=True)
class BeatResult:
    member: Member
    want_facts: bool  # ask the agent to send its facts with the next beat
    changed: str | None  # "joined", "back" (from suspect / dead / left), or None


def on_heartbeat(old: Member | None, beat: Mapping[str, Any], now: float) -> BeatResult:
    """A heartbeat from `beat["node"]`: the member is alive, with the engines it reports."""
    engines = {v["engine_id"]: ReportedEngine.from_view(v) for v in beat.get("engines", ())}
    facts = beat.get("facts")
    digest = beat.get("facts_digest")
    if old is None:
        member = Member(str(beat["node"]), str(beat["url"]), ALIVE, now, now, facts, digest,
                        engines)
        return BeatResult(member, facts is None, "joined")
    if facts is None and digest == old.facts_digest:
        facts = old.facts
    interval = old.beat_interval_s
    if old.state == ALIVE:  # a gap between two beats heard in a row is the agent's pace
        gap = max(0.0, now - old.last_heartbeat_at)
        interval = gap if interval <= 0 else 0.5 * interval + 0.5 * gap
    member = replace(old, url=str(beat.get("url") or old.url), state=ALIVE,
                     last_heartbeat_at=now, facts=facts, facts_digest=digest,
                     engines=engines, reason="", beat_interval_s=interval)
    return BeatResult(member, facts is None, None if old.state == ALIVE else "back")


def on_events(old: Member, events: list[Mapping[str, Any]]) -> Member:
    """Engine state changes pushed by the agent at once (ahead of the next heartbeat)."""
    engines = dict(old.engines)
    for event in events:
        engine_id = str(event["engine_id"])
        detail = event.get("detail") or {}
        prior = engines.get(engine_id)
        engines[engine_id] = ReportedEngine(
            engine_id, str(detail.get("replica") or (prior.replica if prior else "")),
            int(detail.get("rank", prior.rank if prior else 0)), str(event["state"]),
            detail.get("exit") or (detail if event["state"] == "exited" else None),
            prior.weights_bytes if prior else None,  # events carry no memory: the last beat's
            prior.resident_bytes if prior else None)
    return replace(old, engines=engines)


def on_goodbye(old: Member, reason: str) -> Member:
    return replace(old, state=LEFT, reason=reason or "said goodbye")


def engine_states(member: Member) -> dict[str, str]:
    """Each engine's state as far as it is known: only an alive member's reports are
    current; a suspect, dead or departed member's engines may run or not ("unknown")."""
    return {k: v.state if member.state == ALIVE else "unknown"
            for k, v in member.engines.items()}


def on_unreachable(old: Member, reason: str) -> Member:
    """The supervisor could not reach the agent's API: stop placing there until it beats."""
    if old.state != ALIVE:
        return old
    return replace(old, state=SUSPECT, reason=reason)


def tick(members: Mapping[str, Member], now: float,
         times: MembershipTimes) -> dict[str, Member]:
    """Members whose state changes because heartbeats stopped (only those)."""
    out: dict[str, Member] = {}
    for name, member in members.items():
        if member.state in (LEFT, DEAD):
            continue
        silent_s = now - member.last_heartbeat_at
        if silent_s >= times.dead_after_s:
            out[name] = replace(member, state=DEAD,
                                reason=f"no heartbeat for {silent_s:.1f} s")
        elif silent_s >= times.suspect_after_s and member.state == ALIVE:
            out[name] = replace(member, state=SUSPECT,
                                reason=f"no heartbeat for {silent_s:.1f} s")
        elif (member.state == ALIVE
              and silent_s >= times.late_after_s(member.beat_interval_s)):
            out[name] = replace(member, state=SUSPECT, reason=(
                f"heartbeats late: none for {silent_s:.1f} s (it beats every "
                f"{member.beat_interval_s:.1f} s)"))
    return out


DRAINING, CORDONED = "draining", "cordoned"  # shown states of an alive, cordoned member


def shown_state(member: Member, holds_stages: bool) -> str:
    """What `status` calls a member: an alive one that is cordoned is `draining` while a
    live replica still has a stage on it, then `cordoned`; any other, its membership state."""
    if member.state != ALIVE or not member.cordoned:
        return member.state
    return DRAINING if holds_stages else CORDONED

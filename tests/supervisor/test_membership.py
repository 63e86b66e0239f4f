"""Membership decisions with a hand-driven clock: alive → suspect → dead, left, back."""

from __future__ import annotations

from dataclasses import replace

import pytest

from supervisor.membership import (
    ALIVE,
    DEAD,
    LEFT,
    SUSPECT,
    MembershipTimes,
    on_events,
    on_goodbye,
    on_heartbeat,
    on_unreachable,
    shown_state,
    tick,
)

TIMES = MembershipTimes(suspect_after_s=3.0, dead_after_s=9.0)
FACTS = {"host": {"platform": "linux"},
         "backends": [{"backend": "torch-cpu", "present": True,
                       "devices": [{"memory_usable_bytes": 8 << 30}]},
                      {"backend": "mlx-cpu", "present": False, "devices": []}]}


def beat(**extra):
    return {"node": "a", "url": "https://127.0.0.1:7700", "facts_digest": "d1",
            "engines": [], **extra}


def test_first_beat_joins_and_asks_for_facts_until_it_has_them():
    first = on_heartbeat(None, beat(), now=100.0)
    assert first.changed == "joined" and first.member.state == ALIVE and first.want_facts
    second = on_heartbeat(first.member, beat(facts=FACTS), now=101.0)
    assert not second.want_facts and second.changed is None
    third = on_heartbeat(second.member, beat(), now=102.0)  # same digest: facts are kept
    assert third.member.facts == FACTS and not third.want_facts
    assert third.member.present_backends() == ("torch-cpu",)
    assert third.member.usable_memory_bytes("torch-cpu") == 8 << 30
    changed = on_heartbeat(third.member, beat(facts_digest="d2"), now=103.0)
    assert changed.want_facts  # a new digest without facts: ask for them


def test_silence_makes_suspect_then_dead_and_a_beat_brings_it_back():
    member = on_heartbeat(None, beat(facts=FACTS), now=0.0).member
    assert tick({"a": member}, 2.9, TIMES) == {}
    suspect = tick({"a": member}, 3.0, TIMES)["a"]
    assert suspect.state == SUSPECT and "no heartbeat for 3.0 s" in suspect.reason
    assert not suspect.placeable
    assert tick({"a": suspect}, 8.0, TIMES) == {}  # already suspect: no change to report
    dead = tick({"a": suspect}, 9.0, TIMES)["a"]
    assert dead.state == DEAD
    assert tick({"a": dead}, 100.0, TIMES) == {}
    back = on_heartbeat(dead, beat(), now=101.0)
    assert back.changed == "back" and back.member.state == ALIVE and back.member.placeable


def test_a_long_silence_goes_straight_to_dead():
    member = on_heartbeat(None, beat(), now=0.0).member
    assert tick({"a": member}, 50.0, TIMES)["a"].state == DEAD


def test_goodbye_leaves_and_ticks_leave_it_alone():
    member = on_heartbeat(None, beat(facts=FACTS), now=0.0).member
    left = on_goodbye(member, "the agent is stopping")
    assert left.state == LEFT and left.reason == "the agent is stopping"
    assert tick({"a": left}, 1000.0, TIMES) == {}


def test_unreachable_makes_an_alive_member_suspect_only():
    member = on_heartbeat(None, beat(facts=FACTS), now=0.0).member
    assert on_unreachable(member, "connect refused").state == SUSPECT
    left = on_goodbye(member, "bye")
    assert on_unreachable(left, "connect refused") is left


def test_engine_events_update_ahead_of_the_next_beat():
    views = [{"engine_id": "m-g1-r0", "replica": "m-g1", "rank": 0, "state": "starting"}]
    member = on_heartbeat(None, beat(engines=views), now=0.0).member
    ready = on_events(member, [{"engine_id": "m-g1-r0", "state": "ready", "detail": {}}])
    assert ready.engines["m-g1-r0"].state == "ready" and ready.engines["m-g1-r0"].rank == 0
    gone = on_events(ready, [{"engine_id": "m-g1-r0", "state": "exited",
                              "detail": {"code": -9, "reason": "killed by SIGKILL"}}])
    assert gone.engines["m-g1-r0"].exit["reason"] == "killed by SIGKILL"


def test_member_round_trips_through_a_dict():
    member = on_heartbeat(None, beat(facts=FACTS, engines=[
        {"engine_id": "e", "replica": "r", "rank": 1, "state": "ready"}]), now=5.0).member
    from supervisor.membership import Member

    assert Member.from_dict(member.to_dict()) == member


def test_times_must_be_ordered():
    with pytest.raises(ValueError, match="suspect_after_s"):
        MembershipTimes(suspect_after_s=10, dead_after_s=5)


def test_late_heartbeats_make_a_member_suspect_before_the_suspect_time():
    """A node beating every second that falls silent is suspect after 2.5 of its beats
    (2.5 s), long before 15 s: no placement goes there, its engines are unknown."""
    times = MembershipTimes(suspect_after_s=15.0, dead_after_s=45.0)
    views = [{"engine_id": "m-g1-r1", "replica": "m-g1", "rank": 1, "state": "ready"}]
    member = on_heartbeat(None, beat(facts=FACTS, engines=views), now=0.0).member
    for t in (1.0, 2.0, 3.0):
        member = on_heartbeat(member, beat(engines=views), now=t).member
    assert member.beat_interval_s == pytest.approx(1.0)
    from supervisor.membership import engine_states

    assert engine_states(member) == {"m-g1-r1": "ready"}
    assert tick({"a": member}, 3.0 + 2.4, times) == {}
    late = tick({"a": member}, 3.0 + 2.5, times)["a"]
    assert late.state == SUSPECT and "heartbeats late" in late.reason and not late.placeable
    assert engine_states(late) == {"m-g1-r1": "unknown"}
    assert tick({"a": late}, 3.0 + 44.0, times) == {}  # dead still takes dead_after_s
    assert tick({"a": late}, 3.0 + 45.0, times)["a"].state == DEAD
    back = on_heartbeat(late, beat(engines=views), now=10.0)
    assert back.changed == "back" and back.member.placeable
    assert engine_states(back.member) == {"m-g1-r1": "ready"}
    # A slow agent's pace sets its own bound; the suspect time caps it.
    slow = member
    for t in (13.0, 23.0, 33.0, 43.0, 53.0, 63.0):
        slow = on_heartbeat(slow, beat(), now=t).member
    assert times.late_after_s(slow.beat_interval_s) == 15.0
    assert times.late_after_s(0.0) == 15.0 and times.late_after_s(0.1) == 2.0


def test_a_cordoned_member_is_shown_draining_then_cordoned():
    alive = on_heartbeat(None, beat(), 0.0).member
    assert shown_state(alive, holds_stages=True) == ALIVE
    cordoned = replace(alive, cordoned=True)
    assert shown_state(cordoned, holds_stages=True) == "draining"
    assert shown_state(cordoned, holds_stages=False) == "cordoned"
    for state in (SUSPECT, DEAD, LEFT):  # what membership knows comes first
        assert shown_state(replace(cordoned, state=state), holds_stages=True) == state

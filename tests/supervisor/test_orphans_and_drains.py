"""Pure decisions about engines that ended or that nobody owns: a clean exit (a drain
finished) stops a replica without counting a failure; engines no live replica owns are
drained; engines of a member that is not alive are unknown."""

from __future__ import annotations

from dataclasses import replace

from supervisor import lifecycle as lc
from supervisor.membership import SUSPECT, ReportedEngine, engine_states
from supervisor.orphans import DrainOrphan, orphaned_engines
from tests.supervisor.test_lifecycle import both, member, only, snap, started


def with_exit(members, node: str, engine_id: str, exit_: dict):
    m = members[node]
    engines = dict(m.engines)
    engines[engine_id] = replace(engines[engine_id], state="exited", exit=exit_)
    return dict(members, **{node: replace(m, engines=engines)})


def test_a_clean_exit_stops_the_replica_without_counting_a_failure():
    """SIGTERM to rank 0 from outside the supervisor: it drains, exits 0 'drained'; the
    replica is stopped (no failure, no backoff) and the next generation is placed at once."""
    serving = started(lc.SERVING, failures=2)
    members = with_exit(both(("ready", "ready")), "a", "demo-g1-r0",
                        {"code": 0, "reason": "drained"})
    actions = lc.decide(snap([serving], members=members, now=10.0))
    [record], [stop] = only(actions, lc.Record), only(actions, lc.StopEngines)
    assert record.replica.state == lc.STOPPED and record.replica.failures == 2
    assert record.replica.reason == "rank 0 on a ended cleanly (drained)"
    assert record.replica.next_attempt_at == 10.0 and stop.drain_s == 0.0
    [placing] = only(lc.decide(snap([record.replica], members=members, now=10.0)), lc.Record)
    assert placing.replica.state == lc.PLACING and placing.replica.generation == 2


def test_a_nonzero_exit_still_fails_even_beside_a_clean_one():
    serving = started(lc.SERVING)
    members = with_exit(both(("ready", "ready")), "a", "demo-g1-r0",
                        {"code": 0, "reason": "drained"})
    members = with_exit(members, "b", "demo-g1-r1", {"code": 1, "reason": "ring dead"})
    [record] = only(lc.decide(snap([serving], members=members)), lc.Record)
    assert record.replica.state == lc.FAILED and "ring dead" in record.replica.reason
    # A signal with no clean word (code None) is not clean either.
    members = with_exit(both(("ready", "ready")), "b", "demo-g1-r1",
                        {"code": None, "reason": "killed by SIGKILL from outside the agent"})
    [record] = only(lc.decide(snap([serving], members=members)), lc.Record)
    assert record.replica.state == lc.FAILED and record.replica.failures == 1


def engine(engine_id: str, replica: str, state: str = "ready") -> ReportedEngine:
    return ReportedEngine(engine_id, replica, int(engine_id[-1]), state)


def test_engines_no_live_replica_owns_are_orphans():
    live = started(lc.SERVING)
    old = replace(started(lc.FAILED), id="demo-g0",
                  stages=tuple(replace(s, engine_id=s.engine_id.replace("g1", "g0"))
                               for s in live.stages))
    a = replace(member("a"), engines={
        "demo-g1-r0": engine("demo-g1-r0", "demo-g1"),  # live: kept
        "demo-g0-r0": engine("demo-g0-r0", "demo-g0"),  # its replica failed
        "demo-g9-r0": engine("demo-g9-r0", "demo-g9"),  # a replica nobody here knows
        "demo-g1-r5": engine("demo-g1-r5", "demo-g1"),  # a live replica without that stage
        "demo-g0-r1": engine("demo-g0-r1", "demo-g0", "draining"),  # its agent sees to it
    })
    # An agent's first event may not name the replica: the stages say who owns the engine.
    b_ok = replace(member("b"), engines={"demo-g1-r1": engine("demo-g1-r1", "", "starting")})
    assert orphaned_engines({"b": b_ok}, {live.id: live}, now=100.0) == []
    b = replace(member("b", state=SUSPECT), engines={  # stale reports: not decided on
        "demo-g0-r1": engine("demo-g0-r1", "demo-g0")})
    replicas = {r.id: r for r in (live, old)}  # `old` failed at 5.0
    assert [o.engine_id for o in orphaned_engines({"a": a}, replicas, now=14.0)] == [
        "demo-g1-r5", "demo-g9-r0"]  # its own stop has 10 s to take before it is an orphan
    orphans = orphaned_engines({"a": a, "b": b}, replicas, now=15.0)
    assert [(o.node, o.engine_id) for o in orphans] == [
        ("a", "demo-g0-r0"), ("a", "demo-g1-r5"), ("a", "demo-g9-r0")]
    assert orphans[0] == DrainOrphan("a", "demo-g0-r0",
                                     "orphaned engine demo-g0-r0: its replica demo-g0 is failed")
    assert orphans[2].reason == ("orphaned engine demo-g9-r0: no replica of this supervisor "
                                 "runs it (it names replica demo-g9)")
    assert "has no such stage on a" in orphans[1].reason
    assert engine_states(b) == {"demo-g0-r1": "unknown"}
    assert engine_states(a)["demo-g1-r0"] == "ready"

"""Several replicas of one model and make-before-break, decided over frozen snapshots with no
network: slots placed together, a lost replica replaced alone while the others serve, a
change rolling through the replicas one at a time, `replicas: auto`, and the outage forecast
that `fleetctl plan`/`apply`/`drain` print when there is no room."""

from __future__ import annotations

from dataclasses import replace

from supervisor import lifecycle as lc
from supervisor.fleet_config import parse_fleet_config
from tests.supervisor.test_lifecycle import (
    FLEET,
    member,
    only,
    snap,
)

WHOLE_BYTES = 17_842_688  # the demo's 0:8 on one node at parallel 2
AUTO = FLEET.replace("    placement:\n      - {node: a, layers: \"0:4\"}\n"
                     "      - {node: b, layers: \"4:8\"}\n",
                     # no kept slots: the bytes below are the streams' alone
                     "    replicas: %s\n    prompt_cache_slots: 0\n")


def config(replicas="2", parallel=2):
    return parse_fleet_config(AUTO % (parallel, replicas))


def run(replicas, s_kw, rounds=1):
    """decide, applying Records and StartStages to the replicas, `rounds` times."""
    by_id = {r.id: r for r in replicas}
    actions = []
    for _ in range(rounds):
        actions = lc.decide(snap(list(by_id.values()), **s_kw))
        for a in actions:
            if isinstance(a, (lc.Record, lc.StartStages)):
                by_id[a.replica.id] = a.replica
    return by_id, actions


def ready(replicas, memory_bytes=8 << 30, **extra):
    """Members reporting every stage of `replicas` ready."""
    engines = {"a": {}, "b": {}}
    for r in replicas:
        for st in r.stages:
            engines[st.node][st.engine_id] = "ready"
    for node, more in extra.items():
        engines[node].update(more)
    return {n: member(n, engines=e, memory_bytes=memory_bytes) for n, e in engines.items()}


def serving_pair(cfg=None):
    """The replicas (two unless `cfg` says) placed together and serving."""
    cfg = cfg or config()
    by_id, actions = run([], dict(cfg=cfg), rounds=2)
    starts = only(actions, lc.StartStages)
    assert len(starts) == cfg.models[0].replicas
    return {i: replace(r, state=lc.SERVING) for i, r in by_id.items()}


def test_two_replicas_are_placed_together_each_on_its_own_node():
    by_id, actions = run([], dict(cfg=config()))
    assert sorted((r.id, r.slot) for r in by_id.values()) == [("demo-g1", 0), ("demo-g2", 1)]
    by_id, actions = run(list(by_id.values()), dict(cfg=config()))
    starts = only(actions, lc.StartStages)
    assert sorted(s.placement.ring for s in starts) == [("a",), ("b",)]  # no hop: faster
    ports = [p for s in starts for st in s.replica.stages for p in st.ports()]
    assert len(ports) == len(set(ports))  # started in one decision, on distinct ports


def test_a_node_holds_two_replicas_only_when_its_memory_holds_both():
    members = {"a": member("a", memory_bytes=2 * WHOLE_BYTES + 10),
               "b": member("b", state="dead")}
    by_id, actions = run([], dict(cfg=config(), members=members), rounds=2)
    assert [s.placement.ring for s in only(actions, lc.StartStages)] == [("a",), ("a",)]
    members = {"a": member("a", memory_bytes=2 * WHOLE_BYTES - 10),
               "b": member("b", state="dead")}
    by_id, actions = run([], dict(cfg=config(), members=members), rounds=2)
    [start] = only(actions, lc.StartStages)
    assert start.replica.slot == 0
    waiting = [r for r in by_id.values() if r.state == lc.PLACING]
    assert [r.slot for r in waiting] == [1] and "waiting for room" in waiting[0].reason


def test_losing_one_replica_leaves_the_other_serving_and_replaces_it_alone():
    pair = serving_pair()
    one, other = sorted(pair.values(), key=lambda r: r.slot)
    members = ready(pair.values())
    node = one.stages[0].node
    engines = {k: v.state for k, v in members[node].engines.items()}
    members[node] = member(node, engines=dict(engines, **{one.stages[0].engine_id: "exited"}))
    actions = lc.decide(snap(list(pair.values()), members=members, cfg=config()))
    assert [(a.replica.id, a.replica.state) for a in only(actions, lc.Record)] == [
        (one.id, lc.FAILED)]
    failed = only(actions, lc.Record)[0].replica
    later = lc.decide(snap([failed, other], members=members, cfg=config(),
                           now=failed.next_attempt_at))
    [new] = only(later, lc.Record)
    assert new.replica.slot == one.slot and new.replica.state == lc.PLACING
    assert new.replica.generation == 3 and not only(later, lc.StopEngines)


def test_a_change_rolls_through_the_replicas_one_at_a_time():
    pair = serving_pair()
    changed = config(parallel=3)
    members = ready(pair.values())
    actions = lc.decide(snap(list(pair.values()), members=members, cfg=changed))
    [made] = only(actions, lc.Record)
    assert made.replica.replaces == "demo-g1" and not only(actions, lc.StopEngines)
    # while slot 0's successor is on its way, slot 1 waits its turn
    again = lc.decide(snap([*pair.values(), made.replica], members=members, cfg=changed))
    assert [a.replica.id for a in only(again, lc.StartStages)] == [made.replica.id]
    assert not [a for a in only(again, lc.Record) if a.replica.replaces == "demo-g2"]
    successor = replace(only(again, lc.StartStages)[0].replica, state=lc.SERVING)
    members = ready([*pair.values(), successor])
    drained = lc.decide(snap([*pair.values(), successor], members=members, cfg=changed))
    assert [(a.replica.id, a.replica.state) for a in only(drained, lc.Record)] == [
        ("demo-g1", lc.DRAINING)]
    old = only(drained, lc.Record)[0].replica
    stopped = replace(old, state=lc.STOPPED)
    turn = lc.decide(snap([stopped, pair["demo-g2"], successor], members=members, cfg=changed))
    [next_one] = only(turn, lc.Record)
    assert next_one.replica.replaces == "demo-g2" and next_one.replica.slot == 1


def test_fewer_replicas_retire_the_last_slots():
    pair = serving_pair()
    actions = lc.decide(snap(list(pair.values()), members=ready(pair.values()),
                             cfg=config("1")))
    [record] = only(actions, lc.Record)
    assert (record.replica.id, record.replica.state) == ("demo-g2", lc.DRAINING)
    assert "replicas: 1" in record.replica.reason


def test_auto_counts_what_fits_and_places_the_rest_beside_the_first():
    members = {"a": member("a", memory_bytes=WHOLE_BYTES + 10),
               "b": member("b", memory_bytes=2 * WHOLE_BYTES + 10)}
    by_id, actions = run([], dict(cfg=config("auto"), members=members), rounds=2)
    starts = only(actions, lc.StartStages)
    assert sorted(s.placement.ring for s in starts) == [("a",), ("b",), ("b",)]
    assert {r.model_replicas for r in by_id.values()} == {3}
    assert sorted(r.slot for r in by_id.values()) == [0, 1, 2]


def test_no_room_forecasts_an_outage_with_its_reason_and_bound():
    serving = replace(next(iter(serving_pair(config("1")).values())), load_s=7.0)
    tight = ready([serving], memory_bytes=WHOLE_BYTES + 10)
    before = snap([serving], members=tight, cfg=config("1"))
    after = replace(before, desired=config("1", parallel=3))
    [outage] = lc.outages(after)
    assert outage.model_id == "demo" and outage.replica == serving.id
    assert "no room for its successor" in outage.reason
    assert outage.max_s == 30.0 + 100.0 and "the last start took 7 s" in outage.text()
    roomy = replace(after, members=ready([serving]))
    assert lc.outages(roomy) == []  # make before break: nothing stops


def test_without_room_a_change_breaks_one_replica_at_a_time():
    pair = serving_pair()
    changed = config(parallel=3)
    # each node holds one replica, at the old parallel (17.8 MB) or the new (19.9 MB)
    tight = ready(pair.values(), memory_bytes=20_000_000)
    actions = lc.decide(snap(list(pair.values()), members=tight, cfg=changed))
    [drained] = only(actions, lc.Record)
    assert (drained.replica.id, drained.replica.state) == ("demo-g1", lc.DRAINING)
    assert lc.outages(snap(list(pair.values()), members=tight, cfg=changed)) == []  # g2 serves
    stopped = replace(drained.replica, state=lc.STOPPED)
    [new] = only(lc.decide(snap([stopped, pair["demo-g2"]], members=tight, cfg=changed)),
                 lc.Record)
    assert new.replica.slot == 0 and new.replica.replaces == "demo-g1"
    # slot 0's new generation is on its way: slot 1 keeps serving until it serves
    actions = lc.decide(snap([stopped, pair["demo-g2"], new.replica], members=tight,
                             cfg=changed))
    assert [a.replica.id for a in only(actions, lc.StartStages)] == [new.replica.id]
    assert not [a for a in only(actions, lc.Record) if a.replica.id == "demo-g2"]
    assert not only(actions, lc.StopEngines)

"""Replica lifecycle decisions over frozen snapshots, with no network and a hand-driven clock."""

from __future__ import annotations

from dataclasses import replace

from engine.checkpoint.maker import PRESETS, config_json
from supervisor import lifecycle as lc
from supervisor.fleet_config import parse_fleet_config
from supervisor.membership import ALIVE, DEAD, SUSPECT, Member, ReportedEngine
from supervisor.memory import model_shape_from_config

SHAPE = model_shape_from_config(config_json(PRESETS["demo"]), 2)
FLEET = """
version: 1
supervisor: {address: "127.0.0.1:7400", state_dir: /tmp/x}
nodes:
  - {name: a, labels: {backend: torch-cpu}}
  - {name: b, labels: {backend: mlx-cpu}}
models:
  - id: demo
    checkpoint: /models/demo
    backends: [torch-cpu, mlx-cpu]
    context: 1024
    parallel: %d
    placement:
      - {node: a, layers: "0:4"}
      - {node: b, layers: "4:8"}
"""
RANK0_BYTES, RANK1_BYTES = 9_712_128, 8_654_848  # the demo's 0:4 and 4:8 at parallel 2
POLICY = lc.Policy(backoff_first_s=1.0, backoff_max_s=8.0, start_timeout_s=100.0, drain_s=30.0)


def config(parallel: int = 2):
    return parse_fleet_config(FLEET % parallel)


def member(name: str, state: str = ALIVE, engines: dict[str, str] | None = None,
           cordoned: bool = False, memory_bytes: int = 8 << 30) -> Member:
    facts = {"host": {}, "backends": [
        {"backend": b, "present": True, "devices": [{"memory_usable_bytes": memory_bytes}]}
        for b in ("torch-cpu", "mlx-cpu")]}
    views = {e: ReportedEngine(e, "", int(e[-1]), s,
                            {"reason": "killed by SIGKILL"} if s == "exited" else None)
             for e, s in (engines or {}).items()}
    return Member(name, f"https://127.0.0.1:{7700 + ord(name[0])}", state, 0.0, 0.0, facts,
                  "d", views, cordoned)


def snap(replicas, members=None, now=10.0, healthy=(), cfg=None, epoch=0):
    members = members or {"a": member("a"), "b": member("b")}
    return lc.Snapshot(now=now, desired=cfg or config(), members=members,
                       replicas={r.id: r for r in replicas}, shapes={"demo": SHAPE},
                       healthy=frozenset(healthy), rebalance_epoch=epoch, policy=POLICY)


def started(state: str = lc.STARTING, since: float = 5.0, failures: int = 0) -> lc.Replica:
    from supervisor.planning import spec_digest

    stages = (lc.StageRecord(0, "a", "torch-cpu", (0, 4), "demo-g1-r0", "127.0.0.1", 9000, 9001,
                             RANK0_BYTES),
              lc.StageRecord(1, "b", "mlx-cpu", (4, 8), "demo-g1-r1", "127.0.0.1", 9002, 0,
                             RANK1_BYTES))
    return lc.Replica("demo-g1", "demo", 1, state, since, spec_digest(config().model("demo")),
                      failures=failures, stages=stages, master_port=9003)


def both(states: tuple[str, str]) -> dict[str, Member]:
    return {"a": member("a", engines={"demo-g1-r0": states[0]}),
            "b": member("b", engines={"demo-g1-r1": states[1]})}


def only(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def test_a_new_model_gets_a_placing_replica_then_its_stages():
    [record] = lc.decide(snap([]))
    assert isinstance(record, lc.Record) and record.replica.state == lc.PLACING
    assert record.replica.id == "demo-g1"
    [start] = lc.decide(snap([record.replica]))
    assert isinstance(start, lc.StartStages)
    assert start.placement.ring == ("a", "b")
    assert [s.layer_range for s in start.placement.stages] == [(0, 4), (4, 8)]


def test_placing_waits_with_the_reason_when_nothing_fits():
    placing = lc.decide(snap([]))[0].replica
    nobody = {"a": member("a", state=SUSPECT), "b": member("b", state=DEAD)}
    [record] = lc.decide(snap([placing], members=nobody))
    assert record.replica.state == lc.PLACING and "no live node" in record.replica.reason
    assert lc.decide(snap([record.replica], members=nobody)) == []  # same reason: no churn


def test_explicit_placement_falls_back_to_what_remains_when_a_node_is_gone():
    placing = lc.decide(snap([]))[0].replica
    [start] = lc.decide(snap([placing], members={"a": member("a"), "b": member("b", DEAD)}))
    assert start.placement.ring == ("a",)
    assert "needs b" in start.replica.note


def test_starting_to_warming_to_serving():
    assert lc.decide(snap([started()], members=both(("ready", "starting")))) == []
    [warm] = lc.decide(snap([started()], members=both(("ready", "ready"))))
    assert warm.replica.state == lc.WARMING
    assert lc.decide(snap([warm.replica], members=both(("ready", "ready")))) == []
    [serve] = lc.decide(snap([warm.replica], members=both(("ready", "ready")),
                             healthy={"demo-g1"}))
    assert serve.replica.state == lc.SERVING and serve.replica.failures == 0


def test_one_stage_lost_fails_the_replica_and_stops_the_rest():
    serving = started(lc.SERVING, failures=0)
    actions = lc.decide(snap([serving], members=both(("ready", "exited"))))
    [record], [stop] = only(actions, lc.Record), only(actions, lc.StopEngines)
    assert record.replica.state == lc.FAILED
    assert "rank 1 on b exited: killed by SIGKILL" in record.replica.reason
    assert record.replica.next_attempt_at == 10.0 + 1.0 and stop.drain_s == 0.0


def test_a_dead_node_fails_the_replica_a_suspect_one_does_not():
    serving = started(lc.SERVING)
    members = both(("ready", "ready"))
    suspect = dict(members, b=replace(members["b"], state=SUSPECT))
    assert lc.decide(snap([serving], members=suspect)) == []
    dead = dict(members, b=replace(members["b"], state=DEAD))
    record = only(lc.decide(snap([serving], members=dead)), lc.Record)[0]
    assert record.replica.state == lc.FAILED and "node b (rank 1) is dead" in record.replica.reason


def test_an_ended_replicas_exited_engines_are_forgotten():
    failed = started(lc.FAILED)
    actions = lc.decide(snap([failed], members=both(("exited", "draining")), now=0.0))
    assert only(actions, lc.ForgetEngine) == [lc.ForgetEngine("a", "demo-g1-r0")]


def test_failures_back_off_then_a_new_generation_is_placed():
    failed = replace(started(lc.FAILED, failures=3), next_attempt_at=14.0)
    assert lc.decide(snap([failed], now=13.9)) == []
    [record] = lc.decide(snap([failed], now=14.0))
    assert record.replica.id == "demo-g2" and record.replica.state == lc.PLACING
    assert record.replica.failures == 3
    assert [POLICY.backoff_s(n) for n in (1, 2, 3, 4, 5)] == [1.0, 2.0, 4.0, 8.0, 8.0]


def test_a_start_that_takes_too_long_fails():
    actions = lc.decide(snap([started(since=0.0)], members=both(("ready", "starting")),
                             now=101.0))
    assert only(actions, lc.Record)[0].replica.state == lc.FAILED


def test_a_join_changes_nothing_for_a_serving_replica():
    members = dict(both(("ready", "ready")), c=member("c"))
    assert lc.decide(snap([started(lc.SERVING)], members=members)) == []


def test_a_changed_spec_with_room_starts_the_successor_before_the_old_one_drains():
    serving = started(lc.SERVING)
    members = both(("ready", "ready"))
    [made] = lc.decide(snap([serving], members=members, cfg=config(3)))
    successor = made.replica
    assert successor.state == lc.PLACING and successor.replaces == "demo-g1"
    assert (successor.id, successor.slot) == ("demo-g2", 0)
    [start] = lc.decide(snap([serving, successor], members=members, cfg=config(3)))
    assert start.replica.id == "demo-g2" and start.placement.ring == ("a", "b")
    # the old stages' memory is held: the new ones were placed beside them, on other ports
    assert not {p for s in start.replica.stages for p in s.ports()} & {9000, 9001, 9002, 9003}
    ready = {"a": {}, "b": {}}
    for st in (*serving.stages, *start.replica.stages):
        ready[st.node][st.engine_id] = "ready"
    members = {name: member(name, engines=engines) for name, engines in ready.items()}
    warming = replace(start.replica, state=lc.WARMING)
    assert lc.decide(snap([serving, warming], members=members, cfg=config(3))) == []
    actions = lc.decide(snap([serving, warming], members=members, cfg=config(3),
                             healthy={"demo-g2"}))
    assert [a.replica.state for a in only(actions, lc.Record)] == [lc.SERVING]
    new = only(actions, lc.Record)[0].replica
    actions = lc.decide(snap([serving, new], members=members, cfg=config(3)))
    [record], [stop] = only(actions, lc.Record), only(actions, lc.StopEngines)
    assert record.replica.id == "demo-g1" and record.replica.state == lc.DRAINING
    assert record.replica.reason.startswith("fleet.yaml changed this model; demo-g2 serves")
    assert stop.drain_s == 30.0


def test_a_changed_spec_without_room_drains_first_then_stops_then_replaces():
    serving = started(lc.SERVING)
    small = {"a": member("a", engines={"demo-g1-r0": "ready"}, memory_bytes=RANK0_BYTES + 10),
             "b": member("b", engines={"demo-g1-r1": "ready"}, memory_bytes=RANK1_BYTES + 10)}
    actions = lc.decide(snap([serving], members=small, cfg=config(3)))
    [record], [stop] = only(actions, lc.Record), only(actions, lc.StopEngines)
    assert record.replica.state == lc.DRAINING and "fleet.yaml changed" in record.replica.reason
    assert "no room for its successor beside it" in record.replica.reason
    assert stop.drain_s == 30.0
    draining = record.replica
    assert lc.decide(snap([draining], members=both(("draining", "exited")), cfg=config(3))) == []
    [stopped] = lc.decide(snap([draining], members=both(("exited", "exited")), cfg=config(3)))
    assert stopped.replica.state == lc.STOPPED
    [new] = lc.decide(snap([stopped.replica], cfg=config(3)))
    assert new.replica.id == "demo-g2" and new.replica.state == lc.PLACING


def test_a_drain_that_outlives_its_deadline_counts_as_stopped():
    draining = started(lc.DRAINING, since=0.0)
    [stopped] = lc.decide(snap([draining], members=both(("draining", "draining")), now=61.0))
    assert stopped.replica.state == lc.STOPPED


def test_a_cordoned_node_gets_a_successor_elsewhere_first():
    members = both(("ready", "ready"))
    members["b"] = replace(members["b"], cordoned=True)
    [made] = lc.decide(snap([started(lc.SERVING)], members=members))
    assert made.replica.state == lc.PLACING and made.replica.replaces == "demo-g1"
    [start] = lc.decide(snap([started(lc.SERVING), made.replica], members=members))
    assert start.placement.ring == ("a",)  # beside the old rank 0, off the cordoned node


def test_rebalance_moves_only_a_replica_whose_placement_changed():
    # Placed on `a` alone while `b` was gone; a rebalance with `b` back returns to fleet.yaml's.
    lone = replace(started(lc.SERVING), stages=started().stages[:1])
    members = {"a": member("a", engines={"demo-g1-r0": "ready"}), "b": member("b")}
    [record] = only(lc.decide(snap([lone], members=members, epoch=1)), lc.Record)
    assert record.replica.state == lc.PLACING and record.replica.replaces == "demo-g1"
    [start] = lc.decide(snap([lone, record.replica], members=members, epoch=1))
    assert start.placement.ring == ("a", "b")
    # no room for the rebalanced placement beside it: it drains first
    tight = {"a": member("a", engines={"demo-g1-r0": "ready"}, memory_bytes=2 * RANK0_BYTES),
             "b": member("b")}
    lone_full = replace(lone, stages=(replace(lone.stages[0], layer_range=(0, 8),
                                              memory_bytes=2 * RANK0_BYTES - RANK0_BYTES // 2),))
    record = only(lc.decide(snap([lone_full], members=tight, epoch=1)), lc.Record)[0]
    assert record.replica.state == lc.DRAINING and record.replica.reason.startswith("rebalance")
    [seen] = lc.decide(snap([started(lc.SERVING)], members=both(("ready", "ready")), epoch=1))
    assert seen.replica.state == lc.SERVING and seen.replica.rebalance_epoch == 1


def test_a_model_removed_from_fleet_yaml_drains_and_is_not_replaced():
    empty = parse_fleet_config((FLEET % 2).split("models:")[0])
    actions = lc.decide(snap([started(lc.SERVING)], members=both(("ready", "ready")), cfg=empty))
    assert only(actions, lc.Record)[0].replica.state == lc.DRAINING
    assert only(actions, lc.StopEngines)


def test_replica_round_trips_through_a_dict():
    replica = started(lc.SERVING)
    assert lc.Replica.from_dict(replica.to_dict()) == replica
    assert replica.url == "http://127.0.0.1:9001"


def test_a_serving_stage_its_agent_no_longer_reports_is_lost():
    members = {"a": member("a", engines={"demo-g1-r0": "ready"}), "b": member("b")}
    record = only(lc.decide(snap([started(lc.SERVING)], members=members)), lc.Record)[0]
    assert record.replica.state == lc.FAILED and "no longer reports rank 1" in record.replica.reason
    # while starting, a stage not reported yet is only not there yet
    assert lc.decide(snap([started()], members=members)) == []


def test_placing_chooses_ports_from_the_snapshot_and_starts():
    placing = lc.decide(snap([]))[0].replica
    [start] = lc.decide(replace(snap([placing]), engine_ports=(9000, 9009)))
    r = start.replica
    assert r.state == lc.STARTING and r.placement_id == "0-4@torch-cpu,4-8@mlx-cpu"
    # rank 0: listen, API, control; the other stage on the same host gets the next one
    assert [(s.host, s.listen_port, s.http_port) for s in r.stages] == [
        ("127.0.0.1", 9000, 9001), ("127.0.0.1", 9003, 0)]
    assert r.master_port == 9002 and r.url == "http://127.0.0.1:9001"


def test_ports_skip_running_replicas_and_busy_ones_and_go_round_the_range():
    running = started(lc.SERVING)  # 9000..9003 on 127.0.0.1 (9003 its control port)
    placing = replace(lc.decide(snap([]))[0].replica, id="demo-g2", generation=2)
    s = replace(snap([running, placing], members=both(("ready", "ready"))),
                engine_ports=(9000, 9008),
                busy_ports=frozenset({("127.0.0.1", 9005)}))
    [start] = lc.decide(s)
    # after the last replica's ports (9002), past the busy 9005, then round to the end
    assert [(st.listen_port, st.http_port) for st in start.replica.stages] == [(9004, 9006),
                                                                               (9008, 0)]
    assert start.replica.master_port == 9007
    freed = replace(running, state=lc.STOPPED)  # its ports come back, last
    s = replace(s, replicas={"demo-g1": freed, "demo-g2": placing}, engine_ports=(9000, 9004))
    [start] = lc.decide(s)
    assert [st.ports() for st in start.replica.stages] == [(9003, 9004), (9001,)]
    assert start.replica.master_port == 9000


def test_no_free_port_fails_the_replica_with_the_host_and_range():
    running = started(lc.SERVING)
    placing = replace(lc.decide(snap([]))[0].replica, id="demo-g2", generation=2)
    actions = lc.decide(replace(snap([running, placing]), engine_ports=(9000, 9005)))
    failed = [a.replica for a in only(actions, lc.Record) if a.replica.id == "demo-g2"]
    assert failed and failed[0].state == lc.FAILED
    assert "no free engine port on 127.0.0.1 in 9000..9005" in failed[0].reason


def test_an_ipv6_member_gets_a_bracketed_url():
    ipv6 = {"a": replace(member("a"), url="https://[::1]:7797"), "b": member("b")}
    placing = lc.decide(snap([], members=ipv6))[0].replica
    [start] = lc.decide(snap([placing], members=ipv6))
    assert start.replica.stages[0].host == "::1"
    assert start.replica.url.startswith("http://[::1]:")


# --- a frozen rank 0: its /health unanswered past the dead-ring time ----------------------

PROBE_TIMEOUT_S, HEALTH_INTERVAL_S = 2.0, 1.0  # the supervisor's own (control_loop)
MAX_GAP_S = HEALTH_INTERVAL_S + PROBE_TIMEOUT_S


def heard_after(probes, heard=None):
    """Fold probes (sent_at, ended_at, answered[, node_beat_at]) into what the supervisor
    heard."""
    for sent_at, ended_at, answered, *beat in probes:
        heard = lc.after_probe(heard, sent_at, ended_at, answered, beat[0] if beat else 0.0,
                               PROBE_TIMEOUT_S, MAX_GAP_S)
    return heard


def test_silence_counts_from_the_last_answer_and_any_answer_ends_it():
    assert heard_after([(0.0, 0.1, True)]) == lc.Rank0Heard(0.1)
    assert heard_after([(0.0, 0.1, True)]).silent_s == 0.0
    silent = heard_after([(0.0, 0.1, True), (1.1, 3.1, False, 0.5), (4.1, 6.1, False, 3.5)])
    assert silent == lc.Rank0Heard(0.1, 6.1, 1.1, 3.5) and silent.silent_s == 6.0
    assert silent.node_heard_meanwhile  # its node beat at 3.5, between the two probes
    # A 503 "draining" is an answer: the control loop passes answered=True for any status.
    assert heard_after([(7.1, 7.2, True)], silent).silent_s == 0.0
    # A refused connection is over at once: silence as far as it was seen.
    assert heard_after([(1.0, 1.25, False)], lc.Rank0Heard(0.5)).silent_s == 0.75


def test_silence_counts_only_time_the_probes_covered():
    # A probe seen to end long after its timeout was held up on the supervisor's side (a
    # stalled loop, a suspended process): it says nothing past its timeout.
    assert heard_after([(1.0, 30.0, False)], lc.Rank0Heard(0.5)).silent_until == 3.0
    # After a gap in the probing (a supervisor suspended, then its network not yet back),
    # the last answer says nothing about the time between: the count starts again.
    assert heard_after([(40.0, 40.01, False)], lc.Rank0Heard(0.5)) == lc.Rank0Heard(
        40.0, 40.01, 40.0)
    assert heard_after([(40.0, 42.0, False)], lc.Rank0Heard(0.5, 3.0, 1.0)) == lc.Rank0Heard(
        40.0, 42.0, 40.0)
    # The first probe this supervisor sends (a replica adopted after a restart) starts it.
    assert heard_after([(5.0, 7.0, False)]) == lc.Rank0Heard(5.0, 7.0, 5.0)


def test_the_limit_is_the_rings_dead_ring_time():
    from supervisor.relays import UpstreamSilence

    assert lc.Policy().rank0_silence_s == UpstreamSilence().limit_s == 6.0


def frozen_serving(silent_s: float, state: str = lc.SERVING, beat_at: float = 4.5):
    """A replica whose rank 0 last answered at 3.0 and went unanswered since, first by a
    probe sent at 4.0 and for `silent_s` in all; its node beat at `beat_at` as far as the
    supervisor knew when the latest probe went out."""
    serving = started(state)
    heard = {serving.id: lc.Rank0Heard(3.0, 3.0 + silent_s, 4.0, beat_at)}
    return replace(snap([serving], members=both(("ready", "ready")), healthy={serving.id}),
                   rank0_heard=heard, policy=replace(POLICY, rank0_silence_s=6.0))


def test_a_serving_rank0_silent_for_the_dead_ring_time_fails_and_is_stopped():
    assert lc.decide(frozen_serving(5.9)) == []
    actions = lc.decide(frozen_serving(6.5))
    [record], [stop] = only(actions, lc.Record), only(actions, lc.StopEngines)
    assert record.replica.state == lc.FAILED and stop.drain_s == 0.0
    assert "rank 0 has not answered /health for 6.5 s" in record.replica.reason
    assert "dead-ring time is 6 s" in record.replica.reason
    assert record.replica.next_attempt_at == 10.0 + POLICY.backoff_s(1)
    # then, after the backoff, the next generation is placed (what restarts it)
    [placed] = lc.decide(snap([record.replica], now=record.replica.next_attempt_at))
    assert placed.replica.state == lc.PLACING and placed.replica.id == "demo-g2"


def test_silence_fails_a_replica_only_if_its_node_was_heard_from_meanwhile():
    """The supervisor's own network down (no heartbeat from the node since rank 0 first
    went unanswered) is not rank 0's silence."""
    assert lc.decide(frozen_serving(6.5, beat_at=3.5)) == []  # none since the first probe
    # ... nor after a later beat that came before rank 0 answered again: the network back
    beaten = replace(frozen_serving(6.5, beat_at=3.5), members={
        n: replace(m, last_heartbeat_at=9.9) for n, m in both(("ready", "ready")).items()})
    assert lc.decide(beaten) == []


def test_a_replica_still_starting_or_draining_is_not_failed_for_silence():
    for state in (lc.STARTING, lc.WARMING):
        assert not [a for a in only(lc.decide(frozen_serving(60.0, state)), lc.Record)
                    if a.replica.state == lc.FAILED]
    assert lc.decide(frozen_serving(60.0, lc.DRAINING)) == []


def failed_after_freeze(freeze_at: float, beat_s: float, beat_phase_s: float
                        ) -> tuple[float, float]:
    """The health loop's cadence with a hand clock: probes of a live rank 0 answer at once,
    probes of a frozen one take their whole timeout; its agent beats every `beat_s`. When
    the replica fails: (seconds after its last answer, seconds after the freeze)."""
    # It answered the probe that made it serving, over at 0.0; the next one is due.
    heard, t, answered_at = lc.Rank0Heard(0.0), HEALTH_INTERVAL_S, 0.0
    while t < 60.0:
        answers = t + 0.01 < freeze_at  # frozen before its answer left: none comes
        ended = t + (0.01 if answers else PROBE_TIMEOUT_S)
        answered_at = ended if answers else answered_at
        beat_at = beat_phase_s + beat_s * ((t - beat_phase_s) // beat_s)  # the last, at t
        heard = lc.after_probe(heard, t, ended, answers, beat_at, PROBE_TIMEOUT_S, MAX_GAP_S)
        s = replace(frozen_serving(0.0), now=ended, rank0_heard={"demo-g1": heard})
        if only(lc.decide(s), lc.StopEngines):
            return ended - answered_at, ended - freeze_at
        t = ended + HEALTH_INTERVAL_S
    raise AssertionError(f"frozen at {freeze_at} s, never failed")


def test_a_frozen_rank0_fails_within_the_dead_ring_time_of_its_freeze():
    """Whenever it froze (between probes, or with a probe in flight), the replica fails no
    sooner than the dead-ring time after its last answer; with its agent beating often (as
    in the end-to-end tests), no later than the dead-ring time after the freeze; at the
    agents' default pace (5 s), one health round (3 s) later when no beat came between its
    first two unanswered probes."""
    limit_s, round_s = 6.0, HEALTH_INTERVAL_S + PROBE_TIMEOUT_S
    for freeze_at in (0.005, 0.3, 0.6, 0.95, 1.005, 1.5, 2.9):
        for phase_s in (0.0, 0.15, 1.3, 2.6, 4.0, 4.9):
            since_answer_s, since_freeze_s = failed_after_freeze(freeze_at, 0.3, phase_s % 0.3)
            assert since_answer_s >= limit_s and since_freeze_s <= limit_s, (freeze_at, phase_s)
            since_answer_s, since_freeze_s = failed_after_freeze(freeze_at, 5.0, phase_s)
            assert since_answer_s >= limit_s, (freeze_at, phase_s)
            assert since_freeze_s <= limit_s + round_s, (freeze_at, phase_s)

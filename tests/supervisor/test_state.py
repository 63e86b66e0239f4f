"""The supervisor's SQLite state survives a restart: desired state, members, replicas,
tokens (hashes, one use) and the event log."""

from __future__ import annotations

from pathlib import Path

from agent.pki import FleetCA, NodeCredentials, make_csr, new_key
from supervisor import issuing
from supervisor.lifecycle import SERVING, Replica, StageRecord
from supervisor.membership import on_heartbeat
from supervisor.state import State


def test_everything_survives_a_reopen(tmp_path: Path):
    db = tmp_path / "supervisor.sqlite"
    state = State(db)
    state.set_desired("version: 1\n", "fleet.yaml", now=5.0)
    member = on_heartbeat(None, {"node": "a", "url": "https://127.0.0.1:1", "engines": [
        {"engine_id": "m-g1-r0", "replica": "m-g1", "rank": 0, "state": "ready"}]}, 1.0).member
    state.put_member(member)
    replica = Replica("m-g1", "m", 1, SERVING, 2.0, "abc", stages=(
        StageRecord(0, "a", "torch-cpu", (0, 8), "m-g1-r0", "127.0.0.1", 9000, 9001),),
        master_port=9002, why=("because",))
    state.put_replica(replica)
    assert state.bump_rebalance_epoch() == 1
    state.log_event("apply", "applied fleet.yaml")
    state.close()

    again = State(db)
    assert again.desired().text == "version: 1\n" and again.desired().applied_at == 5.0
    assert again.members() == {"a": member}
    assert again.replicas() == {"m-g1": replica}
    assert again.rebalance_epoch() == 1
    assert [e["message"] for e in again.events()] == ["applied fleet.yaml"]
    again.close()


def test_old_generations_are_pruned(tmp_path: Path):
    state = State(tmp_path / "s.sqlite")
    for generation in range(1, 31):
        state.put_replica(Replica(f"m-g{generation}", "m", generation, "stopped", 0.0, "d"))
    assert min(r.generation for r in state.replicas().values()) == 11


def test_a_join_token_is_good_for_one_join(tmp_path: Path):
    state = State(tmp_path / "s.sqlite")
    ca = FleetCA.create("t")
    token = issuing.new_token(ca, state, ttl_s=60, node="n1")
    key = new_key()
    body = {"node": "n1", "token_secret": token.secret_text,
            "csr": make_csr(key, "n1").decode(), "hosts": ["127.0.0.1"]}
    reply = issuing.join(ca, state, body)
    assert "BEGIN CERTIFICATE" in reply["certificate"]
    import pytest

    from agent.pki import TokenError

    with pytest.raises(TokenError, match="not known"):
        issuing.join(ca, state, body)


def test_init_makes_the_ca_and_both_certificates_and_refuses_twice(tmp_path: Path):
    import pytest

    result = issuing.init_pki(tmp_path / "sup", "127.0.0.1:7400", tmp_path / "ctl")
    assert NodeCredentials(tmp_path / "ctl").check().role == "admin"
    assert issuing.supervisor_credentials(tmp_path / "sup").check().role == "supervisor"
    assert (tmp_path / "ctl" / "supervisor_url").read_text().strip() == "https://127.0.0.1:7400"
    assert len(result.ca_fingerprint) == 64
    with pytest.raises(issuing.InitError, match="already has a fleet CA"):
        issuing.init_pki(tmp_path / "sup", "127.0.0.1:7400", tmp_path / "ctl")

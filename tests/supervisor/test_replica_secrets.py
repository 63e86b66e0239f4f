"""A replica's secrets and the supervisor's state on disk: owner-only files, made once, read
back after a restart, deleted when the replica ends or was left behind; and who may report an
engine (the node it was placed on)."""

from __future__ import annotations

import stat
from pathlib import Path

from supervisor.lifecycle import SERVING, Replica, StageRecord, foreign_engines
from supervisor.replica_secrets import API_SECRET, LINK_KEY, ReplicaSecrets
from supervisor.state import State


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_secrets_are_made_once_owner_only_and_read_back(tmp_path: Path):
    keys = tmp_path / "keys"
    made = ReplicaSecrets(keys)
    link, api = made.make("m-g1", LINK_KEY), made.make("m-g1", API_SECRET)
    assert len(link) == len(api) == 64 and link != api
    assert made.make("m-g1", API_SECRET) == api
    assert mode(keys) == 0o700 and mode(keys / "m-g1.api") == 0o600
    assert mode(keys / "m-g1.key") == 0o600
    again = ReplicaSecrets(keys)  # a restarted supervisor routes with the same secret
    assert again.read("m-g1", API_SECRET) == api and again.read("m-g9", API_SECRET) == ""
    again.forget("m-g1")
    assert not list(keys.iterdir()) and again.read("m-g1", API_SECRET) == ""


def test_files_of_replicas_that_ended_while_down_are_swept(tmp_path: Path):
    secrets = ReplicaSecrets(tmp_path / "keys")
    for replica in ("a.b-g1", "a.b-g2", "c-g1"):
        secrets.make(replica, LINK_KEY)
        secrets.make(replica, API_SECRET)
    (tmp_path / "keys").chmod(0o755)  # as an older supervisor left it
    assert secrets.keep_only(["a.b-g2"]) == ["a.b-g1", "c-g1"]
    assert sorted(p.name for p in (tmp_path / "keys").iterdir()) == ["a.b-g2.api", "a.b-g2.key"]
    assert mode(tmp_path / "keys") == 0o700


def test_the_state_database_and_its_directory_are_owner_only(tmp_path: Path):
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o755)
    db = state_dir / "supervisor.sqlite"
    first = State(db)
    first.log_event("x", "a write, so the WAL exists")
    for path in (db, *first.companions()):
        path.chmod(0o644)  # as an older supervisor left them
    first.close()
    state = State(db)
    state.log_event("x", "a write, so the WAL exists")
    assert mode(state_dir) == 0o700
    for path in (db, *state.companions()):
        assert path.exists() and mode(path) == 0o600, path


def test_pins_and_revocations_survive_a_reopen(tmp_path: Path):
    state = State(tmp_path / "s.sqlite")
    state.put_pin("a", "f" * 64)
    state.close()
    state = State(tmp_path / "s.sqlite")
    assert state.pin("a") == "f" * 64 and not state.is_revoked("f" * 64)
    assert state.revoke("a") == "f" * 64
    state.close()
    state = State(tmp_path / "s.sqlite")
    assert state.pin("a") is None and state.is_revoked("f" * 64)


def test_an_engine_is_reported_only_by_the_node_it_was_placed_on():
    replica = Replica("m-g1", "m", 1, SERVING, 0.0, "d", stages=(
        StageRecord(0, "a", "torch-cpu", (0, 4), "m-g1-r0", "127.0.0.1", 1, 2),
        StageRecord(1, "b", "torch-cpu", (4, 8), "m-g1-r1", "127.0.0.1", 3)))
    replicas = {replica.id: replica}
    assert foreign_engines("a", ["m-g1-r0"], replicas) == {}
    assert foreign_engines("b", ["m-g1-r0", "m-g1-r1"], replicas) == {"m-g1-r0": "a"}
    assert foreign_engines("b", ["pruned-g0-r0"], replicas) == {}  # nobody's: not foreign

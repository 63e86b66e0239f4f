"""Bootstrap refuses every bad peer by name, on both sides; a stranger cannot stop a boot."""

from __future__ import annotations

import pytest

from engine.harness.launch import launch, write_key_file
from tests.waiting import connect_once_listening

BOOT = {"FLEET_BOOT_DEADLINE_S": "8"}


def reasons(fleet, rank: int) -> str:
    """Everything rank `rank` logged as a reason, refusal or exit."""
    return " ".join(str(e.get("reason", "")) for e in fleet.events(rank))


def wait_exit(fleet, rank: int, timeout_s: float = 30) -> int:
    return fleet.processes[rank].wait(timeout_s)


@pytest.fixture()
def model(make_model):
    return make_model("llama", num_hidden_layers=4)


@pytest.mark.parametrize("fault, error", [
    ("key", "BadProof"),
    ("fingerprint", "FingerprintMismatch"),
    ("world", "WorldMismatch"),
])
def test_a_bad_follower_is_refused_by_name_on_both_sides(model, make_model, tmp_path, fault,
                                                         error):
    other = {}
    if fault == "key":
        other = {"FLEET_KEY_FILE": str(write_key_file(tmp_path / "other.key"))}
    elif fault == "fingerprint":  # same shapes and config, other weights
        other = {"FLEET_MODEL": str(make_model("llama", num_hidden_layers=4, seed=99))}
    elif fault == "world":
        other = {"WORLD_SIZE": "3", "FLEET_LAYOUT": "0:2,2:4,4:6"}
    fleet = launch(model, [(0, 2), (2, 4)], run_dir=tmp_path / "run", extra_env=BOOT,
                   rank_env={1: other})
    try:
        assert wait_exit(fleet, 1) != 0
        assert error in reasons(fleet, 1), fleet.log_tail(1)
        assert wait_exit(fleet, 0) != 0  # it waited for a good rank 1 until its boot deadline
        assert error in reasons(fleet, 0), fleet.log_tail(0)
    finally:
        fleet.stop()


def test_a_layout_with_a_gap_is_refused_before_any_round(model, tmp_path):
    fleet = launch(model, [(0, 2), (2, 4)], run_dir=tmp_path / "run", extra_env=BOOT,
                   rank_env={0: {"FLEET_LAYOUT": "0:2,3:4"},
                             1: {"FLEET_LAYOUT": "0:2,3:4", "FLEET_LAYERS": "3:4"}})
    try:
        for rank in (0, 1):
            assert wait_exit(fleet, rank) != 0
        assert "LayoutGap" in reasons(fleet, 0), fleet.log_tail(0)
        assert "LayoutGap" in reasons(fleet, 1), fleet.log_tail(1)
    finally:
        fleet.stop()


def test_a_wildcard_listen_address_is_refused_at_start(model, tmp_path):
    fleet = launch(model, [(0, 2), (2, 4)], run_dir=tmp_path / "run", extra_env=BOOT,
                   rank_env={1: {"FLEET_LISTEN": "0.0.0.0:0"}})
    try:
        assert wait_exit(fleet, 1) == 2
        assert "wildcard" in fleet.log_tail(1)
    finally:
        fleet.stop()


def test_a_garbage_hello_is_refused_and_the_ring_still_boots(model, tmp_path):
    fleet = launch(model, [(0, 2), (2, 4)], run_dir=tmp_path / "run", spawn=[0])
    master = ("127.0.0.1", int(fleet.envs[0]["MASTER_PORT"]))
    try:
        def alive() -> None:
            assert fleet.processes[0].poll() is None, fleet.log_tail(0)

        # Rank 0 listens once its stage has loaded.
        stranger = connect_once_listening(master, within_s=60, still_worth_it=alive,
                                          what="rank 0 listening")
        with stranger:
            stranger.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(64))
            stranger.settimeout(5)
            reply = b""
            while chunk := stranger.recv(4096):  # rank 0's HELLO, then its ABORT, then EOF
                reply += chunk
        assert b"BadMagic" in reply  # the ABORT frame names the error
        fleet.start_rank(1)
        fleet.wait_ready()
        assert "BadMagic" in reasons(fleet, 0)
    finally:
        fleet.stop()

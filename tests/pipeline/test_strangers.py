"""A port scan during boot cannot end or stall a ring; a lost peer is named by rank and address.

Real engine processes on loopback. While one rank boots alone, every ring listener it has is
hit with what a scanner or a stranger sends: a connect-and-close, two connections that never
speak (held open until the ring serves), garbage bytes, and a hello with the right
fingerprint but the wrong key. Then the other rank starts; the ring must boot and serve, and
the booting rank's log must name every stranger by its address, with the reason.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import urllib.request
from pathlib import Path

import pytest

from engine.checkpoint.fingerprint import checkpoint_digest, layout_fingerprint
from engine.harness.launch import LocalReplica, launch
from engine.link import errors
from engine.link.hello import Handshake
from engine.link.transport import connect, handshake
from tests.waiting import connect_once_listening, wait_until

STAGES = [(0, 2), (2, 4)]
ENV = {
    # Longer than the whole test: a silent stranger is never timed out before the ring boots,
    # so a boot that waited on one would not finish.
    "FLEET_HANDSHAKE_DEADLINE_S": "600",
    "FLEET_BOOT_DEADLINE_S": "120",
}
WAIT_S = 60.0


def host_port(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host, int(port)


def source(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"{host}:{port}"


def wait_listening(fleet: LocalReplica, rank: int, address: tuple[str, int]) -> str:
    """Connect until `address` accepts, then close at once: the scanner's connect-and-close.
    Returns the source address of the connection that got in."""
    def alive() -> None:
        assert fleet.processes[rank].poll() is None, fleet.log_tail(rank)

    with connect_once_listening(address, within_s=WAIT_S, still_worth_it=alive,
                                what=f"{address} listening (rank {rank})") as probe:
        return source(probe)


def send_garbage(address: tuple[str, int]) -> tuple[str, bytes]:
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: scanner\r\n\r\n" + bytes(64))
        reply = b""
        while chunk := sock.recv(4096):  # the rank's HELLO, its ABORT, end of stream
            reply += chunk
        return source(sock), reply


def wrong_key_hello(address: tuple[str, int], model: Path, claim_rank: int) -> tuple[str, object]:
    """A hello as the expected rank with the real fingerprint, proven with another key."""
    fingerprint = layout_fingerprint(checkpoint_digest(model), STAGES)
    link = connect(*address, deadline_s=10)
    try:
        who = f"{link._sock.getsockname()[0]}:{link._sock.getsockname()[1]}"
        handshake(link, Handshake(rank=claim_rank, world=2, fingerprint=fingerprint,
                                  key=os.urandom(32)), deadline_s=10)
    except errors.ProtocolError as error:
        return who, error
    finally:
        link.close()
    return who, None


def refusals(fleet: LocalReplica, rank: int) -> dict[str, str]:
    return {str(e.get("peer")): str(e.get("reason")) for e in fleet.events(rank)
            if e.get("event") == "refused a peer"}


def wait_refused(fleet: LocalReplica, rank: int, addresses: list[str]) -> dict[str, str]:
    """The rank's logged refusals, once every address in `addresses` is among them (its log
    file is the only signal there is, so the wait polls it)."""
    wait_until(lambda: all(a in refusals(fleet, rank) for a in addresses), within_s=WAIT_S,
               what=f"rank {rank} refusing {addresses} by name", poll_s=0.2)
    return refusals(fleet, rank)


def complete(fleet: LocalReplica) -> str:
    with urllib.request.urlopen(f"{fleet.url}/models", timeout=30) as reply:
        model_id = json.load(reply)["data"][0]["id"]
    body = json.dumps({"model": model_id, "prompt": "hello", "max_tokens": 4,
                       "temperature": 0}).encode()
    request = urllib.request.Request(f"{fleet.url}/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert reply.status == 200
        return json.load(reply)["choices"][0]["finish_reason"]


@pytest.mark.parametrize("booting", [0, 1])
def test_strangers_at_every_listener_during_boot_are_refused_by_address(make_model, tmp_path,
                                                                        booting):
    model = make_model("llama", num_hidden_layers=4)
    fleet = launch(model, STAGES, run_dir=tmp_path / "run", extra_env=ENV, spawn=[booting])
    env = fleet.envs[booting]
    # Rank 0 has its control port and its ring listener; a follower its ring listener.
    listeners = [host_port(env["FLEET_LISTEN"])]
    if booting == 0:
        listeners.insert(0, (env["MASTER_ADDR"], int(env["MASTER_PORT"])))
    expected_rank = 1 - booting  # the only rank any of these listeners admits
    silent: list[socket.socket] = []
    named: dict[str, str] = {}  # stranger's address -> what its refusal must say
    try:
        for address in listeners:
            named[wait_listening(fleet, booting, address)] = "PeerClosed"
            for _ in range(2):
                silent.append(socket.create_connection(address, timeout=10))
            who, reply = send_garbage(address)
            assert b"BadMagic" in reply  # told why, by name, in an ABORT frame
            named[who] = "BadMagic"
            who, error = wrong_key_hello(address, model, expected_rank)
            assert isinstance(error, errors.BadProof), error
            named[who] = "BadProof"
        fleet.start_rank(1 - booting)
        fleet.wait_ready(WAIT_S * 2)  # with both silent strangers still connected
        assert complete(fleet) == "length"
        for sock in silent:
            named[source(sock)] = ""  # any reason: closed unauthenticated, or its deadline
            sock.close()
        found = wait_refused(fleet, booting, list(named))
        for address, reason in named.items():
            assert reason in found[address], (address, found[address])
        assert all(p.poll() is None for p in fleet.processes)
    finally:
        for sock in silent:
            sock.close()
        fleet.stop()


@pytest.mark.parametrize("victim", [1, 0])
def test_a_lost_peer_is_named_by_rank_and_listen_address(make_model, tmp_path, victim):
    model = make_model("llama", num_hidden_layers=4)
    fleet = launch(model, STAGES, run_dir=tmp_path / "run",
                   extra_env={"FLEET_KEEPALIVE_S": "0.5", "FLEET_DEAD_AFTER": "3"})
    survivor = 1 - victim
    try:
        fleet.wait_ready(WAIT_S * 2)
        os.kill(fleet.processes[victim].pid, signal.SIGKILL)
        assert fleet.processes[survivor].wait(WAIT_S) != 0
        exits = [e for e in fleet.events(survivor) if e.get("event") == "exiting"]
        assert exits, fleet.log_tail(survivor)
        reason = str(exits[-1]["reason"])
        victim_env = fleet.envs[victim]
        # Any of the links to the victim may notice first; each names the rank and an address
        # the victim listened on (its ring listener, or rank 0's control port).
        listened = {victim_env["FLEET_LISTEN"]}
        if victim == 0:
            listened.add(f"{victim_env['MASTER_ADDR']}:{victim_env['MASTER_PORT']}")
        assert any(f"rank {victim} at {address}" in reason for address in listened), reason
        assert "connected from" not in reason, reason
    finally:
        fleet.stop(grace_s=2)

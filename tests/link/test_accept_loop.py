"""The accept loop over real loopback sockets: strangers refused by address, never blocking."""

from __future__ import annotations

import hashlib
import socket
import threading
import time

import pytest

from engine.link import errors
from engine.link.accept_loop import AcceptLoop, Refusal
from engine.link.hello import Handshake
from engine.link.transport import connect, handshake, listen

KEY = b"k" * 32
FINGERPRINT = hashlib.sha256(b"checkpoint and layout").digest()
HOST = "127.0.0.1"


def shake(rank: int, key: bytes = KEY) -> Handshake:
    return Handshake(rank=rank, world=2, fingerprint=FINGERPRINT, key=key)


class Door:
    """An accept loop for rank 0 on a fresh port, recording what it refused."""

    def __init__(self, **kwargs: object) -> None:
        self.refused: list[Refusal] = []
        self.seen = threading.Condition()
        listener = listen(HOST, 0)
        self.port = listener.getsockname()[1]
        self.loop = AcceptLoop(listener, lambda: shake(0), name=f"test port {self.port}",
                               on_refused=self._on_refused, **kwargs).start()

    def _on_refused(self, refusal: Refusal) -> None:
        with self.seen:
            self.refused.append(refusal)
            self.seen.notify_all()

    def refusal_from(self, address: str, timeout_s: float = 10.0) -> Refusal:
        """The refusal of the connection from `address`, once reported."""
        with self.seen:
            assert self.seen.wait_for(
                lambda: any(r.address == address for r in self.refused), timeout_s
            ), f"{address} was never refused; refused: {self.refused}"
            return next(r for r in self.refused if r.address == address)

    def stranger(self) -> socket.socket:
        return socket.create_connection((HOST, self.port), timeout=10)


@pytest.fixture()
def door():
    doors: list[Door] = []

    def make(**kwargs: object) -> Door:
        doors.append(Door(**kwargs))
        return doors[-1]

    yield make
    for d in doors:
        d.loop.close()


def source(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"{host}:{port}"


def read_to_eof(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def real_peer(port: int, key: bytes = KEY) -> object:
    link = connect(HOST, port, deadline_s=5)
    try:
        handshake(link, shake(1, key), deadline_s=5)
    except errors.ProtocolError as error:
        return error
    return link


def test_a_silent_socket_is_closed_in_about_the_handshake_deadline(door):
    deadline_s = 0.6
    d = door(handshake_deadline_s=deadline_s)
    with d.stranger() as silent:
        address = source(silent)
        opened = time.monotonic()
        reply = read_to_eof(silent)  # our HELLO, then the ABORT, then end of stream
        waited_s = time.monotonic() - opened
    assert deadline_s * 0.9 <= waited_s < deadline_s + 1.5, waited_s
    assert b"Deadline" in reply
    assert d.refusal_from(address).reason.startswith("Deadline:")


def test_silent_and_scanning_strangers_do_not_block_the_real_peer(door):
    d = door(handshake_deadline_s=30)  # far longer than the real peer may take
    silent = [d.stranger(), d.stranger()]
    scan = d.stranger()
    scanned_from = source(scan)
    scan.close()  # connect-and-close, as a port scan does
    garbage = d.stranger()
    garbage.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(64))
    started = time.monotonic()
    peer = real_peer(d.port)
    link, hello = d.loop.next_peer(deadline_s=10)
    assert time.monotonic() - started < 5  # not held by the silent sockets' 30 s
    assert hello.rank == 1 and link.authenticated and not isinstance(peer, Exception)
    assert "BadMagic" in d.refusal_from(source(garbage)).reason
    assert d.refusal_from(scanned_from).reason.startswith("PeerClosed:")
    link.close()
    peer.close()
    d.loop.close()  # the silent ones are still waiting: closing turns them away too
    for sock in silent:
        assert "still unauthenticated when the" in d.refusal_from(source(sock)).reason
        sock.close()
    garbage.close()


def test_a_wrong_key_is_refused_and_the_loop_keeps_accepting(door):
    d = door()
    refused = real_peer(d.port, key=b"x" * 32)
    assert isinstance(refused, errors.BadProof)
    with pytest.raises(errors.Deadline):
        d.loop.next_peer(deadline_s=0.3)
    assert any("BadProof" in r.reason for r in d.refused)
    good = real_peer(d.port)
    link, hello = d.loop.next_peer(deadline_s=5)
    assert hello.rank == 1
    link.close()
    good.close()


def test_connections_past_the_pending_bound_are_closed_at_once(door):
    d = door(handshake_deadline_s=30, max_pending=2)
    held = [d.stranger(), d.stranger()]
    for sock in held:  # each has had our HELLO: both handshakes are in flight
        sock.settimeout(5)
        assert sock.recv(4096)
    with d.stranger() as third:
        opened = time.monotonic()
        third.settimeout(5)
        assert read_to_eof(third) == b""  # closed without a word
        assert time.monotonic() - opened < 3
        assert "handshakes already in progress" in d.refusal_from(source(third)).reason
    for sock in held:
        sock.close()


def test_the_boot_deadline_message_names_the_strangers(door):
    d = door()
    with d.stranger() as garbage:
        garbage.sendall(b"\xff" * 40)
        address = source(garbage)
        d.refusal_from(address)
    with pytest.raises(errors.Deadline, match=rf"refused 1 other connection, the last from "
                                             rf"{address}: BadMagic"):
        d.loop.next_peer(deadline_s=0.2)

"""The socket transport over real loopback sockets: handshake refusals, deadlines, rows."""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from collections.abc import Callable

import pytest

from engine.link import errors
from engine.link.frame import Frame, FrameHeader, FrameKind, FrameParser, encode_frame
from engine.link.hello import Handshake
from engine.link.messages import Ready, decode_abort, decode_message
from engine.link.transport import Link, accept, connect, handshake, listen
from engine.rounds import Op, RoundPlan, StreamEntry
from tests.waiting import wait_until

KEY = b"s" * 32
FINGERPRINT = hashlib.sha256(b"checkpoint and layout").digest()
HOST = "127.0.0.1"


def shake(my_rank: int, **change: object) -> Handshake:
    base = {"rank": my_rank, "world": 2, "fingerprint": FINGERPRINT, "key": KEY}
    return Handshake(**{**base, **change})


def run_pair(server: Callable[[Link], object], client: Callable[[Link], object],
             max_payload_bytes: int = 1 << 16) -> tuple[object, object]:
    """Run `server` on an accepted link in a thread and `client` on a connected one."""
    listener = listen(HOST, 0)
    port = listener.getsockname()[1]
    results: dict[str, object] = {}

    def serve() -> None:
        try:
            with accept(listener, deadline_s=2, max_payload_bytes=max_payload_bytes) as link:
                results["server"] = server(link)
        except BaseException as error:  # noqa: BLE001 - handed back to the test
            results["server"] = error

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with connect(HOST, port, deadline_s=2, max_payload_bytes=max_payload_bytes) as link:
            results["client"] = client(link)
    except BaseException as error:  # noqa: BLE001
        results["client"] = error
    thread.join(5)
    listener.close()
    assert not thread.is_alive()
    return results["server"], results["client"]


def shaking(hs: Handshake, then: Callable[[Link], object] | None = None):
    def side(link: Link) -> object:
        peer = handshake(link, hs, deadline_s=2)
        return then(link) if then else peer
    return side


def test_handshake_then_plan_rows_and_goodbye():
    plan = RoundPlan(5, (StreamEntry(1, Op.OPEN, 0, 3, 0, 0, 0),), (2,))
    rows = bytes(range(48))

    def rank0(link: Link) -> object:
        link.send_message(plan, deadline_s=1)
        link.send(FrameKind.ROWS, rows, round_no=5, rows=3, deadline_s=1)
        return link.recv(deadline_s=1)

    def rank1(link: Link) -> object:
        got = decode_message(link.recv(deadline_s=1))
        buffer = bytearray(64)
        header = link.recv_rows_into(buffer, deadline_s=1)
        link.send_message(Ready(1), deadline_s=1)
        link.send(FrameKind.GOODBYE, deadline_s=1)
        return got, header, bytes(buffer[:48]), link.peer_rank

    server, client = run_pair(shaking(shake(0), rank0), shaking(shake(1), rank1))
    assert isinstance(server, Frame) and decode_message(server) == Ready(1)
    got, header, received, peer_rank = client
    assert got == plan and peer_rank == 0
    assert header == FrameHeader(FrameKind.ROWS, 0, 5, 3, 48) and received == rows


@pytest.mark.parametrize(("server_change", "client_change", "error"), [
    ({}, {"key": b"t" * 32}, errors.BadProof),
    ({}, {"fingerprint": bytes(32)}, errors.FingerprintMismatch),
    ({"world": 3}, {"world": 3, "rank": 2}, None),  # fine: both say world 3
    ({}, {"world": 3}, errors.WorldMismatch),
])
def test_handshake_refusals_are_named_on_both_sides(server_change, client_change, error):
    server, client = run_pair(shaking(shake(0, **server_change)),
                              shaking(shake(1, **client_change)))
    if error is None:
        assert server.rank == 2 and client.rank == 0
        return
    assert type(server) is error, server
    assert type(client) is error, client


def test_unexpected_rank_is_refused_locally_and_reported_remotely():
    server, client = run_pair(shaking(shake(0, world=3, expect_peer_rank=2)),
                              shaking(shake(1, world=3)))
    assert type(server) is errors.RankMismatch and not server.remote
    assert type(client) is errors.RankMismatch and client.remote
    assert "expected rank 2" in str(client)


@pytest.mark.parametrize(("garbage", "error"), [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(8), "BadMagic"),
    (encode_frame(FrameKind.HELLO, b"not a hello"), "TruncatedPayload"),
    (encode_frame(FrameKind.PLAN, b""), "UnexpectedFrame"),
])
def test_garbage_hello_is_refused_and_the_reason_sent_back(garbage, error):
    listener = listen(HOST, 0)
    outcome: dict[str, object] = {}

    def serve() -> None:
        try:
            with accept(listener, deadline_s=2) as link:
                handshake(link, shake(0), deadline_s=2)
        except errors.ProtocolError as raised:
            outcome["server"] = raised

    thread = threading.Thread(target=serve)
    thread.start()
    with socket.create_connection(listener.getsockname(), timeout=2) as raw:
        raw.sendall(garbage)
        received = b""
        while chunk := raw.recv(4096):
            received += chunk
    thread.join(5)
    listener.close()
    assert type(outcome["server"]).__name__ == error
    parser = FrameParser(1 << 16)
    parser.feed(received)
    frames = list(parser)
    assert frames[0].kind is FrameKind.HELLO and frames[-1].kind is FrameKind.ABORT
    reported = decode_abort(frames[-1].payload)
    assert reported.error == error
    remote = errors.error_from_abort(reported.error, reported.reason)
    assert type(remote).__name__ == error and remote.remote


@pytest.mark.parametrize("host", ["", "0.0.0.0", "::", "*", "[::]"])
def test_wildcard_listen_is_refused(host):
    with pytest.raises(errors.WildcardListen):
        listen(host, 0)


def test_deadline_fires_on_a_silent_peer():
    listener = listen(HOST, 0)
    with connect(HOST, listener.getsockname()[1], deadline_s=1) as link:
        silent, _ = listener.accept()
        started = time.monotonic()
        with pytest.raises(errors.Deadline):
            handshake(link, shake(1), deadline_s=0.2)
        assert time.monotonic() - started < 1.5  # 0.2 s deadline + the abort's linger
        silent.close()
    listener.close()


def test_recv_deadline_and_link_stays_failed():
    checked = threading.Event()

    def rank0(link: Link) -> object:
        try:
            with pytest.raises(errors.Deadline):
                link.recv(deadline_s=0.2)
            with pytest.raises(errors.ConnectionFailed) as again:
                link.send(FrameKind.GO, deadline_s=1)
            return type(again.value.cause)
        finally:
            checked.set()

    def rank1(link: Link) -> object:
        checked.wait(5)  # silent, and connected, until rank 0 has seen its deadline
        return None

    server, _ = run_pair(shaking(shake(0), rank0), shaking(shake(1), rank1))
    assert server is errors.Deadline


def test_connect_retries_until_the_peer_listens(monkeypatch):
    probe = socket.socket()
    probe.bind((HOST, 0))
    port = probe.getsockname()[1]
    probe.close()
    result: dict[str, object] = {}
    refused = threading.Event()
    real_create_connection = socket.create_connection

    def watched_create_connection(*args, **kwargs):  # the real call, observed
        try:
            return real_create_connection(*args, **kwargs)
        except OSError:
            refused.set()
            raise

    monkeypatch.setattr(socket, "create_connection", watched_create_connection)

    def late_listener() -> None:
        assert refused.wait(5), "the dialler never tried"  # listen only once it was refused
        listener = listen(HOST, port)
        conn, _ = listener.accept()
        result["accepted"] = True
        conn.close()
        listener.close()

    thread = threading.Thread(target=late_listener)
    thread.start()
    with connect(HOST, port, deadline_s=2):
        pass
    thread.join(5)
    assert result["accepted"]


def test_connect_dials_again_after_joining_itself(monkeypatch):
    """Dialling a loopback port nobody listens on, the kernel may pick that port as the
    source and connect the socket to itself; the dialler must not take itself for the
    peer. The first dial is made to do so (its source port chosen), the kernel does the
    rest."""
    probe = socket.socket()
    probe.bind((HOST, 0))
    port = probe.getsockname()[1]
    probe.close()
    real_create_connection = socket.create_connection
    joined_itself, dialled_again = threading.Event(), threading.Event()

    def first_from_the_same_port(address, *args, **kwargs):
        if not joined_itself.is_set():
            sock = real_create_connection(address, *args, source_address=(HOST, port))
            assert sock.getsockname() == sock.getpeername()  # the case this test is about
            joined_itself.set()
            return sock
        dialled_again.set()
        return real_create_connection(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", first_from_the_same_port)
    accepted: dict[str, object] = {}

    def late_listener() -> None:
        # The port is free again once the dialler has let go of its first socket.
        assert dialled_again.wait(5), "the dialler did not dial again"
        listener = listen(HOST, port)
        conn, _ = listener.accept()
        accepted["from"] = conn.getpeername()
        conn.close()
        listener.close()

    thread = threading.Thread(target=late_listener)
    thread.start()
    with connect(HOST, port, deadline_s=5) as link:
        own = link._sock.getsockname()
        assert own != link._sock.getpeername()
    thread.join(5)
    assert accepted["from"] == own


def test_connect_deadline_when_nobody_listens():
    probe = socket.socket()
    probe.bind((HOST, 0))
    port = probe.getsockname()[1]
    probe.close()
    started = time.monotonic()
    with pytest.raises(errors.Deadline, match=f"{HOST}:{port}"):
        connect(HOST, port, deadline_s=0.3)
    assert time.monotonic() - started < 1.0


def test_peer_closed_and_peer_abort_after_handshake():
    def rank0(link: Link) -> object:
        link.abort(errors.GenerationMismatch("stream 3 expects generation 4; slot has 5"))
        return None

    def rank1(link: Link) -> object:
        with pytest.raises(errors.GenerationMismatch) as raised:
            link.recv(deadline_s=1)
        with pytest.raises(errors.ConnectionFailed):
            link.recv(deadline_s=1)
        return raised.value

    _, client = run_pair(shaking(shake(0), rank0), shaking(shake(1), rank1))
    assert client.remote and "generation 4" in str(client) and "rank 0" in str(client)

    def closer(link: Link) -> object:
        link.close()
        with pytest.raises(errors.ConnectionFailed):
            link.send(FrameKind.GO, deadline_s=1)

    def reader(link: Link) -> object:
        with pytest.raises(errors.PeerClosed):
            link.recv(deadline_s=1)

    run_pair(shaking(shake(0), closer), shaking(shake(1), reader))


def test_nothing_but_handshake_frames_before_authentication():
    def rank0(link: Link) -> object:
        with pytest.raises(errors.NotAuthenticated):
            link.send(FrameKind.PLAN, b"", deadline_s=1)
        return None

    run_pair(rank0, lambda link: None)

    refused = threading.Event()

    def sender(link: Link) -> object:
        link._sock.sendall(encode_frame(FrameKind.ROWS, bytes(4), rows=1))
        refused.wait(5)  # connected until the receiver has read and refused the frame

    def receiver(link: Link) -> object:
        try:
            with pytest.raises(errors.UnexpectedFrame, match="before the handshake"):
                link.recv(deadline_s=1)
        finally:
            refused.set()

    run_pair(receiver, sender)


def test_recv_rows_into_hands_other_frames_back_and_checks_the_buffer():
    read = threading.Event()

    def rank0(link: Link) -> object:
        link.send_message(RoundPlan(3, ()), deadline_s=1)
        link.send(FrameKind.ROWS, bytes(100), round_no=3, rows=1, deadline_s=1)
        read.wait(5)  # connected until rank 1 has read both frames

    def rank1(link: Link) -> object:
        try:
            first = link.recv_rows_into(bytearray(100), deadline_s=1)
            with pytest.raises(errors.RowsSizeMismatch, match="holds 50"):
                link.recv_rows_into(bytearray(50), deadline_s=1)
            return first
        finally:
            read.set()

    _, client = run_pair(shaking(shake(0), rank0), shaking(shake(1), rank1))
    assert isinstance(client, Frame) and decode_message(client) == RoundPlan(3, ())


def test_big_rows_payload_in_place():
    size = 24 << 20
    payload = memoryview(bytearray(b"\xa5" * size))

    def rank0(link: Link) -> object:
        link.send(FrameKind.ROWS, payload, round_no=9, rows=1024, deadline_s=5)
        return link.recv(deadline_s=5).kind

    def rank1(link: Link) -> object:
        buffer = bytearray(size)
        header = link.recv_rows_into(buffer, deadline_s=5)
        link.send(FrameKind.GO, deadline_s=1)
        return header.payload_length, buffer == payload

    server, client = run_pair(shaking(shake(0), rank0), shaking(shake(1), rank1),
                              max_payload_bytes=size)
    assert server is FrameKind.GO and client == (size, True)


def test_send_deadline_when_the_peer_does_not_read():
    size = 64 << 20

    sent = threading.Event()

    def rank0(link: Link) -> object:
        try:
            with pytest.raises(errors.Deadline):
                link.send(FrameKind.ROWS, bytes(size), rows=1, deadline_s=0.2)
            link.abort(errors.Deadline("stop"), linger_s=0.1)
        finally:
            sent.set()

    def rank1(link: Link) -> object:
        sent.wait(5)  # reads nothing until rank 0's send has hit its deadline

    run_pair(shaking(shake(0), rank0), shaking(shake(1), rank1), max_payload_bytes=size)


def blocked_recv(link: Link, result: dict[str, object]) -> threading.Thread:
    def run() -> None:
        try:
            link.recv(deadline_s=5)
        except errors.ProtocolError as error:
            result["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    # recv holds the receive lock while it blocks: the thread is in there, not about to be.
    wait_until(lambda: link._recv_lock.locked() or not thread.is_alive(), within_s=5,
               what="the receiving thread inside recv")
    return thread


def test_shutdown_wakes_a_blocked_receiver_with_link_closed():
    woken = threading.Event()

    def rank0(link: Link) -> object:
        try:
            result: dict[str, object] = {}
            thread = blocked_recv(link, result)
            link.shutdown()
            thread.join(2)
            return result["error"]
        finally:
            woken.set()

    def rank1(link: Link) -> object:
        woken.wait(5)  # connected and silent: only the shutdown can wake rank 0's receiver

    server, _ = run_pair(shaking(shake(0), rank0), shaking(shake(1), rank1))
    assert type(server) is errors.LinkClosed


def test_abort_from_another_thread_while_one_receives():
    def rank0(link: Link) -> object:
        result: dict[str, object] = {}
        thread = blocked_recv(link, result)
        started = time.monotonic()
        link.abort(errors.Deadline("the ring went silent"), linger_s=0.3)
        thread.join(2)
        return result["error"], time.monotonic() - started

    def rank1(link: Link) -> object:
        with pytest.raises(errors.Deadline) as raised:
            link.recv(deadline_s=2)
        return raised.value

    (error, took), client = run_pair(shaking(shake(0), rank0), shaking(shake(1), rank1))
    assert isinstance(error, errors.ProtocolError) and took < 1.0
    assert client.remote and "went silent" in str(client)


def test_a_peer_is_named_by_rank_and_listen_address_never_by_its_source_port():
    """An accepted link knows only the dialler's ephemeral port until the ring tells it
    where that rank listens; from then on every error names the rank and that address."""
    hung_up = threading.Event()

    def rank0(link: Link) -> object:
        unnamed = link.peer
        link.peer_listen = "10.1.2.3:4000"  # what rank 1 announced
        hung_up.wait(5)
        with pytest.raises(errors.PeerClosed) as closed:
            link.recv(deadline_s=2)
        return unnamed, str(closed.value)

    def rank1(link: Link) -> object:
        dialled = link.peer
        link.close()
        hung_up.set()
        return dialled

    server, client = run_pair(shaking(shake(0), rank0), shaking(shake(1), rank1))
    unnamed, closed = server
    assert unnamed.startswith("rank 1 (connected from 127.0.0.1:")
    assert closed == "rank 1 at 10.1.2.3:4000 closed the connection"
    assert client.startswith("rank 0 at 127.0.0.1:")  # dialled: the address it listens on


def test_a_framing_error_names_the_peer_that_sent_it():
    def rank0(link: Link) -> object:
        link.peer_listen = "10.1.2.3:4000"
        with pytest.raises(errors.BadMagic) as bad:
            link.recv(deadline_s=2)
        return str(bad.value)

    def rank1(link: Link) -> object:
        link._sock.sendall(b"\xff" * 32)  # past the handshake, a header that is not one
        return None  # closing now is fine: the peer reads those bytes before the end of stream

    server, _ = run_pair(shaking(shake(0), rank0), shaking(shake(1), rank1))
    assert server.endswith("(from rank 1 at 10.1.2.3:4000)")

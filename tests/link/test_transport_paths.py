"""The link's one-call paths: every frame size byte-exact through partial reads and writes,
bytes read past a frame kept for the next, one system call a frame, deadlines that fire."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from engine.link import errors
from engine.link.frame import HEADER_BYTES, Frame, FrameKind, encode_frame
from engine.link.transport import SPILL_BYTES, Link
from tests.waiting import wait_until

# Around the header's size, a decode row, the spill buffer's edge, a prompt chunk.
SIZES = [0, 1, 31, 32, 33, 512, 4096, SPILL_BYTES - HEADER_BYTES, SPILL_BYTES,
         SPILL_BYTES + 1, 65536, 1 << 20]
SMALL_BUFFER = 4096  # the kernel's socket buffers: a big frame moves in many partial calls


class CountingSocket(socket.socket):
    """A real socket that counts the calls the link makes on it."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def sendmsg(self, *args: object) -> int:
        self._count("sendmsg")
        return super().sendmsg(*args)

    def recvmsg_into(self, *args: object) -> tuple:
        self._count("recvmsg_into")
        return super().recvmsg_into(*args)

    def recv_into(self, *args: object) -> int:
        self._count("recv_into")
        return super().recv_into(*args)

    def setsockopt(self, *args: object) -> None:
        self._count("setsockopt")
        return super().setsockopt(*args)


def link_pair(buffer_bytes: int | None = None, max_payload_bytes: int = 2 << 20,
              ) -> tuple[Link, Link]:
    """Two authenticated-as-if links over a socketpair (the handshake has its own tests)."""
    a, b = socket.socketpair()
    pair = []
    for sock in (a, b):
        if buffer_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
        link = Link(CountingSocket(fileno=sock.detach()), max_payload_bytes=max_payload_bytes)
        link.authenticated = True
        pair.append(link)
    return pair[0], pair[1]


def in_thread(action) -> tuple[threading.Thread, dict[str, object]]:
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["value"] = action()
        except BaseException as error:  # noqa: BLE001 - handed back to the test
            result["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def payloads(seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(size) for size in SIZES]


@pytest.mark.parametrize("buffer_bytes", [None, SMALL_BUFFER], ids=["default", "small-buffers"])
def test_every_size_round_trips_byte_exact_between_control_frames(buffer_bytes):
    """ROWS of every size, each followed by a PLAN, sent back to back: the receiver's reads
    take headers, payloads and the next frame's first bytes in whatever pieces come."""
    sender, receiver = link_pair(buffer_bytes)
    sent = payloads(1)

    def send_all() -> None:
        for i, payload in enumerate(sent):
            sender.send(FrameKind.ROWS, payload, round_no=i, rows=len(payload) + 1,
                        deadline_s=10)
            sender.send(FrameKind.PLAN, payload[:64], round_no=i, deadline_s=10)

    thread, result = in_thread(send_all)
    target = bytearray(max(SIZES) + 100)
    for i, payload in enumerate(sent):
        header = receiver.recv_rows_into(target, deadline_s=10)
        assert (header.kind, header.round_no, header.rows, header.payload_length) == (
            FrameKind.ROWS, i, len(payload) + 1, len(payload))
        assert bytes(target[: len(payload)]) == payload
        assert receiver.recv(deadline_s=10) == Frame(FrameKind.PLAN, 0, i, 0, payload[:64])
    thread.join(10)
    assert "error" not in result


def test_frames_queued_before_the_read_are_kept_for_the_next_reads():
    """Many frames already waiting: one read takes several, the rest come from what it kept,
    through both receive paths."""
    sender, receiver = link_pair()
    rng = np.random.default_rng(2)
    sent = [rng.bytes(int(rng.integers(0, 3000))) for _ in range(60)]
    for i, payload in enumerate(sent):  # all of it fits the socket's buffer: no reader yet
        sender.send(FrameKind.ROWS, payload, round_no=i, rows=1, deadline_s=10)
    target = bytearray(1 << 20)
    for i, payload in enumerate(sent):
        if i % 3 == 2:  # a ROWS frame asked for by the generic path comes whole
            assert receiver.recv(deadline_s=5) == Frame(FrameKind.ROWS, 0, i, 1, payload)
            continue
        header = receiver.recv_rows_into(target, deadline_s=5)
        assert header.round_no == i and bytes(target[: header.payload_length]) == payload


def test_a_frame_bigger_than_the_rows_buffer_is_refused_and_fails_the_link():
    sender, receiver = link_pair()
    sender.send(FrameKind.ROWS, bytes(200), rows=1, deadline_s=5)
    with pytest.raises(errors.RowsSizeMismatch):
        receiver.recv_rows_into(bytearray(100), deadline_s=5)
    with pytest.raises(errors.ConnectionFailed):
        receiver.recv(deadline_s=5)


def test_one_system_call_a_frame_each_way_in_steady_state():
    sender, receiver = link_pair()
    row = bytes(range(256)) * 2  # one bfloat16 row of 256 values
    target = bytearray(1 << 16)

    def echo() -> None:
        for _ in range(20):
            header = receiver.recv_rows_into(target, deadline_s=5)
            receiver.send(FrameKind.ROWS, target[: header.payload_length], header.round_no,
                          1, deadline_s=5)

    thread, result = in_thread(echo)
    back = bytearray(1 << 16)
    for i in range(20):  # strictly one frame in flight: the far end answers each
        sender.send(FrameKind.ROWS, row, i, 1, deadline_s=5)
        assert sender.recv_rows_into(back, deadline_s=5).round_no == i
        assert bytes(back[: len(row)]) == row
    thread.join(5)
    assert "error" not in result
    for link in (sender, receiver):
        calls = link._sock.calls
        # The first call of each direction sets the kernel timeout; after that, none.
        assert calls == {"setsockopt": 2, "sendmsg": 20, "recvmsg_into": 20}, calls


def test_a_silent_peer_fires_the_receive_deadline():
    _sender, receiver = link_pair()
    started = time.monotonic()
    with pytest.raises(errors.Deadline, match="a frame header"):
        receiver.recv_rows_into(bytearray(512), deadline_s=0.2)
    assert 0.19 <= time.monotonic() - started < 1.5
    with pytest.raises(errors.ConnectionFailed):
        receiver.recv(deadline_s=1)


def test_a_frame_cut_short_fires_the_deadline_naming_the_payload():
    sender, receiver = link_pair()
    frame = encode_frame(FrameKind.ROWS, bytes(1000), round_no=3, rows=1)
    sender._sock.sendall(frame[: HEADER_BYTES + 400])  # the peer stalls inside a payload
    with pytest.raises(errors.Deadline, match=r"ROWS payload \(400 of 1000 bytes\)"):
        receiver.recv_rows_into(bytearray(4096), deadline_s=0.2)


def test_a_peer_that_does_not_read_fires_the_send_deadline_part_way():
    sender, _receiver = link_pair(SMALL_BUFFER)
    started = time.monotonic()
    with pytest.raises(errors.Deadline, match="sending"):
        sender.send(FrameKind.ROWS, bytes(1 << 20), rows=1, deadline_s=0.2)
    assert time.monotonic() - started < 1.5
    with pytest.raises(errors.ConnectionFailed):  # part of a frame went: no longer framed
        sender.send(FrameKind.GO, deadline_s=1)


def test_a_short_deadline_does_not_cut_a_later_longer_one_short():
    """The kernel timeout set for a short operation is shorter than a later one's deadline:
    the later call outlives it (woken early, it waits again for what is left)."""
    sender, receiver = link_pair()
    sender.send(FrameKind.GO, deadline_s=1)
    receiver.recv(deadline_s=0.05)  # arms the kernel timeout at about 50 ms
    late = threading.Timer(0.3, lambda: sender.send(FrameKind.GOODBYE, deadline_s=1))
    late.start()  # the frame comes well after 50 ms: lateness is what is under test here
    started = time.monotonic()
    assert receiver.recv(deadline_s=5).kind is FrameKind.GOODBYE
    assert time.monotonic() - started >= 0.25
    late.join()


def test_a_receiver_blocked_in_the_kernel_is_woken_by_shutdown():
    _sender, receiver = link_pair()
    thread, result = in_thread(lambda: receiver.recv_rows_into(bytearray(64), deadline_s=10))
    wait_until(lambda: receiver._recv_lock.locked() or not thread.is_alive(), within_s=5,
               what="the receiving thread inside its read")
    started = time.monotonic()
    receiver.shutdown()
    thread.join(5)
    assert type(result.get("error")) is errors.LinkClosed
    assert time.monotonic() - started < 2


@pytest.mark.parametrize("past", [1, 10, HEADER_BYTES, HEADER_BYTES + 5, HEADER_BYTES + 300],
                         ids=["1-byte", "part-header", "header", "header-and-part", "whole"])
def test_a_read_that_ends_inside_the_next_frame_leaves_it_whole(past):
    """The first read is made to end `past` bytes into the second frame (its buffer is the
    first payload plus that much): the second frame still arrives exactly, on either path."""
    sender, receiver = link_pair()
    first, second = bytes(range(200)), bytes(reversed(range(256))) + b"tail" * 11
    frames = (encode_frame(FrameKind.ROWS, first, round_no=1, rows=1)
              + encode_frame(FrameKind.ROWS, second, round_no=2, rows=1)
              + encode_frame(FrameKind.GO))
    sender._sock.sendall(frames)  # all of it waits in the socket before the first read
    target = bytearray(len(first) + past)
    header = receiver.recv_rows_into(target, deadline_s=5)
    assert header.round_no == 1 and bytes(target[: len(first)]) == first
    again = bytearray(len(second))
    header = receiver.recv_rows_into(again, deadline_s=5)
    assert header.round_no == 2 and bytes(again) == second
    assert receiver.recv(deadline_s=5).kind is FrameKind.GO


def test_an_unbounded_deadline_is_waited_for_in_bounded_kernel_steps():
    sender, receiver = link_pair()
    sender.send(FrameKind.GO, deadline_s=float("inf"))
    assert receiver.recv(deadline_s=float("inf")).kind is FrameKind.GO

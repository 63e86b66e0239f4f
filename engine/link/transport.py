"""The stage link's thin socket transport: listen, connect, accept, a blocking `Link`, handshake.

Everything protocol-shaped lives in the sans-IO modules beside this one; this file only
moves their bytes with a deadline on every read and write. Sockets block, under kernel
timeouts armed from each operation's deadline (engine.link.kernel_timeout), so a frame
costs one system call each way where the bytes allow: a sender's `sendmsg` of header and
payload views, a receiver's one read of the header with the payload's first bytes landing
straight in the caller's buffer. One thread may send while another receives on the same
`Link`. Every `deadline_s` here is a duration in seconds from the call, bounding the whole
operation (not each syscall). Any `ProtocolError` leaves the `Link` failed: later calls
raise `ConnectionFailed`.

The link authenticates but does not encrypt: it is for a trusted network only.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Self, TypeVar

from engine.link.errors import (
    ConnectionFailed,
    Deadline,
    LinkClosed,
    NotAuthenticated,
    PeerClosed,
    ProtocolError,
    RowsSizeMismatch,
    TruncatedFrame,
    UnexpectedFrame,
    error_from_abort,
)
from engine.link.frame import (
    HEADER_BYTES,
    MAX_CONTROL_PAYLOAD_BYTES,
    Buffer,
    Frame,
    FrameHeader,
    FrameKind,
    FrameParser,
    NeedMore,
    encode_frame,
    encode_header,
)
from engine.link.hello import Handshake, Hello
from engine.link.kernel_timeout import receive_timeout, send_timeout
from engine.link.messages import (
    Abort,
    Message,
    decode_abort,
    encode_abort,
    encode_message,
)
from engine.link.sockets import listen, peer_name, wait_fd

__all__ = ["Link", "accept", "connect", "handshake", "listen"]

T = TypeVar("T")


# Frames a peer may send before the handshake has finished.
_HANDSHAKE_KINDS = (FrameKind.HELLO, FrameKind.PROOF, FrameKind.ABORT)
# How long `abort` waits for the peer's end of stream after sending ABORT.
ABORT_LINGER_S = 0.5
# What one read may take beyond a frame's header when the caller gives no buffer of its
# own: a control frame (a plan, a keep-alive) then arrives in the same system call.
SPILL_BYTES = 16 * 1024


def accept(
    listener: socket.socket, *, deadline_s: float,
    max_payload_bytes: int = MAX_CONTROL_PAYLOAD_BYTES,
) -> Link:
    """The next connection on `listener` as a `Link`, or `Deadline`."""
    listener.settimeout(max(deadline_s, 1e-6))
    try:
        conn, _address = listener.accept()
    except TimeoutError:
        raise Deadline(f"no peer connected to {peer_name(listener, peer=False)} within "
                       f"{deadline_s} s") from None
    return Link(conn, max_payload_bytes=max_payload_bytes)


def connect(
    host: str, port: int, *, deadline_s: float,
    max_payload_bytes: int = MAX_CONTROL_PAYLOAD_BYTES, retry_interval_s: float = 0.05,
) -> Link:
    """Connect to a peer, retrying until the deadline (peers start in any order)."""
    end = time.monotonic() + deadline_s
    interval = retry_interval_s
    last_error: OSError | None = None
    while True:
        remaining = end - time.monotonic()
        if remaining <= 0:
            raise Deadline(f"could not connect to {host}:{port} within {deadline_s} s "
                           f"(last error: {last_error})")
        try:
            sock = _connected_to_another(socket.create_connection((host, port),
                                                                  timeout=remaining))
        except OSError as error:
            last_error = error
            time.sleep(max(0.0, min(interval, end - time.monotonic())))
            interval = min(interval * 2, 0.5)
            continue
        link = Link(sock, max_payload_bytes=max_payload_bytes)
        link.peer_listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return link


def _connected_to_another(sock: socket.socket) -> socket.socket:
    """`sock`, unless it is connected to itself: dialling a loopback port that nothing
    listens on yet, the kernel can pick that very port as the source and join the two
    ends (TCP's simultaneous open). The dialler would then read its own hello and stop
    on it; counted as refused instead, it dials again until the peer listens. The socket
    is reset rather than closed: a closed one would hold the port in TIME_WAIT, and the
    peer could not bind its listener there for a minute."""
    if sock.getsockname() == sock.getpeername():
        address = peer_name(sock, peer=False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
        raise ConnectionRefusedError(f"connected to itself at {address}")
    return sock


class Link:
    """One authenticated TCP connection to a peer stage, carrying frames with deadlines."""

    def __init__(self, sock: socket.socket, *,
                 max_payload_bytes: int = MAX_CONTROL_PAYLOAD_BYTES) -> None:
        self._sock = sock
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(True)  # each call bounded by the kernel timeouts below
        self._recv_timeout = receive_timeout(sock)
        self._send_timeout = send_timeout(sock)
        self._parser = FrameParser(max_payload_bytes)
        self._head = memoryview(bytearray(HEADER_BYTES))  # a header's bytes, read here
        self._spill = memoryview(bytearray(SPILL_BYTES))  # what one read takes beyond it
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._send_broken = False  # a send failed part way: the stream is no longer framed
        self._closed = False
        self._shut_down = False  # shutdown() or close() was called here
        self.authenticated = False
        self.peer_rank: int | None = None
        self.peer_address = peer_name(sock, peer=True)  # accepted: the peer's source port
        self.peer_listen: str | None = None  # where the peer's rank listens, once known

    @property
    def failed(self) -> ProtocolError | None:
        return self._parser.failed

    @property
    def peer(self) -> str:
        """The peer as an operator finds it: its rank and the address that rank listens on,
        never only an ephemeral source port (which names no process anyone can look up)."""
        if self.peer_rank is None:
            return self.peer_listen or f"a peer connected from {self.peer_address}"
        if self.peer_listen is not None:
            return f"rank {self.peer_rank} at {self.peer_listen}"
        return f"rank {self.peer_rank} (connected from {self.peer_address})"

    def fileno(self) -> int:
        return self._sock.fileno()

    # Sending ------------------------------------------------------------------------------

    def send(self, kind: FrameKind, payload: Buffer = b"", round_no: int = 0, rows: int = 0,
             *, deadline_s: float) -> None:
        """Send one frame: header and payload in one `sendmsg`, the payload not copied."""
        end = time.monotonic() + deadline_s
        with self._send_lock:
            self._guard(self._send_checked, kind, payload, round_no, rows, end)

    def send_message(self, message: Message, *, deadline_s: float) -> None:
        """Send a describe, ready, plan, neighbour or abort message."""
        end = time.monotonic() + deadline_s
        with self._send_lock:
            self._guard(self._send_encoded, encode_message(message), end)

    def _send_checked(self, kind: FrameKind, payload: Buffer, round_no: int, rows: int,
                      end: float) -> None:
        if not self.authenticated and kind not in _HANDSHAKE_KINDS:
            raise NotAuthenticated(f"cannot send a {FrameKind(kind).name} frame to "
                                   f"{self.peer} before the handshake")
        view = memoryview(payload).cast("B")
        header = encode_header(kind, view.nbytes, round_no=round_no, rows=rows)
        self._send_buffers([header, view], end, HEADER_BYTES + view.nbytes)

    def _send_encoded(self, data: bytes, end: float) -> None:
        kind = FrameKind(data[6])
        if not self.authenticated and kind not in _HANDSHAKE_KINDS:
            raise NotAuthenticated(f"cannot send a {kind.name} frame to {self.peer} before "
                                   "the handshake")
        self._send_buffers([data], end, len(data))

    def _send_buffers(self, views: list[Buffer], end: float, total: int) -> None:
        sent = 0
        while True:
            try:
                if not self._send_timeout.arm_until(end):
                    raise self._deadline(f"sending {total} bytes ({sent} sent)", writable=True)
                n = self._sock.sendmsg(views)
            except (BlockingIOError, InterruptedError):  # the kernel timeout passed
                self._send_timeout.expired()
                continue
            except OSError as error:
                self._send_broken = True
                raise self._pending_abort() or PeerClosed(
                    f"{self.peer} closed the connection while we sent: {error}") from None
            sent += n
            if sent == total:
                break
            self._send_broken = True  # until the whole frame is out
            views = [memoryview(v).cast("B") for v in views if len(v)]
            while n:
                head = views[0]
                if n >= head.nbytes:
                    n -= head.nbytes
                    views.pop(0)
                else:
                    views[0] = head[n:]
                    n = 0
        self._send_broken = False

    # Receiving ----------------------------------------------------------------------------

    def recv(self, *, deadline_s: float) -> Frame:
        """The next frame; ABORT raises the peer's error (remote), EOF raises `PeerClosed`."""
        end = time.monotonic() + deadline_s
        with self._recv_lock:
            return self._guard(self._recv_frame, end)

    def recv_rows_into(self, buffer: Buffer, *, deadline_s: float) -> FrameHeader | Frame:
        """Like `recv`, but a ROWS payload lands in `buffer[:header.payload_length]`.

        Returns the ROWS frame's header (the payload is in `buffer`), or any other kind of
        frame whole (a keep-alive plan may arrive between rows on a shared connection).
        Bytes past the payload may be written too (read with it, kept for the next frame).
        """
        end = time.monotonic() + deadline_s
        target = memoryview(buffer).cast("B")
        if target.readonly:
            raise ValueError("recv_rows_into needs a writable buffer")
        with self._recv_lock:
            return self._guard(self._recv_rows, target, end)

    def _recv_rows(self, target: memoryview, end: float) -> FrameHeader | Frame:
        header, part, spilled = self._read_header(end, target)
        if header.kind is not FrameKind.ROWS:
            payload = memoryview(bytearray(header.payload_length))
            self._read_payload(header, part, target, spilled, payload, end)
            return self._finish_frame(header, payload)
        if header.payload_length > target.nbytes:
            raise RowsSizeMismatch(
                f"ROWS frame of round {header.round_no} from {self.peer} carries "
                f"{header.payload_length} bytes; the rows buffer holds {target.nbytes}"
            )
        if spilled >= header.payload_length:  # the usual decode row: one read took it all
            if spilled > header.payload_length:  # and the next frame's start: keep it
                self._parser.feed(target[header.payload_length:spilled])
            return header
        self._read_payload(header, part, target, spilled, target, end)
        return header

    def _recv_frame(self, end: float) -> Frame:
        header, part, spilled = self._read_header(end, self._spill)
        payload = memoryview(bytearray(header.payload_length))
        self._read_payload(header, part, self._spill, spilled, payload, end)
        return self._finish_frame(header, payload)

    def _finish_frame(self, header: FrameHeader, payload: memoryview) -> Frame:
        frame = Frame(header.kind, header.flags, header.round_no, header.rows, bytes(payload))
        if frame.kind is FrameKind.ABORT:
            abort = decode_abort(frame.payload)
            raise error_from_abort(abort.error, f"{self.peer}: {abort.reason}")
        if self.authenticated and frame.kind in (FrameKind.HELLO, FrameKind.PROOF):
            raise UnexpectedFrame(f"a {frame.kind.name} frame from {self.peer} after the "
                                  "handshake")
        return frame

    def _read_header(self, end: float, spill: memoryview) -> tuple[FrameHeader, bytes, int]:
        """The next header; the payload's bytes the parser held (`part`); and how many
        bytes past the header the read left at `spill`'s start (`spilled`).

        A read is made only while the parser holds less than a header, all of it header
        bytes; the kernel fills the header first, so what lands in `spill` is the payload's
        start (and maybe the next frame's). At most one of `part` and `spilled` is nonzero.
        """
        parser = self._parser
        try:
            if parser.at_boundary:  # the usual case: header and payload's start, one read
                n = self._read([self._head, spill], end, "a frame header")
                if n >= HEADER_BYTES:
                    header = parser.parse_detached(self._head)
                    if self.authenticated:
                        return header, b"", n - HEADER_BYTES
                    return self._checked(header), b"", n - HEADER_BYTES
                if n:
                    parser.feed(self._head[:n])
                else:
                    parser.feed_eof()
            spilled = 0
            while isinstance(header := parser.next_header(), NeedMore):
                need = parser.bytes_needed()
                n = self._read([self._head[:need], spill], end, "a frame header")
                if n:
                    parser.feed(self._head[: min(n, need)])
                    spilled = max(0, n - need)
                else:
                    parser.feed_eof()
            header, part = parser.detach_payload()
        except ConnectionFailed:
            raise
        except ProtocolError as error:  # the sans-IO parser knows no peer: name it here
            raise self._naming_peer(error) from None
        return self._checked(header), part, spilled

    def _checked(self, header: FrameHeader) -> FrameHeader:
        if not self.authenticated and header.kind not in _HANDSHAKE_KINDS:
            raise UnexpectedFrame(f"a {header.kind.name} frame from {self.peer} before the "
                                  "handshake finished")
        return header

    def _read_payload(self, header: FrameHeader, part: bytes, spill: memoryview, spilled: int,
                      payload: memoryview, end: float) -> None:
        """Fill `payload` (the frame's length): what the parser held or the header's read
        spilled, then the rest from the socket. Spilled bytes past the payload belong to
        the next frame: the parser keeps them."""
        length = header.payload_length
        got = len(part) + min(spilled, length)
        if part:
            payload[: len(part)] = part
        elif spilled and spill is not payload:
            payload[: got] = spill[: got]
        if spilled > length:
            self._parser.feed(spill[length:spilled])
        while got < length:
            n = self._read([payload[got:length]], end, "a payload", header, got)
            if n == 0:
                raise TruncatedFrame(f"{self.peer} closed after {got} of {length} payload "
                                     f"bytes of a {header.kind.name} frame")
            got += n

    def _read(self, views: list[memoryview], end: float, doing: str,
              header: FrameHeader | None = None, got: int = 0) -> int:
        """One read into `views` in order (0: end of stream), within the deadline."""
        while True:
            try:
                if not self._recv_timeout.arm_until(end):
                    if header is not None:
                        doing = (f"a {header.kind.name} payload ({got} of "
                                 f"{header.payload_length} bytes)")
                    raise self._deadline(doing, writable=False)
                if len(views) == 1:
                    return self._sock.recv_into(views[0])
                return self._sock.recvmsg_into(views)[0]
            except (BlockingIOError, InterruptedError):  # the kernel timeout passed
                self._recv_timeout.expired()
            except OSError as error:
                raise PeerClosed(f"{self.peer} reset the connection: {error}") from None

    def _naming_peer(self, error: ProtocolError) -> ProtocolError:
        """The parser's error again, its message naming who sent the bytes."""
        message = (f"{self.peer} closed the connection" if type(error) is PeerClosed
                   else f"{error.message} (from {self.peer})")
        return type(error)(message, remote=error.remote)

    # Plumbing ---------------------------------------------------------------------------

    def _deadline(self, doing: str, *, writable: bool) -> Deadline:
        return Deadline(f"deadline passed {doing} {'to' if writable else 'from'} {self.peer}")

    def _guard(self, action: Callable[..., T], *args: object) -> T:
        """Run one operation; a failed or closed link refuses, an error fails the link."""
        if self._shut_down and self._parser.failed is None:
            self._parser.fail(LinkClosed(f"the link to {self.peer} was closed locally"))
        if self._parser.failed is not None:
            raise ConnectionFailed(self._parser.failed)
        try:
            return action(*args)
        except ProtocolError as error:
            if self._shut_down and not isinstance(error, LinkClosed):
                # Woken by our own shutdown: say so rather than blame the peer.
                closed = LinkClosed(f"the link to {self.peer} was closed locally")
                self._parser.fail(closed)
                raise closed from error
            self._parser.fail(error)
            raise

    def _pending_abort(self) -> ProtocolError | None:
        """After a failed send: did the peer say why before it hung up?"""
        if not self._recv_lock.acquire(blocking=False):
            return None  # another thread is receiving: it will see the ABORT itself
        try:
            # The link's own parser: an earlier read may have taken the ABORT already.
            parser = self._parser
            end = time.monotonic() + 0.1
            while time.monotonic() < end:
                for frame in parser:
                    if frame.kind is FrameKind.ABORT:
                        abort = decode_abort(frame.payload)
                        return error_from_abort(abort.error, f"{self.peer}: {abort.reason}")
                try:
                    data = self._sock.recv(65536, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    wait_fd(self._sock.fileno(), writable=False,
                             timeout_s=max(0.0, end - time.monotonic()))
                    continue
                if not data:
                    return None
                parser.feed(data)
        except (OSError, ValueError, ProtocolError):
            return None
        finally:
            self._recv_lock.release()
        return None

    def abort(self, error: BaseException, *, linger_s: float = ABORT_LINGER_S) -> None:
        """Tell the peer why we stop (best effort), then close without losing that message.

        Takes at most about `linger_s`. After the ABORT, the peer's end of stream is awaited:
        closing a socket with unread bytes resets the connection, which can destroy the
        ABORT before the peer reads it. Safe to call from another thread than the one
        blocked in `send` or `recv` (that one is woken and raises `LinkClosed`).
        """
        if self._closed:
            return
        end = time.monotonic() + linger_s
        if isinstance(error, ProtocolError):
            self._parser.fail(error)
        tell = not (isinstance(error, ProtocolError) and error.remote)
        if tell and self._send_lock.acquire(timeout=max(0.0, linger_s)):
            try:
                if not self._send_broken:
                    frame = encode_frame(FrameKind.ABORT, encode_abort(Abort.from_error(error)))
                    self._send_buffers([frame], end, len(frame))
            except (ProtocolError, OSError):
                pass
            finally:
                self._send_lock.release()
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        if self._recv_lock.acquire(timeout=max(0.0, end - time.monotonic())):
            try:
                self._drain(end)
            finally:
                self._recv_lock.release()
        self.close()

    def _drain(self, end: float) -> None:
        """Read and drop whatever the peer still sends, until its end of stream or `end`."""
        while time.monotonic() < end:
            try:
                if not self._sock.recv(65536, socket.MSG_DONTWAIT):
                    return
            except (BlockingIOError, InterruptedError):
                try:
                    wait_fd(self._sock.fileno(), writable=False,
                             timeout_s=max(0.0, end - time.monotonic()))
                except (OSError, ValueError):
                    return
            except OSError:
                return

    def shutdown(self) -> None:
        """Shut both directions, waking any thread blocked on this link (it raises
        `LinkClosed`); the socket stays open until `close`."""
        self._shut_down = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """Close the socket (idempotent); later sends and receives raise `ConnectionFailed`."""
        if not self._closed:
            self.shutdown()
            self._closed = True
            self._sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def handshake(link: Link, hs: Handshake, *, deadline_s: float) -> Hello:
    """Run hello and proof both ways over `link`; either side may have connected.

    A refusal is sent to the peer as ABORT (with its error name) and raised here; the link
    is then closed. On success the link is authenticated and knows the peer's rank.
    """
    end = time.monotonic() + deadline_s
    try:
        with link._send_lock:
            link._guard(lambda: link._send_encoded(hs.hello_bytes(), end))
        with link._recv_lock:
            peer = link._guard(lambda: hs.receive_hello(link._recv_frame(end)))
        with link._send_lock:
            link._guard(lambda: link._send_encoded(hs.proof_bytes(), end))
        with link._recv_lock:
            link._guard(lambda: hs.receive_proof(link._recv_frame(end)))
    except ProtocolError as error:
        cause = error.cause if isinstance(error, ConnectionFailed) else error
        if isinstance(cause, PeerClosed) or cause.remote:
            link.close()
        else:
            link.abort(cause)
        raise
    link.authenticated = True
    link.peer_rank = peer.rank
    return peer

"""The stage link's thin socket transport: listen, connect, accept, a blocking `Link`, handshake.

Everything protocol-shaped lives in the sans-IO modules beside this one; this file only
moves their bytes with a deadline on every read and write. Sockets stay non-blocking and
each operation waits with `select` for the time it has left, so one thread may send while
another receives on the same `Link`. Every `deadline_s` here is a duration in seconds
from the call, bounding the whole operation (not each syscall). Any `ProtocolError`
leaves the `Link` failed: later calls raise `ConnectionFailed`.

The link authenticates but does not encrypt: it is for a trusted network only.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Self, TypeVar

from engine.addresses import wildcard_address
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
    WildcardListen,
    error_from_abort,
)
from engine.link.frame import (
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
from engine.link.messages import (
    Abort,
    Message,
    decode_abort,
    encode_abort,
    encode_message,
    is_wildcard_host,
)

T = TypeVar("T")
# Frames a peer may send before the handshake has finished.
_HANDSHAKE_KINDS = (FrameKind.HELLO, FrameKind.PROOF, FrameKind.ABORT)
# How long `abort` waits for the peer's end of stream after sending ABORT.
ABORT_LINGER_S = 0.5


def listen(host: str, port: int, *, backlog: int = 16) -> socket.socket:
    """A listening socket on one named address; a wildcard is refused (`WildcardListen`)."""
    wildcard = wildcard_address(host)  # the one rule every listener applies
    if wildcard is not None:
        how = "" if is_wildcard_host(host) else f" (it resolves to {wildcard})"
        raise WildcardListen(
            f"refusing to listen on {host!r}:{port}{how}: the stage link binds one named "
            "address (set FLEET_LISTEN to this machine's address on the fleet network)"
        )
    family, kind, proto, _name, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(backlog)
    except BaseException:
        listener.close()
        raise
    return listener


def accept(
    listener: socket.socket, *, deadline_s: float,
    max_payload_bytes: int = MAX_CONTROL_PAYLOAD_BYTES,
) -> Link:
    """The next connection on `listener` as a `Link`, or `Deadline`."""
    listener.settimeout(max(deadline_s, 1e-6))
    try:
        conn, _address = listener.accept()
    except TimeoutError:
        raise Deadline(f"no peer connected to {_name(listener, peer=False)} within "
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
            sock = socket.create_connection((host, port), timeout=remaining)
        except OSError as error:
            last_error = error
            time.sleep(max(0.0, min(interval, end - time.monotonic())))
            interval = min(interval * 2, 0.5)
            continue
        link = Link(sock, max_payload_bytes=max_payload_bytes)
        link.peer_listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return link


def _wait_fd(fd: int, *, writable: bool, timeout_s: float) -> bool:
    """Wait until `fd` is readable (or writable); False on timeout. poll() where there is
    one, since select() refuses descriptors past FD_SETSIZE, which a big engine reaches."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLOUT if writable else select.POLLIN)
        return bool(poller.poll(max(0, int(timeout_s * 1000 + 0.999))))
    readable, ready, _ = select.select([] if writable else [fd], [fd] if writable else [], [],
                                       timeout_s)
    return bool(readable or ready)


def _name(sock: socket.socket, *, peer: bool) -> str:
    try:
        address = sock.getpeername() if peer else sock.getsockname()
    except OSError:
        return "?"
    return f"{address[0]}:{address[1]}" if isinstance(address, tuple) else str(address)


class Link:
    """One authenticated TCP connection to a peer stage, carrying frames with deadlines."""

    def __init__(self, sock: socket.socket, *,
                 max_payload_bytes: int = MAX_CONTROL_PAYLOAD_BYTES) -> None:
        self._sock = sock
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self._parser = FrameParser(max_payload_bytes)
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._send_broken = False  # a send failed part way: the stream is no longer framed
        self._closed = False
        self._shut_down = False  # shutdown() or close() was called here
        self.authenticated = False
        self.peer_rank: int | None = None
        self.peer_address = _name(sock, peer=True)  # accepted: the peer's ephemeral source port
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
        """Send one frame; a big payload goes out in place, not copied behind the header."""
        end = time.monotonic() + deadline_s
        with self._send_lock:
            self._guard(lambda: self._send_checked(kind, payload, round_no, rows, end))

    def send_message(self, message: Message, *, deadline_s: float) -> None:
        """Send a describe, ready, plan, neighbour or abort message."""
        end = time.monotonic() + deadline_s
        with self._send_lock:
            self._guard(lambda: self._send_encoded(encode_message(message), end))

    def _send_checked(self, kind: FrameKind, payload: Buffer, round_no: int, rows: int,
                      end: float) -> None:
        if not self.authenticated and kind not in _HANDSHAKE_KINDS:
            raise NotAuthenticated(f"cannot send a {FrameKind(kind).name} frame to "
                                   f"{self.peer} before the handshake")
        view = memoryview(payload).cast("B")
        header = encode_header(kind, view.nbytes, round_no=round_no, rows=rows)
        self._send_buffers([memoryview(header), view], end)

    def _send_encoded(self, data: bytes, end: float) -> None:
        kind = FrameKind(data[6])
        if not self.authenticated and kind not in _HANDSHAKE_KINDS:
            raise NotAuthenticated(f"cannot send a {kind.name} frame to {self.peer} before "
                                   "the handshake")
        self._send_buffers([memoryview(data)], end)

    def _send_buffers(self, views: list[memoryview], end: float) -> None:
        views = [v for v in views if v.nbytes]
        total = sum(v.nbytes for v in views)
        sent = 0
        while views:
            try:
                n = self._sock.sendmsg(views)
            except (BlockingIOError, InterruptedError):
                self._wait(writable=True, end=end, doing=f"sending {total} bytes ({sent} sent)")
                continue
            except OSError as error:
                self._send_broken = True
                raise self._pending_abort() or PeerClosed(
                    f"{self.peer} closed the connection while we sent: {error}") from None
            sent += n
            if n:
                self._send_broken = True  # until the whole frame is out
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
            return self._guard(lambda: self._recv_frame(end))

    def recv_rows_into(self, buffer: Buffer, *, deadline_s: float) -> FrameHeader | Frame:
        """Like `recv`, but a ROWS payload lands in `buffer[:header.payload_length]`.

        Returns the ROWS frame's header (the payload is in `buffer`), or any other kind of
        frame whole (a keep-alive plan may arrive between rows on a shared connection).
        """
        end = time.monotonic() + deadline_s
        target = memoryview(buffer).cast("B")
        if target.readonly:
            raise ValueError("recv_rows_into needs a writable buffer")
        with self._recv_lock:
            return self._guard(lambda: self._recv_rows(target, end))

    def _recv_rows(self, target: memoryview, end: float) -> FrameHeader | Frame:
        header = self._read_header(end)
        if header.kind is not FrameKind.ROWS:
            return self._finish_frame(end)
        if header.payload_length > target.nbytes:
            raise RowsSizeMismatch(
                f"ROWS frame of round {header.round_no} from {self.peer} carries "
                f"{header.payload_length} bytes; the rows buffer holds {target.nbytes}"
            )
        header, part = self._parser.detach_payload()
        target[: len(part)] = part
        self._read_exact_into(target[len(part): header.payload_length], header, end)
        return header

    def _recv_frame(self, end: float) -> Frame:
        self._read_header(end)
        return self._finish_frame(end)

    def _finish_frame(self, end: float) -> Frame:
        header, part = self._parser.detach_payload()
        payload = bytearray(header.payload_length)
        payload[: len(part)] = part
        self._read_exact_into(memoryview(payload)[len(part):], header, end)
        frame = Frame(header.kind, header.flags, header.round_no, header.rows, bytes(payload))
        if frame.kind is FrameKind.ABORT:
            abort = decode_abort(frame.payload)
            raise error_from_abort(abort.error, f"{self.peer}: {abort.reason}")
        if self.authenticated and frame.kind in (FrameKind.HELLO, FrameKind.PROOF):
            raise UnexpectedFrame(f"a {frame.kind.name} frame from {self.peer} after the "
                                  "handshake")
        return frame

    def _read_header(self, end: float) -> FrameHeader:
        while True:
            try:
                header = self._parser.next_header()
            except ConnectionFailed:
                raise
            except ProtocolError as error:  # the sans-IO parser knows no peer: name it here
                raise self._naming_peer(error) from None
            if not isinstance(header, NeedMore):
                break
            data = self._recv_some(self._parser.bytes_needed(), end, "a frame header")
            if data:
                self._parser.feed(data)
            else:
                self._parser.feed_eof()
        if not self.authenticated and header.kind not in _HANDSHAKE_KINDS:
            raise UnexpectedFrame(f"a {header.kind.name} frame from {self.peer} before the "
                                  "handshake finished")
        return header

    def _read_exact_into(self, view: memoryview, header: FrameHeader, end: float) -> None:
        got = 0
        while got < view.nbytes:
            try:
                n = self._sock.recv_into(view[got:])
            except (BlockingIOError, InterruptedError):
                self._wait(writable=False, end=end,
                           doing=f"a {header.kind.name} payload ({got} of {view.nbytes} bytes)")
                continue
            except OSError as error:
                raise PeerClosed(f"{self.peer} reset the connection: {error}") from None
            if n == 0:
                raise TruncatedFrame(f"{self.peer} closed after {got} of {view.nbytes} "
                                     f"remaining payload bytes of a {header.kind.name} frame")
            got += n

    def _recv_some(self, n: int, end: float, doing: str) -> bytes:
        while True:
            try:
                return self._sock.recv(n)
            except (BlockingIOError, InterruptedError):
                self._wait(writable=False, end=end, doing=doing)
            except OSError as error:
                raise PeerClosed(f"{self.peer} reset the connection: {error}") from None

    def _naming_peer(self, error: ProtocolError) -> ProtocolError:
        """The parser's error again, its message naming who sent the bytes."""
        message = (f"{self.peer} closed the connection" if type(error) is PeerClosed
                   else f"{error.message} (from {self.peer})")
        return type(error)(message, remote=error.remote)

    # Plumbing ---------------------------------------------------------------------------

    def _wait(self, *, writable: bool, end: float, doing: str) -> None:
        remaining = end - time.monotonic()
        fd = self._sock.fileno()
        if fd < 0:
            raise LinkClosed(f"the link to {self.peer} was closed locally")
        if remaining > 0:
            try:
                if _wait_fd(fd, writable=writable, timeout_s=remaining):
                    return
            except (OSError, ValueError):
                raise LinkClosed(f"the link to {self.peer} was closed locally") from None
        raise Deadline(f"deadline passed {doing} {'to' if writable else 'from'} {self.peer}")

    def _guard(self, action: Callable[[], T]) -> T:
        """Run one operation; a failed or closed link refuses, an error fails the link."""
        if self._shut_down and self._parser.failed is None:
            self._parser.fail(LinkClosed(f"the link to {self.peer} was closed locally"))
        if self._parser.failed is not None:
            raise ConnectionFailed(self._parser.failed)
        try:
            return action()
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
            parser = FrameParser(MAX_CONTROL_PAYLOAD_BYTES)
            end = time.monotonic() + 0.1
            while time.monotonic() < end:
                try:
                    data = self._sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    _wait_fd(self._sock.fileno(), writable=False,
                             timeout_s=max(0.0, end - time.monotonic()))
                    continue
                if not data:
                    return None
                parser.feed(data)
                for frame in parser:
                    if frame.kind is FrameKind.ABORT:
                        abort = decode_abort(frame.payload)
                        return error_from_abort(abort.error, f"{self.peer}: {abort.reason}")
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
                    self._send_buffers([memoryview(frame)], end)
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
                if not self._sock.recv(65536):
                    return
            except (BlockingIOError, InterruptedError):
                try:
                    _wait_fd(self._sock.fileno(), writable=False,
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

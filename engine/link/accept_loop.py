"""A listener's accept loop: every connection is authenticated on its own, briefly, and only
authenticated peers are handed on.

Whatever reaches a ring listener before the expected peer must not end or stall the boot:
a port scan's connect-and-close, garbage bytes, a hello with the wrong key or fingerprint,
a socket that never speaks. So each accepted connection runs the handshake in its own
thread under a short deadline of its own (`HANDSHAKE_DEADLINE_S`, far below the boot
deadline), a refusal is reported with the stranger's address and the named reason, and the
loop keeps accepting. The caller takes authenticated links from `next_peer` under its own
(boot) deadline; this module decides nothing about ranks beyond what the handshake checks.
"""

from __future__ import annotations

import queue
import socket
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

from engine.link.errors import ConnectionFailed, Deadline, ProtocolError
from engine.link.frame import MAX_CONTROL_PAYLOAD_BYTES
from engine.link.hello import HANDSHAKE_DEADLINE_S, Handshake, Hello
from engine.link.transport import Link, handshake

# Handshakes in flight at once; a connection past this is closed at once, so a flood of
# silent sockets costs a bounded number of threads (the real peer's dialler retries).
MAX_PENDING_HANDSHAKES = 32
# How often the accepting thread looks at its stop flag.
_ACCEPT_POLL_S = 0.1
# How long `close` waits for the threads it woke.
_CLOSE_JOIN_S = 2.0
# Refusals remembered for the boot's failure message (every one is reported as it happens).
_REFUSALS_KEPT = 16


@dataclass(frozen=True)
class Refusal:
    """A connection that was not admitted: who it came from and why."""

    address: str  # the connection's source, host:port
    reason: str  # "ErrorName: message"


def _reason(error: ProtocolError) -> str:
    cause = error.cause if isinstance(error, ConnectionFailed) else error
    return f"{cause.name}: {cause.message}"


def _source(conn: socket.socket, address: object) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        return f"{address[0]}:{address[1]}"
    return str(address or conn)


class AcceptLoop:
    """Accepts on `listener` (which it owns from now on) until `close`.

    `make_handshake` builds a fresh `Handshake` per connection (each needs its own nonce);
    `on_refused` is called from the handshake's thread for every connection turned away,
    including those still unauthenticated when the loop closes.
    """

    def __init__(
        self,
        listener: socket.socket,
        make_handshake: Callable[[], Handshake],
        *,
        name: str,
        on_refused: Callable[[Refusal], None] = lambda refusal: None,
        handshake_deadline_s: float = HANDSHAKE_DEADLINE_S,
        max_payload_bytes: int = MAX_CONTROL_PAYLOAD_BYTES,
        max_pending: int = MAX_PENDING_HANDSHAKES,
    ) -> None:
        self.name = name  # what this listener is, for messages ("control port 10.0.0.1:29500")
        self._listener = listener
        self._make_handshake = make_handshake
        self._on_refused = on_refused
        self._handshake_deadline_s = handshake_deadline_s
        self._max_payload_bytes = max_payload_bytes
        self._max_pending = max_pending
        self._admitted: queue.Queue[tuple[Link, Hello]] = queue.Queue()
        self._pending: set[Link] = set()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.refused = 0  # connections turned away so far
        self.refusals: deque[Refusal] = deque(maxlen=_REFUSALS_KEPT)  # the latest of them
        self._acceptor = threading.Thread(target=self._accept_until_closed,
                                          name=f"accept {name}", daemon=True)

    def start(self) -> Self:
        self._listener.settimeout(_ACCEPT_POLL_S)
        self._acceptor.start()
        return self

    def next_peer(self, *, deadline_s: float) -> tuple[Link, Hello]:
        """The next authenticated link and the hello it came with, or `Deadline`."""
        try:
            return self._admitted.get(timeout=max(deadline_s, 0.0))
        except queue.Empty:
            raise Deadline(f"no authenticated peer reached the {self.name} within "
                           f"{deadline_s:.3g} s{self._refusal_summary()}") from None

    def close(self) -> None:
        """Stop accepting, close the listener, and end every handshake still in flight."""
        self._stop.set()
        if self._acceptor.is_alive():
            self._acceptor.join(_CLOSE_JOIN_S)
        self._listener.close()
        with self._lock:
            pending, threads = list(self._pending), list(self._threads)
        for link in pending:
            link.shutdown()  # its handshake thread wakes, reports it and closes it
        for thread in threads:
            thread.join(_CLOSE_JOIN_S)
        while True:  # admitted but never taken (a duplicate rank, a boot that failed)
            try:
                link, _hello = self._admitted.get_nowait()
            except queue.Empty:
                break
            link.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # The threads ---------------------------------------------------------------------------

    def _accept_until_closed(self) -> None:
        while not self._stop.is_set():
            try:
                conn, address = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as error:  # out of descriptors, or the listener closed under us
                if self._stop.is_set():
                    return
                self._refuse(Refusal("?", f"accept failed on the {self.name}: {error}"))
                self._stop.wait(_ACCEPT_POLL_S)
                continue
            source = _source(conn, address)
            with self._lock:
                full = len(self._pending) >= self._max_pending
                if not full:
                    link = Link(conn, max_payload_bytes=self._max_payload_bytes)
                    self._pending.add(link)
                    thread = threading.Thread(target=self._authenticate, args=(link,),
                                              name=f"handshake {source}", daemon=True)
                    self._threads.add(thread)
            if full:
                conn.close()
                self._refuse(Refusal(source, f"{self._max_pending} handshakes already in "
                                             "progress on the " + self.name))
                continue
            thread.start()

    def _authenticate(self, link: Link) -> None:
        try:
            hello = handshake(link, self._make_handshake(), deadline_s=self._handshake_deadline_s)
        except ProtocolError as error:
            link.close()
            if self._stop.is_set():
                reason = f"still unauthenticated when the {self.name} closed"
            else:
                reason = _reason(error)
            self._refuse(Refusal(link.peer_address, reason))
        else:
            with self._lock:  # `close` drains the queue only after setting the flag
                closed = self._stop.is_set()
                if not closed:
                    self._admitted.put((link, hello))
            if closed:
                link.close()
                self._refuse(Refusal(link.peer_address, f"authenticated as rank {hello.rank} "
                                     f"after the {self.name} had closed"))
        finally:
            with self._lock:
                self._pending.discard(link)
                self._threads.discard(threading.current_thread())

    def _refuse(self, refusal: Refusal) -> None:
        with self._lock:
            self.refused += 1
            self.refusals.append(refusal)
        self._on_refused(refusal)

    def _refusal_summary(self) -> str:
        with self._lock:
            refused, last = self.refused, (self.refusals[-1] if self.refusals else None)
        if last is None:
            return " (nothing else connected)"
        return (f"; refused {refused} other connection{'s' * (refused != 1)}, "
                f"the last from {last.address}: {last.reason}")

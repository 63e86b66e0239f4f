"""An operation's deadline on a blocking socket, kept as the kernel's SO_RCVTIMEO / SO_SNDTIMEO.

A non-blocking socket waited on with poll() costs a reader that arrives before its bytes
three system calls a frame (a read that would block, the poll, the read again) and a poll
object built in Python each time. A blocking call under a kernel timeout costs one: the
kernel wakes it when bytes come, when the timeout passes (EAGAIN), or when the socket is
shut down. The option is written only when the timeout in force could outlast what is
left of the operation's deadline, or after it expired early, so with the same deadline
every round (the ring's case) steady state adds no system call.
"""

from __future__ import annotations

import socket
import struct
import time

# A kernel timeout may exceed what is left of a deadline by this much (the kernel rounds
# it up to its tick anyway), so a link reused with the same deadline never rewrites it.
SLACK_FRACTION = 0.01
SLACK_S = 0.002
_TIMEVAL = struct.Struct("@ll")  # struct timeval: seconds, microseconds (native longs)
# The longest timeout written: a longer (or infinite) deadline is waited for in such steps.
MAX_TIMEOUT_S = 24 * 3600.0


class KernelTimeout:
    """One direction's timeout on one socket (`SO_RCVTIMEO` or `SO_SNDTIMEO`)."""

    def __init__(self, sock: socket.socket, option: int) -> None:
        self._sock = sock
        self._option = option
        self._set_s: float | None = None  # None: unknown, the kernel's default (no timeout)

    def arm(self, remaining_s: float) -> None:
        """Make the next blocking call return within about `remaining_s` (which is > 0)."""
        current = self._set_s
        if current is not None and current <= remaining_s * (1 + SLACK_FRACTION) + SLACK_S:
            return
        # Zero would mean "no timeout": the shortest real one is a microsecond.
        micros = max(1, int(min(remaining_s, MAX_TIMEOUT_S) * 1e6))
        self._sock.setsockopt(socket.SOL_SOCKET, self._option,
                              _TIMEVAL.pack(micros // 1_000_000, micros % 1_000_000))
        self._set_s = micros / 1e6

    def arm_until(self, end: float) -> bool:
        """`arm` for what is left until `end` (time.monotonic); False once it has passed."""
        remaining = end - time.monotonic()
        if remaining <= 0:
            return False
        current = self._set_s
        if current is None or current > remaining * (1 + SLACK_FRACTION) + SLACK_S:
            self.arm(remaining)
        return True

    def expired(self) -> None:
        """The call timed out before the deadline it was armed for: arm afresh next time
        (the one in force is shorter than what is left)."""
        self._set_s = None


def receive_timeout(sock: socket.socket) -> KernelTimeout:
    return KernelTimeout(sock, socket.SO_RCVTIMEO)


def send_timeout(sock: socket.socket) -> KernelTimeout:
    return KernelTimeout(sock, socket.SO_SNDTIMEO)

"""Calibration's hop: a real stage's rows over two real stage-link endpoints on loopback.

A ring's boundary costs more than its wire time (which the link probe prices): the sender
turns its rows into bytes and sends a ROWS frame, the receiver, blocked in its read, wakes,
checks the frame against the plan and turns the bytes into its own rows. That host work is
timed here through the serving code (`Link`, `engine.pipeline.rows.receive_rows`, the
stage's `rows_to_bytes` / `rows_from_bytes`): a ping-pong with an echo in a child process,
as a ring's next stage is one (two threads of one process would time their fight over the
interpreter lock instead). Half the round trip is one hop, loopback's own wire time
included (tens of microseconds; placement adds the probed link's on top). The echo end
does no conversion of its own, so the rows' conversions count once in the two hops.

Run as the echo: `python -m agent.hop_timer PORT MAX_PAYLOAD_BYTES`.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from engine.link.errors import ProtocolError
from engine.link.frame import Frame, FrameKind
from engine.link.hello import Handshake
from engine.link.sockets import listen
from engine.link.transport import accept, connect, handshake

HOST = "127.0.0.1"
DEADLINE_S = 30.0
# The echo's key and fingerprint: nothing to protect (loopback, random rows), but the
# handshake is the serving one, so the frames that follow are framed as a ring's are.
KEY, FINGERPRINT = b"h" * 32, b"t" * 32


class HopTimer:
    """A link to an echo child, and the rounds that time a hop of a stage's rows over it."""

    def __init__(self, stage: Any, max_rows: int) -> None:
        self.stage = stage
        self.max_payload_bytes = stage.row_format.nbytes(max_rows)
        self.buffer = bytearray(self.max_payload_bytes)
        listener = listen(HOST, 0)
        try:
            port = listener.getsockname()[1]
            self.child = subprocess.Popen(
                [sys.executable, "-m", "agent.hop_timer", str(port), str(self.max_payload_bytes)],
                stdout=subprocess.DEVNULL)  # the calibration child's stdout is its protocol
            self.link = accept(listener, deadline_s=DEADLINE_S,
                               max_payload_bytes=self.max_payload_bytes)
            handshake(self.link, Handshake(rank=0, world=2, fingerprint=FINGERPRINT, key=KEY,
                                           expect_peer_rank=1), deadline_s=DEADLINE_S)
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
        self._round_no = 0

    def make_round(self, rows: int) -> Callable[[], None]:
        """Rows there and back, as a stage sends them and the next receives them: two hops."""
        from agent.stage_timer import random_row_bytes
        from engine.pipeline.rows import receive_rows

        x = self.stage.rows_from_bytes(random_row_bytes(
            rows, self.stage.row_format.hidden, self.stage.row_format.name), rows)

        def there_and_back() -> None:
            self._round_no += 1
            data = self.stage.rows_to_bytes(x)
            self.link.send(FrameKind.ROWS, data, self._round_no, rows, deadline_s=DEADLINE_S)
            receive_rows(self.link, self.stage, self._round_no, rows, DEADLINE_S, self.buffer)

        return there_and_back

    def close(self) -> None:
        """Goodbye to the echo (it exits), then the link."""
        link = getattr(self, "link", None)
        if link is not None:
            with contextlib.suppress(ProtocolError):  # a child already gone needs no goodbye
                link.send(FrameKind.GOODBYE, deadline_s=1.0)
            link.close()
        child = getattr(self, "child", None)
        if child is not None:
            try:
                child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def echo(port: int, max_payload_bytes: int) -> None:
    """The far end: every ROWS frame straight back, until the timer says goodbye."""
    link = connect(HOST, port, deadline_s=DEADLINE_S, max_payload_bytes=max_payload_bytes)
    handshake(link, Handshake(rank=1, world=2, fingerprint=FINGERPRINT, key=KEY,
                              expect_peer_rank=0), deadline_s=DEADLINE_S)
    buffer = memoryview(bytearray(max_payload_bytes))
    while not isinstance(got := link.recv_rows_into(buffer, deadline_s=3600.0), Frame):
        link.send(FrameKind.ROWS, buffer[: got.payload_length], got.round_no, got.rows,
                  deadline_s=DEADLINE_S)
    link.close()


if __name__ == "__main__":
    echo(int(sys.argv[1]), int(sys.argv[2]))

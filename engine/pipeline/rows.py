"""A round's rows between ring neighbours: received from the predecessor (checked against
the plan and format) and sent to the successor, over the TCP link or the hop's
torch.distributed group where boot moved the hop there (engine.pipeline.hop_transport)."""

from __future__ import annotations

from typing import Any

from engine.backends.base import Stage
from engine.link.errors import UnexpectedFrame
from engine.link.frame import Frame, FrameKind
from engine.link.messages import check_rows_frame
from engine.link.transport import Link
from engine.pipeline import hop_transport
from engine.pipeline.ring import Ring
from engine.pipeline.timing import RoundClock


def receive_ring_rows(ring: Ring, stage: Stage, round_no: int, n_rows: int,
                      deadline_s: float) -> Any:
    """The rows of `round_no` from the predecessor, over whichever transport its hop uses."""
    if ring.hops.into is not None:
        return hop_transport.receive_rows(ring.hops.into, stage, round_no, n_rows, deadline_s)
    return receive_rows(ring.from_prev, stage, round_no, n_rows, deadline_s, ring.rows_buffer)


def send_ring_rows(ring: Ring, stage: Stage, rows: Any, round_no: int, n_rows: int,
                   deadline_s: float, clock: RoundClock) -> None:
    """A round's rows to the successor, over whichever transport its hop uses; `clock`
    marks "to_host" (TCP: the rows to host bytes) and "send"."""
    if ring.hops.out is not None:  # torch.distributed: the device's rows, no host copy
        hop_transport.send_rows(ring.hops.out, stage, rows, round_no, deadline_s)
    else:
        data = stage.rows_to_bytes(rows)
        clock.mark("to_host")  # on a GPU: the kernels finishing, and the copy
        ring.to_next.send(FrameKind.ROWS, data, round_no, n_rows, deadline_s=deadline_s)
    clock.mark("send")


def receive_rows(link: Link, stage: Stage, round_no: int, n_rows: int, deadline_s: float,
                 buffer: bytearray | memoryview) -> Any:
    """The rows of `round_no` from the predecessor, as this stage's tensors.

    The payload lands where the stage wants what the ring would put in `buffer` (the
    buffer, or its pinned twin on CUDA), straight from the socket, and the stage copies it
    into its own tensors: one copy from the socket to the device.
    """
    landing = stage.rows_landing(buffer)
    got = link.recv_rows_into(landing, deadline_s=deadline_s)
    if isinstance(got, Frame) or got.round_no != round_no:
        kind = got.kind.name
        raise UnexpectedFrame(f"expected the rows of round {round_no} from {link.peer}, got "
                              f"{kind} of round {got.round_no}")
    rows = stage.row_format
    check_rows_frame(got, hidden=rows.hidden, planes=rows.planes, dtype=rows.dtype,
                     expect_rows=n_rows)
    return stage.rows_from_bytes(landing[: got.payload_length], n_rows)

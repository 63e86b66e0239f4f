"""Receiving a round's rows from the ring predecessor, checked against the plan and format."""

from __future__ import annotations

from typing import Any

from engine.backends.base import Stage
from engine.link.errors import UnexpectedFrame
from engine.link.frame import Frame
from engine.link.messages import check_rows_frame
from engine.link.transport import Link


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

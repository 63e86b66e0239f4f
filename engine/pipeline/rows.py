"""Moving a round's rows between ring neighbours, checked against the plan and the format."""

from __future__ import annotations

from typing import Any

from engine.backends.base import Stage
from engine.link.errors import UnexpectedFrame
from engine.link.frame import FrameKind
from engine.link.messages import Dtype, check_rows_frame
from engine.link.transport import Link


def send_rows(link: Link, stage: Stage, rows: Any, round_no: int, n_rows: int,
              deadline_s: float) -> None:
    link.send(FrameKind.ROWS, stage.rows_to_bytes(rows), round_no, n_rows,
              deadline_s=deadline_s)


def receive_rows(link: Link, stage: Stage, round_no: int, n_rows: int, deadline_s: float) -> Any:
    """The rows of `round_no` from the predecessor, as this stage's tensors."""
    frame = link.recv(deadline_s=deadline_s)
    if frame.kind is not FrameKind.ROWS or frame.round_no != round_no:
        raise UnexpectedFrame(f"expected the rows of round {round_no} from {link.peer}, got "
                              f"{frame.kind.name} of round {frame.round_no}")
    dtype = Dtype[stage.row_dtype.upper()]
    check_rows_frame(frame, hidden=stage.hidden_size, planes=stage.planes, dtype=dtype,
                     expect_rows=n_rows)
    return stage.rows_from_bytes(frame.payload, n_rows, stage.row_dtype)

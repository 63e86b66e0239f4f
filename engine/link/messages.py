"""The v0 messages (RFC 6.4): describe, ready, plan, rows sizes, neighbour and abort payloads.

Describe, ready and plan payloads start with the 8-byte TFSP prefix (u32 0x50534654, u16
protocol version 1, u8 message, u8 reserved 0); rows, neighbour and abort payloads have
none. Every decoder checks the exact payload length (`TruncatedPayload` / `TrailingBytes`),
every count against its bound before anything is allocated, and every enum and reserved
byte; the plan encoder refuses exactly what the decoder refuses. Byte offsets are in
docs/wire-format.md.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from enum import IntEnum

from engine.addresses import is_wildcard_host
from engine.backend_names import Backend, Dtype
from engine.link.errors import (
    BadAddress,
    BadChunkCuts,
    BadEntry,
    BadFlagValue,
    BadPrefix,
    BadStreamOrder,
    BadText,
    FieldOutOfRange,
    NonZeroReserved,
    ProtocolError,
    RowsSizeMismatch,
    TooManyCuts,
    TooManyStreams,
    TrailingBytes,
    TruncatedPayload,
    UnexpectedFrame,
    UnknownBackend,
    UnknownDtype,
    UnknownOp,
)
from engine.link.frame import U32_MAX, Frame, FrameHeader, FrameKind, encode_frame
from engine.rounds import Op, RoundPlan, StreamEntry

TFSP_MAGIC = 0x50534654  # little-endian bytes "TFSP"
PROTOCOL_VERSION = 1
PREFIX = struct.Struct("<IHBB")
PREFIX_BYTES = PREFIX.size  # 8

MAX_ENGINE_VERSION_BYTES = 64
MAX_STREAMS = 4096
MAX_CUTS = 4096
MAX_HOST_BYTES = 255
MAX_ERROR_NAME_BYTES = 64
MAX_ABORT_REASON_BYTES = 4096


class MessageType(IntEnum):
    """The prefix's message byte."""

    DESCRIBE = 1
    READY = 2
    PLAN = 3


# Prefix ---------------------------------------------------------------------------------


def encode_prefix(message: MessageType) -> bytes:
    return PREFIX.pack(TFSP_MAGIC, PROTOCOL_VERSION, message, 0)


def check_prefix(payload: bytes, message: MessageType) -> None:
    """Refuse a payload whose TFSP prefix is not this build's prefix for `message`."""
    if len(payload) < PREFIX_BYTES:
        raise TruncatedPayload(
            f"{message.name.lower()} payload is {len(payload)} bytes, shorter than its "
            f"{PREFIX_BYTES}-byte prefix"
        )
    magic, version, got, reserved = PREFIX.unpack_from(payload)
    if magic != TFSP_MAGIC:
        raise BadPrefix(f"payload magic is 0x{magic:08x}; expected 0x{TFSP_MAGIC:08x} (TFSP)")
    if version != PROTOCOL_VERSION:
        raise BadPrefix(f"protocol version is {version}; this build speaks {PROTOCOL_VERSION}")
    if got != message:
        raise BadPrefix(f"message byte is {got}; a {message.name} payload carries {int(message)}")
    if reserved:
        raise BadPrefix(f"prefix reserved byte is {reserved}; it must be 0")


def _exact_length(what: str, payload: bytes, expected: int) -> None:
    if len(payload) < expected:
        raise TruncatedPayload(f"{what} payload is {len(payload)} bytes; it needs {expected}")
    if len(payload) > expected:
        raise TrailingBytes(f"{what} payload is {len(payload)} bytes; it ends at {expected}")


def _u32(what: str, value: int) -> int:
    if not 0 <= value <= U32_MAX:
        raise FieldOutOfRange(f"{what} is {value}; it must fit a u32")
    return value


def _text(what: str, raw: bytes, limit: int) -> str:
    if len(raw) > limit:
        raise BadText(f"{what} is {len(raw)} bytes; the bound is {limit}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BadText(f"{what} is not UTF-8: {error.reason} at byte {error.start}") from None


def _dtype(what: str, value: int) -> Dtype:
    try:
        return Dtype(value)
    except ValueError:
        raise UnknownDtype(f"{what} byte is {value}; known: "
                           + ", ".join(f"{d.value} {d.label}" for d in Dtype)) from None


# Describe -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Describe:
    """A stage's description to rank 0 at boot (RFC 6.4, boot step 2)."""

    engine_version: str
    backend: Backend
    kv_dtype: Dtype
    rank: int
    world: int
    layer_first: int  # half-open: layers first .. end - 1
    layer_end: int
    hidden: int  # boundary format: values a row and plane
    row_dtype: Dtype
    planes: int
    prompt_chunk: int  # execution shapes
    max_rows_per_round: int
    parallel: int
    context: int
    drafter_width: int  # 0: no tap sums after the rows
    kv_rows: int  # capacity
    recurrent_states: int

    @property
    def layer_range(self) -> tuple[int, int]:
        return (self.layer_first, self.layer_end)


# rank, world, first, end, backend, kv dtype, row dtype, planes, hidden, chunk, max rows,
# parallel, context, drafter width, kv rows, recurrent states, engine version length
_DESCRIBE = struct.Struct("<IIIIBBBBIIIIIIIIH")
DESCRIBE_FIXED_BYTES = PREFIX_BYTES + _DESCRIBE.size  # 62; the engine version follows


def encode_describe(d: Describe) -> bytes:
    version = d.engine_version.encode("utf-8")
    if not 0 < len(version) <= MAX_ENGINE_VERSION_BYTES:
        raise BadText(f"engine version is {len(version)} bytes; it must be 1..64")
    if not 0 < d.planes <= 0xFF:
        raise FieldOutOfRange(f"planes is {d.planes}; it must be 1..255")
    u32 = [_u32(name, getattr(d, name)) for name in (
        "rank", "world", "layer_first", "layer_end")]
    shapes = [_u32(name, getattr(d, name)) for name in (
        "hidden", "prompt_chunk", "max_rows_per_round", "parallel", "context",
        "drafter_width", "kv_rows", "recurrent_states")]
    try:
        backend = Backend(d.backend)
    except ValueError:
        raise UnknownBackend(f"cannot encode backend {d.backend!r}") from None
    return encode_prefix(MessageType.DESCRIBE) + _DESCRIBE.pack(
        *u32, backend, _dtype("kv dtype", d.kv_dtype), _dtype("row dtype", d.row_dtype),
        d.planes, *shapes, len(version),
    ) + version


def decode_describe(payload: bytes) -> Describe:
    check_prefix(payload, MessageType.DESCRIBE)
    if len(payload) < DESCRIBE_FIXED_BYTES:
        raise TruncatedPayload(
            f"describe payload is {len(payload)} bytes; its fixed part is {DESCRIBE_FIXED_BYTES}"
        )
    (rank, world, first, end, backend, kv_dtype, row_dtype, planes, hidden, chunk, max_rows,
     parallel, context, drafter_width, kv_rows, recurrent, version_len) = _DESCRIBE.unpack_from(
        payload, PREFIX_BYTES)
    if not 0 < version_len <= MAX_ENGINE_VERSION_BYTES:
        raise BadText(f"engine version length is {version_len}; it must be 1..64")
    _exact_length("describe", payload, DESCRIBE_FIXED_BYTES + version_len)
    try:
        backend = Backend(backend)
    except ValueError:
        raise UnknownBackend(f"backend byte is {backend}; known: "
                             + ", ".join(f"{b.value} {b.label}" for b in Backend)) from None
    return Describe(
        engine_version=_text("engine version", payload[DESCRIBE_FIXED_BYTES:],
                             MAX_ENGINE_VERSION_BYTES),
        backend=backend,
        kv_dtype=_dtype("kv dtype", kv_dtype),
        rank=rank,
        world=world,
        layer_first=first,
        layer_end=end,
        hidden=hidden,
        row_dtype=_dtype("row dtype", row_dtype),
        planes=planes,
        prompt_chunk=chunk,
        max_rows_per_round=max_rows,
        parallel=parallel,
        context=context,
        drafter_width=drafter_width,
        kv_rows=kv_rows,
        recurrent_states=recurrent,
    )


# Ready ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """A stage is loaded; `warm` when it is executable for every shape it declared."""

    rank: int
    warm: bool = True


_READY = struct.Struct("<IB3s")
READY_BYTES = PREFIX_BYTES + _READY.size  # 16


def encode_ready(ready: Ready) -> bytes:
    return encode_prefix(MessageType.READY) + _READY.pack(
        _u32("rank", ready.rank), int(bool(ready.warm)), bytes(3))


def decode_ready(payload: bytes) -> Ready:
    check_prefix(payload, MessageType.READY)
    _exact_length("ready", payload, READY_BYTES)
    rank, warm, reserved = _READY.unpack_from(payload, PREFIX_BYTES)
    if warm not in (0, 1):
        raise BadFlagValue(f"ready warm flag is {warm}; it must be 0 or 1")
    if reserved != bytes(3):
        raise NonZeroReserved(f"ready reserved bytes are {reserved.hex()}")
    return Ready(rank, bool(warm))


# Plan -----------------------------------------------------------------------------------

_PLAN_COUNTS = struct.Struct("<II")  # stream count, cut count
PLAN_HEADER_BYTES = PREFIX_BYTES + _PLAN_COUNTS.size  # 16
# id, op, 3 reserved, first, rows, accepted, resume, generation
ENTRY = struct.Struct("<IB3sIIIII")
ENTRY_BYTES = ENTRY.size  # 28
CUT = struct.Struct("<I")
MAX_PLAN_BYTES = PLAN_HEADER_BYTES + MAX_STREAMS * ENTRY_BYTES + MAX_CUTS * CUT.size


def check_entry(entry: StreamEntry) -> None:
    """One entry's op rule (RFC 6.4 v0's decisions)."""
    e = entry
    where = f"stream {e.stream_id} ({Op(e.op).name.lower()})"
    if e.op == Op.OPEN and (e.first, e.accepted, e.generation) != (0, 0, 0):
        raise BadEntry(f"{where}: an open starts at position 0 with 0 accepted and "
                       f"generation 0; got first {e.first}, accepted {e.accepted}, "
                       f"generation {e.generation}")
    if e.op in (Op.CLOSE, Op.CANCEL) and e.rows:
        raise BadEntry(f"{where} carries {e.rows} rows; close and cancel carry none")
    if e.op == Op.RESUME:
        if not 0 < e.resume <= e.first:
            raise BadEntry(f"{where}: resume point {e.resume} must satisfy "
                           f"0 < resume <= first ({e.first})")
    elif e.resume:
        raise BadEntry(f"{where} names resume point {e.resume}; only resume carries one")


def check_plan(plan: RoundPlan) -> None:
    """Every rule a plan obeys on the wire; encode and decode both run it."""
    if len(plan.entries) > MAX_STREAMS:
        raise TooManyStreams(f"plan has {len(plan.entries)} streams; the bound is {MAX_STREAMS}")
    if len(plan.cuts) > MAX_CUTS:
        raise TooManyCuts(f"plan has {len(plan.cuts)} chunk cuts; the bound is {MAX_CUTS}")
    previous: int | None = None
    for entry in plan.entries:
        check_entry(entry)
        if previous is not None and entry.stream_id <= previous:
            word = "repeats" if entry.stream_id == previous else "comes after"
            raise BadStreamOrder(f"stream {entry.stream_id} {word} stream {previous}; "
                                 "ids must be strictly ascending")
        previous = entry.stream_id
    total = plan.total_rows
    last = 0
    for cut in plan.cuts:
        if not 0 < cut < total:
            raise BadChunkCuts(f"chunk cut {cut} is outside the round's {total} rows "
                               f"(0 < cut < {total})")
        if cut <= last:
            raise BadChunkCuts(f"chunk cut {cut} follows cut {last}; cuts must be strictly "
                               "ascending")
        last = cut


def encode_plan(plan: RoundPlan) -> bytes:
    """The PLAN payload; the round number rides in the frame header (`encode_message`)."""
    for entry in plan.entries:
        try:
            Op(entry.op)
        except ValueError:
            raise UnknownOp(f"stream {entry.stream_id} has op {entry.op!r}") from None
        for name in ("stream_id", "first", "rows", "accepted", "resume", "generation"):
            _u32(f"stream {entry.stream_id} {name}", getattr(entry, name))
    for cut in plan.cuts:
        _u32("chunk cut", cut)
    check_plan(plan)
    parts = [encode_prefix(MessageType.PLAN), _PLAN_COUNTS.pack(len(plan.entries), len(plan.cuts))]
    parts += [ENTRY.pack(e.stream_id, e.op, bytes(3), e.first, e.rows, e.accepted, e.resume,
                         e.generation) for e in plan.entries]
    parts += [CUT.pack(cut) for cut in plan.cuts]
    return b"".join(parts)


def decode_plan(payload: bytes, *, round_no: int) -> RoundPlan:
    check_prefix(payload, MessageType.PLAN)
    if len(payload) < PLAN_HEADER_BYTES:
        raise TruncatedPayload(f"plan payload is {len(payload)} bytes; its counts end at "
                               f"{PLAN_HEADER_BYTES}")
    streams, cuts = _PLAN_COUNTS.unpack_from(payload, PREFIX_BYTES)
    if streams > MAX_STREAMS:
        raise TooManyStreams(f"plan declares {streams} streams; the bound is {MAX_STREAMS}")
    if cuts > MAX_CUTS:
        raise TooManyCuts(f"plan declares {cuts} chunk cuts; the bound is {MAX_CUTS}")
    _exact_length(f"plan ({streams} streams, {cuts} cuts)", payload,
                  PLAN_HEADER_BYTES + streams * ENTRY_BYTES + cuts * CUT.size)
    entries = []
    for stream_id, op, reserved, first, rows, accepted, resume, generation in ENTRY.iter_unpack(
            payload[PLAN_HEADER_BYTES:PLAN_HEADER_BYTES + streams * ENTRY_BYTES]):
        try:
            op = Op(op)
        except ValueError:
            raise UnknownOp(f"stream {stream_id} has op byte {op}; known ops are "
                            + ", ".join(f"{o.value} {o.name.lower()}" for o in Op)) from None
        if reserved != bytes(3):
            raise NonZeroReserved(f"stream {stream_id} entry reserved bytes are {reserved.hex()}")
        entries.append(StreamEntry(stream_id, op, first, rows, accepted, resume, generation))
    cut_values = tuple(c for (c,) in CUT.iter_unpack(
        payload[PLAN_HEADER_BYTES + streams * ENTRY_BYTES:]))
    plan = RoundPlan(round_no=round_no, entries=tuple(entries), cuts=cut_values)
    check_plan(plan)
    return plan


# Rows -----------------------------------------------------------------------------------


def rows_payload_size(rows: int, hidden: int, planes: int, dtype: Dtype,
                      drafter_width: int = 0) -> int:
    """Bytes of a ROWS payload: plane-major rows, then fp32 tap sums when a drafter is on."""
    return rows * planes * hidden * Dtype(dtype).itemsize + rows * drafter_width * 4


def check_rows_frame(frame: Frame | FrameHeader, *, hidden: int, planes: int, dtype: Dtype,
                     drafter_width: int = 0, expect_rows: int | None = None) -> None:
    """Refuse a ROWS frame whose row count or payload length does not fit the format."""
    header = frame.header if isinstance(frame, Frame) else frame
    if header.kind is not FrameKind.ROWS:
        raise UnexpectedFrame(f"expected a ROWS frame, got {header.kind.name}")
    if expect_rows is not None and header.rows != expect_rows:
        raise RowsSizeMismatch(f"ROWS frame of round {header.round_no} carries {header.rows} "
                               f"rows; the plan has {expect_rows}")
    expected = rows_payload_size(header.rows, hidden, planes, dtype, drafter_width)
    if header.payload_length != expected:
        raise RowsSizeMismatch(
            f"ROWS frame of round {header.round_no} has a {header.payload_length}-byte payload; "
            f"{header.rows} rows x {planes} planes x {hidden} x {Dtype(dtype).label}"
            + (f" + {drafter_width} fp32 tap sums a row" if drafter_width else "")
            + f" is {expected}"
        )


# Neighbour ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Neighbour:
    """Rank 0 to a stage: where that stage's ring successor listens."""

    successor_rank: int
    host: str
    port: int


_NEIGHBOUR = struct.Struct("<IHH")  # successor rank, port, host length
NEIGHBOUR_FIXED_BYTES = _NEIGHBOUR.size  # 8; the host follows


def _check_address(host: str, port: int) -> None:
    if not host or is_wildcard_host(host):
        raise BadAddress(f"neighbour host {host!r} is empty or a wildcard")
    if port == 0:
        raise BadAddress(f"neighbour {host} has port 0")


def encode_neighbour(n: Neighbour) -> bytes:
    host = n.host.encode("utf-8")
    if len(host) > MAX_HOST_BYTES:
        raise BadText(f"neighbour host is {len(host)} bytes; the bound is {MAX_HOST_BYTES}")
    if not 0 <= n.port <= 0xFFFF:
        raise FieldOutOfRange(f"port is {n.port}; it must fit a u16")
    _check_address(n.host, n.port)
    return _NEIGHBOUR.pack(_u32("successor rank", n.successor_rank), n.port, len(host)) + host


def decode_neighbour(payload: bytes) -> Neighbour:
    if len(payload) < NEIGHBOUR_FIXED_BYTES:
        raise TruncatedPayload(f"neighbour payload is {len(payload)} bytes; its fixed part is "
                               f"{NEIGHBOUR_FIXED_BYTES}")
    rank, port, host_len = _NEIGHBOUR.unpack_from(payload)
    if host_len > MAX_HOST_BYTES:
        raise BadText(f"neighbour host length is {host_len}; the bound is {MAX_HOST_BYTES}")
    _exact_length("neighbour", payload, NEIGHBOUR_FIXED_BYTES + host_len)
    host = _text("neighbour host", payload[NEIGHBOUR_FIXED_BYTES:], MAX_HOST_BYTES)
    _check_address(host, port)
    return Neighbour(rank, host, port)


# Abort ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Abort:
    """A stage's fatal error: the `ProtocolError` class name and a human reason."""

    error: str
    reason: str

    @classmethod
    def from_error(cls, error: BaseException) -> Abort:
        name = error.name if isinstance(error, ProtocolError) else type(error).__name__
        return cls(name, str(error))


_ABORT = struct.Struct("<HH")  # error name length, reason length
ABORT_FIXED_BYTES = _ABORT.size  # 4
_ERROR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def encode_abort(abort: Abort) -> bytes:
    """The ABORT payload; a reason over the bound is cut at a character boundary."""
    if not _ERROR_NAME.fullmatch(abort.error) or len(abort.error) > MAX_ERROR_NAME_BYTES:
        raise BadText(f"abort error name {abort.error!r} is not an identifier of 1..64 chars")
    name = abort.error.encode("ascii")
    reason = abort.reason.encode("utf-8")
    if len(reason) > MAX_ABORT_REASON_BYTES:
        reason = reason[:MAX_ABORT_REASON_BYTES].decode("utf-8", "ignore").encode("utf-8")
    return _ABORT.pack(len(name), len(reason)) + name + reason


def decode_abort(payload: bytes) -> Abort:
    if len(payload) < ABORT_FIXED_BYTES:
        raise TruncatedPayload(f"abort payload is {len(payload)} bytes; its fixed part is "
                               f"{ABORT_FIXED_BYTES}")
    name_len, reason_len = _ABORT.unpack_from(payload)
    if not 0 < name_len <= MAX_ERROR_NAME_BYTES:
        raise BadText(f"abort error name length is {name_len}; it must be 1..64")
    if reason_len > MAX_ABORT_REASON_BYTES:
        raise BadText(f"abort reason length is {reason_len}; the bound is "
                      f"{MAX_ABORT_REASON_BYTES}")
    _exact_length("abort", payload, ABORT_FIXED_BYTES + name_len + reason_len)
    raw_name = payload[ABORT_FIXED_BYTES:ABORT_FIXED_BYTES + name_len]
    name = _text("abort error name", raw_name, MAX_ERROR_NAME_BYTES)
    if not name.isascii() or not _ERROR_NAME.fullmatch(name):
        raise BadText(f"abort error name {name!r} is not an ASCII identifier")
    reason = _text("abort reason", payload[ABORT_FIXED_BYTES + name_len:], MAX_ABORT_REASON_BYTES)
    return Abort(name, reason)


# Frames ---------------------------------------------------------------------------------

Message = Describe | Ready | RoundPlan | Neighbour | Abort


def encode_message(message: Message) -> bytes:
    """A whole frame for a message; a plan's round number goes into the header."""
    if isinstance(message, Describe):
        return encode_frame(FrameKind.DESCRIBE, encode_describe(message))
    if isinstance(message, Ready):
        return encode_frame(FrameKind.READY, encode_ready(message))
    if isinstance(message, RoundPlan):
        return encode_frame(FrameKind.PLAN, encode_plan(message), round_no=message.round_no)
    if isinstance(message, Neighbour):
        return encode_frame(FrameKind.NEIGHBOUR, encode_neighbour(message))
    if isinstance(message, Abort):
        return encode_frame(FrameKind.ABORT, encode_abort(message))
    raise TypeError(f"not a link message: {type(message).__name__}")


def check_empty(frame: Frame) -> None:
    """GO and GOODBYE carry nothing."""
    if frame.payload:
        raise TrailingBytes(f"a {frame.kind.name} frame carries {len(frame.payload)} payload "
                            "bytes; it carries none")


def decode_message(frame: Frame) -> Message | None:
    """The message a control frame carries (None for GO and GOODBYE).

    HELLO and PROOF belong to engine.link.hello, ROWS to the backends (`check_rows_frame`).
    """
    kind = frame.kind
    if kind is FrameKind.DESCRIBE:
        return decode_describe(frame.payload)
    if kind is FrameKind.READY:
        return decode_ready(frame.payload)
    if kind is FrameKind.PLAN:
        return decode_plan(frame.payload, round_no=frame.round_no)
    if kind is FrameKind.NEIGHBOUR:
        return decode_neighbour(frame.payload)
    if kind is FrameKind.ABORT:
        return decode_abort(frame.payload)
    if kind in (FrameKind.GO, FrameKind.GOODBYE):
        check_empty(frame)
        return None
    raise UnexpectedFrame(f"a {kind.name} frame carries no control message")

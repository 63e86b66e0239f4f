"""Stage-link framing: the 32-byte header, a frame encoder and a sans-IO frame parser.

Header, little-endian (docs/wire-format.md has the table):

    0  magic        u32  0x4B4C4652, the bytes "RFLK"
    4  version      u16  1
    6  kind         u8   FrameKind
    7  flags        u8   none defined in version 1: must be 0
    8  round        u64  the round a PLAN or ROWS frame belongs to
    16 rows         u32  row count of a ROWS frame; 0 for every other kind
    20 payload len  u32  bytes that follow the header
    24 reserved     8 bytes, zero

The parser takes bytes and hands back typed frames or `NEED_MORE`; it never touches a
socket. It checks the declared payload length against its bound from the header alone,
before it buffers a byte of the payload, and once it has raised it stays failed.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

from engine.link.errors import (
    BadMagic,
    ConnectionFailed,
    FieldOutOfRange,
    NonZeroReserved,
    PayloadTooLarge,
    PeerClosed,
    ProtocolError,
    TruncatedFrame,
    UnexpectedRowCount,
    UnknownFlags,
    UnknownKind,
    UnsupportedVersion,
)

MAGIC = b"RFLK"
MAGIC_U32 = int.from_bytes(MAGIC, "little")  # 0x4B4C4652
FRAME_VERSION = 1
HEADER = struct.Struct("<IHBBQII8s")
HEADER_BYTES = HEADER.size  # 32
RESERVED = bytes(8)
# Version 1 defines no flag: a set bit is refused rather than ignored, so a later flag
# that changes a frame's meaning can never be read by a peer that does not know it.
DEFINED_FLAGS = 0x00
# Every kind but ROWS has a small natural size (the largest is a plan of 4096 streams,
# about 128 KiB), so a peer, authenticated or not, can make us buffer at most this much
# for them whatever the receiver's rows bound is.
MAX_CONTROL_PAYLOAD_BYTES = 256 * 1024
U32_MAX = 0xFFFF_FFFF
U64_MAX = 0xFFFF_FFFF_FFFF_FFFF

Buffer = bytes | bytearray | memoryview


class FrameKind(IntEnum):
    """What a frame carries; the byte at header offset 6."""

    HELLO = 1  # rank, world, fingerprint, nonce (engine.link.hello)
    PROOF = 2  # HMAC-SHA256 over both hellos (engine.link.hello)
    DESCRIBE = 3  # a stage's description, to rank 0 (TFSP prefix, message 1)
    READY = 4  # a stage is loaded and warm, to rank 0 (TFSP prefix, message 2)
    PLAN = 5  # a round's plan, rank 0 to every stage (TFSP prefix, message 3)
    ROWS = 6  # hidden rows, stage i to stage i + 1 (no prefix)
    NEIGHBOUR = 7  # rank 0 tells a stage where its ring successor listens
    GO = 8  # rank 0: every stage is ready, rounds start (empty payload)
    ABORT = 9  # a stage's fatal error name and reason, sent before it exits
    GOODBYE = 10  # an orderly end of the link (empty payload)


class FrameHeader(NamedTuple):
    """A parsed, checked header: everything about a frame but its payload bytes.

    A named tuple, immutable like the frame: one is built for every frame received, and a
    tuple costs a fraction of a frozen dataclass's construction on the decode hot path."""

    kind: FrameKind
    flags: int
    round_no: int
    rows: int
    payload_length: int


@dataclass(frozen=True)
class Frame:
    """One whole frame."""

    kind: FrameKind
    flags: int
    round_no: int
    rows: int
    payload: bytes

    @property
    def header(self) -> FrameHeader:
        return FrameHeader(self.kind, self.flags, self.round_no, self.rows, len(self.payload))


class NeedMore:
    """The parser's answer when the bytes fed so far do not finish the next step.

    There is one instance, `NEED_MORE`; test with `isinstance(x, NeedMore)` or `x is NEED_MORE`.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_MORE"


NEED_MORE = NeedMore()
_KINDS = {kind.value: kind for kind in FrameKind}  # a header's kind byte, without an enum call


def payload_limit(kind: FrameKind, max_payload_bytes: int) -> int:
    """The largest payload a frame of `kind` may declare under a receiver's rows bound."""
    if kind is FrameKind.ROWS:
        return max_payload_bytes
    return min(max_payload_bytes, MAX_CONTROL_PAYLOAD_BYTES)


def encode_header(
    kind: FrameKind, payload_length: int, *, round_no: int = 0, rows: int = 0, flags: int = 0
) -> bytes:
    """The 32 header bytes of a frame; refuses what a conforming parser would refuse."""
    if type(kind) is not FrameKind:  # a member already is one (the hot path: no enum call)
        try:
            kind = FrameKind(kind)
        except ValueError:
            raise UnknownKind(f"cannot encode frame kind {kind!r}") from None
    if flags & ~DEFINED_FLAGS or not 0 <= flags <= 0xFF:
        raise UnknownFlags(f"cannot encode flags 0x{flags:x}: version 1 defines none")
    if not 0 <= round_no <= U64_MAX:
        raise FieldOutOfRange(f"round {round_no} does not fit a u64")
    if not 0 <= rows <= U32_MAX:
        raise FieldOutOfRange(f"row count {rows} does not fit a u32")
    if rows and kind is not FrameKind.ROWS:
        raise UnexpectedRowCount(f"a {kind.name} frame cannot carry a row count ({rows})")
    if not 0 <= payload_length <= U32_MAX:
        raise PayloadTooLarge(f"payload of {payload_length} bytes does not fit a u32 length")
    if kind is not FrameKind.ROWS and payload_length > MAX_CONTROL_PAYLOAD_BYTES:
        raise PayloadTooLarge(
            f"{kind.name} payload of {payload_length} bytes exceeds the control bound "
            f"of {MAX_CONTROL_PAYLOAD_BYTES}"
        )
    return HEADER.pack(MAGIC_U32, FRAME_VERSION, kind, flags, round_no, rows, payload_length,
                       RESERVED)


def encode_frame(
    kind: FrameKind, payload: Buffer = b"", *, round_no: int = 0, rows: int = 0, flags: int = 0
) -> bytes:
    """A whole frame: header then payload (copies; the transport sends big ones in place)."""
    view = memoryview(payload).cast("B")
    return encode_header(kind, view.nbytes, round_no=round_no, rows=rows, flags=flags) + view


def parse_header(data: Buffer, *, max_payload_bytes: int) -> FrameHeader:
    """Check and decode exactly 32 header bytes; raises the named error for the first fault."""
    if len(data) != HEADER_BYTES:
        raise ValueError(f"parse_header takes exactly {HEADER_BYTES} bytes, not {len(data)}")
    magic, version, kind, flags, round_no, rows, length, reserved = HEADER.unpack(data)
    if magic != MAGIC_U32:
        raise BadMagic(
            f"frame magic is 0x{magic:08x} ({magic.to_bytes(4, 'little')!r}); "
            f"expected 0x{MAGIC_U32:08x} ({MAGIC!r})"
        )
    if version != FRAME_VERSION:
        raise UnsupportedVersion(f"frame version is {version}; this build speaks {FRAME_VERSION}")
    known = _KINDS.get(kind)
    if known is None:
        raise UnknownKind(f"frame kind byte is {kind}; known kinds are 1..{max(FrameKind)}")
    kind = known
    if flags & ~DEFINED_FLAGS:
        raise UnknownFlags(f"{kind.name} frame sets flags 0x{flags:02x}; version 1 defines none")
    if reserved != RESERVED:
        raise NonZeroReserved(f"{kind.name} frame header reserved bytes are {reserved.hex()}")
    if rows and kind is not FrameKind.ROWS:
        raise UnexpectedRowCount(f"a {kind.name} frame carries a row count of {rows}")
    limit = max_payload_bytes if kind is FrameKind.ROWS else min(max_payload_bytes,
                                                                 MAX_CONTROL_PAYLOAD_BYTES)
    if length > limit:  # payload_limit's rule, inline: this runs once a frame
        raise PayloadTooLarge(
            f"{kind.name} frame declares a {length}-byte payload; the bound is {limit}"
        )
    return FrameHeader(kind, flags, round_no, rows, length)


class FrameParser:
    """Sans-IO: `feed` bytes in, take `Frame`s (or `NEED_MORE`) out.

    `bytes_needed()` says how many more bytes finish the current header or payload, so a
    transport can read exactly that much. For big ROWS payloads, `next_header()` then
    `detach_payload()` let the caller read the payload into its own buffer.
    """

    def __init__(self, max_payload_bytes: int) -> None:
        if max_payload_bytes < 0:
            raise ValueError(f"max_payload_bytes must be >= 0, not {max_payload_bytes}")
        self.max_payload_bytes = max_payload_bytes
        self._buffer = bytearray()
        self._header: FrameHeader | None = None
        self._eof = False
        self._failed: ProtocolError | None = None

    @property
    def failed(self) -> ProtocolError | None:
        """The error that failed this parser, if any."""
        return self._failed

    @property
    def buffered(self) -> int:
        """Bytes fed but not yet handed back as part of a frame."""
        return len(self._buffer)

    def fail(self, error: ProtocolError) -> None:
        """Mark the stream failed from outside (a transport's deadline, a refused hello)."""
        if self._failed is None:
            self._failed = error

    def feed(self, data: Buffer) -> None:
        self._check_alive()
        if self._eof:
            raise RuntimeError("feed() after feed_eof()")
        self._buffer += data

    def feed_eof(self) -> None:
        """The peer closed its side: no more bytes will come."""
        self._eof = True

    def bytes_needed(self) -> int:
        """Bytes still missing to finish the current header or payload (0: ready now)."""
        if self._header is None:
            return max(0, HEADER_BYTES - len(self._buffer))
        return max(0, self._header.payload_length - len(self._buffer))

    def next_header(self) -> FrameHeader | NeedMore:
        """Parse (once) and return the next frame's header, before its payload is here."""
        self._check_alive()
        if self._header is None:
            if len(self._buffer) < HEADER_BYTES:
                return self._need_more()
            try:
                self._header = parse_header(
                    bytes(self._buffer[:HEADER_BYTES]), max_payload_bytes=self.max_payload_bytes
                )
            except ProtocolError as error:
                self._failed = error
                raise
            del self._buffer[:HEADER_BYTES]
        return self._header

    def parse_detached(self, data: Buffer) -> FrameHeader:
        """Check a whole header the caller read straight from the stream, at a frame
        boundary (nothing buffered); its payload is the caller's to read, as after
        `detach_payload`. A bad header fails the parser as `next_header` would."""
        self._check_alive()
        if self._header is not None or self._buffer:
            raise RuntimeError("parse_detached() with bytes buffered: use next_header()")
        try:
            return parse_header(data, max_payload_bytes=self.max_payload_bytes)
        except ProtocolError as error:
            self._failed = error
            raise

    @property
    def at_boundary(self) -> bool:
        """Nothing buffered and no header pending: the next byte read starts a header."""
        return self._header is None and not self._buffer

    def next_frame(self) -> Frame | NeedMore:
        """The next whole frame, or `NEED_MORE`; extra bytes stay for the frame after."""
        header = self.next_header()
        if isinstance(header, NeedMore):
            return header
        if len(self._buffer) < header.payload_length:
            return self._need_more()
        payload = bytes(self._buffer[: header.payload_length])
        del self._buffer[: header.payload_length]
        self._header = None
        return Frame(header.kind, header.flags, header.round_no, header.rows, payload)

    def detach_payload(self) -> tuple[FrameHeader, bytes]:
        """Hand the current frame's payload to the caller: (header, the part already fed).

        Call after `next_header()` returned a header. The caller must read the remaining
        `header.payload_length - len(part)` bytes itself, before it feeds anything else.
        """
        self._check_alive()
        header = self._header
        if header is None:
            raise RuntimeError("detach_payload() before next_header() returned a header")
        part = bytes(self._buffer[: header.payload_length])
        del self._buffer[: len(part)]
        self._header = None
        return header, part

    def __iter__(self) -> Iterator[Frame]:
        """Every whole frame buffered now."""
        while True:
            frame = self.next_frame()
            if isinstance(frame, NeedMore):
                return
            yield frame

    def _need_more(self) -> NeedMore:
        if not self._eof:
            return NEED_MORE
        if self._header is None and not self._buffer:
            error: ProtocolError = PeerClosed("peer closed the connection")
        elif self._header is None:
            error = TruncatedFrame(
                f"stream ended after {len(self._buffer)} of {HEADER_BYTES} header bytes"
            )
        else:
            error = TruncatedFrame(
                f"stream ended after {len(self._buffer)} of {self._header.payload_length} "
                f"payload bytes of a {self._header.kind.name} frame"
            )
        self._failed = error
        raise error

    def _check_alive(self) -> None:
        if self._failed is not None:
            raise ConnectionFailed(self._failed)

"""Frame header encoding and the sans-IO frame parser: errors, bounds, failure that sticks."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.link import errors
from engine.link.frame import (
    HEADER,
    HEADER_BYTES,
    MAGIC_U32,
    MAX_CONTROL_PAYLOAD_BYTES,
    NEED_MORE,
    Frame,
    FrameKind,
    FrameParser,
    NeedMore,
    encode_frame,
    encode_header,
    parse_header,
)

BOUND = 1 << 16


def header(kind: int = FrameKind.GO, length: int = 0, *, magic: int = MAGIC_U32,
           version: int = 1, flags: int = 0, round_no: int = 0, rows: int = 0,
           reserved: bytes = bytes(8)) -> bytes:
    return HEADER.pack(magic, version, kind, flags, round_no, rows, length, reserved)


def test_header_is_32_bytes_little_endian():
    data = encode_frame(FrameKind.ROWS, b"abcd", round_no=0x0102030405060708, rows=2)
    assert len(data) == HEADER_BYTES + 4
    assert data[:4] == b"RFLK"
    assert data[4:6] == b"\x01\x00"
    assert data[6] == FrameKind.ROWS and data[7] == 0
    assert data[8:16] == bytes.fromhex("0807060504030201")
    assert data[16:20] == b"\x02\x00\x00\x00"
    assert data[20:24] == b"\x04\x00\x00\x00"
    assert data[24:32] == bytes(8)
    assert data[32:] == b"abcd"


@pytest.mark.parametrize("kind", list(FrameKind))
def test_round_trip_every_kind(kind):
    rows = 3 if kind is FrameKind.ROWS else 0
    data = encode_frame(kind, b"xyz", round_no=42, rows=rows)
    parser = FrameParser(BOUND)
    parser.feed(data)
    assert parser.next_frame() == Frame(kind, 0, 42, rows, b"xyz")
    assert parser.next_frame() is NEED_MORE


@pytest.mark.parametrize(("data", "error"), [
    (header(magic=0x4B4C4653), errors.BadMagic),
    (header(version=0), errors.UnsupportedVersion),
    (header(version=2), errors.UnsupportedVersion),
    (header(kind=0), errors.UnknownKind),
    (header(kind=11), errors.UnknownKind),
    (header(flags=0x80), errors.UnknownFlags),
    (header(reserved=b"\x01" + bytes(7)), errors.NonZeroReserved),
    (header(kind=FrameKind.PLAN, rows=1), errors.UnexpectedRowCount),
    (header(kind=FrameKind.ROWS, length=BOUND + 1, rows=1), errors.PayloadTooLarge),
    (header(kind=FrameKind.PLAN, length=MAX_CONTROL_PAYLOAD_BYTES + 1), errors.PayloadTooLarge),
])
def test_bad_headers_raise_named_errors_and_stay_failed(data, error):
    # A huge rows bound shows the control bound still holds for the PLAN case.
    parser = FrameParser(BOUND if data[6] == FrameKind.ROWS else 1 << 30)
    parser.feed(data)
    with pytest.raises(error) as raised:
        parser.next_frame()
    assert raised.value.remote is False
    assert parser.failed is raised.value
    with pytest.raises(errors.ConnectionFailed) as again:
        parser.next_frame()
    assert again.value.cause is raised.value
    with pytest.raises(errors.ConnectionFailed):
        parser.feed(b"more")


def test_payload_too_large_is_raised_from_the_header_alone():
    parser = FrameParser(BOUND)
    parser.feed(header(FrameKind.ROWS, 0xFFFF_FFFF, rows=1))  # no payload byte follows
    with pytest.raises(errors.PayloadTooLarge, match="4294967295"):
        parser.next_frame()


def test_control_bound_applies_whatever_the_rows_bound():
    assert parse_header(header(FrameKind.ROWS, 1 << 24, rows=1),
                        max_payload_bytes=1 << 25).payload_length == 1 << 24
    with pytest.raises(errors.PayloadTooLarge):
        parse_header(header(FrameKind.HELLO, 1 << 24), max_payload_bytes=1 << 25)


def test_byte_by_byte_and_leftovers_stay_for_the_next_frame():
    first = encode_frame(FrameKind.PLAN, b"p" * 10, round_no=1)
    second = encode_frame(FrameKind.ROWS, b"r" * 7, round_no=1, rows=1)
    parser = FrameParser(BOUND)
    frames = []
    for byte in first + second[:5]:
        parser.feed(bytes([byte]))
        frames.extend(parser)
    assert [f.kind for f in frames] == [FrameKind.PLAN]
    assert parser.buffered == 5
    parser.feed(second[5:])
    assert parser.next_frame() == Frame(FrameKind.ROWS, 0, 1, 1, b"r" * 7)


def test_bytes_needed_and_detach_payload():
    parser = FrameParser(BOUND)
    data = encode_frame(FrameKind.ROWS, bytes(range(100)), rows=1)
    assert parser.bytes_needed() == 32
    parser.feed(data[:40])
    found = parser.next_header()
    assert not isinstance(found, NeedMore) and found.payload_length == 100
    assert parser.bytes_needed() == 92
    found_header, part = parser.detach_payload()
    assert found_header == found and part == bytes(range(8))
    assert parser.bytes_needed() == 32 and parser.buffered == 0


def test_detach_keeps_bytes_past_the_payload():
    parser = FrameParser(BOUND)
    parser.feed(encode_frame(FrameKind.GO) + encode_frame(FrameKind.GOODBYE))
    parser.next_header()
    assert parser.detach_payload()[1] == b""
    assert parser.next_frame().kind is FrameKind.GOODBYE


def test_end_of_stream():
    parser = FrameParser(BOUND)
    parser.feed_eof()
    with pytest.raises(errors.PeerClosed):
        parser.next_frame()
    parser = FrameParser(BOUND)
    parser.feed(encode_frame(FrameKind.GO) + b"RFL")
    parser.feed_eof()
    assert parser.next_frame().kind is FrameKind.GO
    with pytest.raises(errors.TruncatedFrame, match="3 of 32 header bytes"):
        parser.next_frame()


@pytest.mark.parametrize(("call", "error"), [
    (lambda: encode_header(FrameKind.GO, 0, rows=1), errors.UnexpectedRowCount),
    (lambda: encode_header(FrameKind.GO, 0, flags=1), errors.UnknownFlags),
    (lambda: encode_header(99, 0), errors.UnknownKind),  # type: ignore[arg-type]
    (lambda: encode_header(FrameKind.PLAN, 0, round_no=-1), errors.FieldOutOfRange),
    (lambda: encode_header(FrameKind.PLAN, 0, round_no=1 << 64), errors.FieldOutOfRange),
    (lambda: encode_header(FrameKind.ROWS, 1 << 32, rows=1), errors.PayloadTooLarge),
    (lambda: encode_header(FrameKind.PLAN, MAX_CONTROL_PAYLOAD_BYTES + 1),
     errors.PayloadTooLarge),
])
def test_encoder_refuses_what_the_parser_refuses(call, error):
    with pytest.raises(error):
        call()


def test_encode_frame_takes_memoryviews_of_any_format():
    values = memoryview(struct.pack("<4H", 1, 2, 3, 4)).cast("H")
    data = encode_frame(FrameKind.ROWS, values, rows=1)
    assert data[20:24] == b"\x08\x00\x00\x00" and data[32:] == struct.pack("<4H", 1, 2, 3, 4)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.binary(max_size=80), max_size=6), st.booleans())
def test_fuzz_any_bytes_parse_or_raise_protocol_error(chunks, end):
    parser = FrameParser(256)
    try:
        for chunk in chunks:
            parser.feed(chunk)
            for frame in parser:
                assert isinstance(frame, Frame)
        if end:
            parser.feed_eof()
            list(parser)
    except errors.ProtocolError:
        with pytest.raises(errors.ConnectionFailed):
            parser.next_frame()


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(list(FrameKind)), st.binary(max_size=64), st.integers(0, 2**64 - 1),
       st.integers(0, 2**32 - 1))
def test_fuzz_round_trip(kind, payload, round_no, rows):
    rows = rows if kind is FrameKind.ROWS else 0
    parser = FrameParser(64)
    parser.feed(encode_frame(kind, payload, round_no=round_no, rows=rows))
    assert parser.next_frame() == Frame(kind, 0, round_no, rows, payload)

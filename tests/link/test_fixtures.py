"""The golden bytes: the encoders reproduce them, and each reads back as its manifest says."""

from __future__ import annotations

import json

import pytest

from engine.harness.make_fixtures import (
    FIXTURE_DIR,
    FIXTURE_MAX_PAYLOAD_BYTES,
    MANIFEST,
    Fixture,
    build,
    decode_fixture,
    manifest_text,
    to_jsonable,
)
from engine.link import errors
from engine.link.frame import HEADER_BYTES, NEED_MORE, Frame, FrameParser, NeedMore

FIXTURES = build()
BY_NAME = {f.name: f for f in FIXTURES}
ENTRIES = json.loads((FIXTURE_DIR / MANIFEST).read_text(encoding="utf-8"))["fixtures"]
# Bytes that start, but do not finish, another frame's header.
EXTRA = b"RFLK\x01\x00"


def test_files_on_disk_are_exactly_what_the_encoders_make():
    on_disk = {p.name for p in FIXTURE_DIR.iterdir()}
    assert on_disk == {f.name for f in FIXTURES} | {MANIFEST}
    for fixture in FIXTURES:
        assert (FIXTURE_DIR / fixture.name).read_bytes() == fixture.data, fixture.name
    assert (FIXTURE_DIR / MANIFEST).read_text(encoding="utf-8") == manifest_text(FIXTURES)


def test_manifest_names_real_errors_and_covers_every_message():
    assert [e["file"] for e in ENTRIES] == [f.name for f in FIXTURES]
    for entry in ENTRIES:
        if entry["stage"] != "ok":
            cls = errors.error_class(entry["raises"])
            assert cls is not None and issubclass(cls, errors.ProtocolError), entry
    good = {e["message"] for e in ENTRIES if e["stage"] == "ok"}
    assert good == {"hello", "proof", "describe", "ready", "plan", "neighbour", "abort", "rows",
                    "empty"}
    assert sum(1 for f in FIXTURES if f.stage != "ok") >= 40
    assert all(len(f.data) <= 512 for f in FIXTURES)


def feed(parser: FrameParser, data: bytes, chunk: int) -> list[Frame]:
    frames: list[Frame] = []
    for start in range(0, len(data), chunk):
        parser.feed(data[start:start + chunk])
        frames.extend(parser)
    return frames


def check(fixture: Fixture, data: bytes, chunk: int) -> FrameParser:
    """Read `data` in `chunk`-byte pieces and hold the fixture to its manifest entry."""
    parser = FrameParser(FIXTURE_MAX_PAYLOAD_BYTES)
    error = errors.error_class(fixture.raises) if fixture.raises else None
    if fixture.stage == "frame":
        with pytest.raises(error) as raised:
            feed(parser, data, chunk)
        assert not raised.value.remote
        if chunk == 1:  # refused from the header alone: not one payload byte was taken
            assert parser.buffered == HEADER_BYTES
        with pytest.raises(errors.ConnectionFailed):
            parser.next_frame()
        return parser
    frames = feed(parser, data, chunk)
    if fixture.stage == "eof":
        assert frames == [] and parser.next_frame() is NEED_MORE
        parser.feed_eof()
        with pytest.raises(error):
            parser.next_frame()
        return parser
    assert len(frames) == 1
    frame = frames[0]
    if fixture.stage == "payload":
        with pytest.raises(error):
            decode_fixture(frame, fixture.message)
        return parser
    value = decode_fixture(frame, fixture.message)
    assert value == fixture.value
    entry = ENTRIES[FIXTURES.index(fixture)]
    assert to_jsonable(value) == entry["decodes_to"]
    assert {"kind": frame.kind.name, "round": frame.round_no, "rows": frame.rows,
            "payload_length": len(frame.payload)} == entry["frame"]
    return parser


@pytest.mark.parametrize("name", list(BY_NAME))
def test_fixture_fed_whole(name):
    check(BY_NAME[name], BY_NAME[name].data, len(BY_NAME[name].data) or 1)


@pytest.mark.parametrize("name", list(BY_NAME))
def test_fixture_fed_byte_by_byte(name):
    check(BY_NAME[name], BY_NAME[name].data, 1)


@pytest.mark.parametrize("name", [f.name for f in FIXTURES if f.stage in ("ok", "payload")])
def test_fixture_followed_by_more_bytes_leaves_them_for_the_next_frame(name):
    parser = check(BY_NAME[name], BY_NAME[name].data + EXTRA, 7)
    assert parser.buffered == len(EXTRA)
    assert isinstance(parser.next_frame(), NeedMore)


def reframe(frame: Frame, payload: bytes) -> Frame:
    return Frame(frame.kind, frame.flags, frame.round_no, frame.rows, payload)


@pytest.mark.parametrize("name", [f.name for f in FIXTURES if f.stage == "ok"])
def test_a_payload_one_byte_long_or_short_is_refused(name):
    fixture = BY_NAME[name]
    parser = FrameParser(FIXTURE_MAX_PAYLOAD_BYTES)
    parser.feed(fixture.data)
    frame = parser.next_frame()
    assert isinstance(frame, Frame)
    rows = fixture.message == "rows"
    with pytest.raises(errors.RowsSizeMismatch if rows else errors.TrailingBytes):
        decode_fixture(reframe(frame, frame.payload + b"\x00"), fixture.message)
    if frame.payload:
        with pytest.raises(errors.RowsSizeMismatch if rows else errors.TruncatedPayload):
            decode_fixture(reframe(frame, frame.payload[:-1]), fixture.message)

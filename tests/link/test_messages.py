"""The v0 messages: prefix, describe, ready, plan rules both ways, rows sizes, neighbour, abort."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.addresses import is_wildcard_host
from engine.backend_names import Backend, Dtype
from engine.harness.make_fixtures import DESCRIBE, PLAN
from engine.link import errors
from engine.link.frame import MAX_CONTROL_PAYLOAD_BYTES, Frame, FrameKind, FrameParser
from engine.link.messages import (
    ENTRY_BYTES,
    MAX_PLAN_BYTES,
    Abort,
    Neighbour,
    Ready,
    check_rows_frame,
    decode_abort,
    decode_describe,
    decode_message,
    decode_neighbour,
    decode_plan,
    decode_ready,
    encode_abort,
    encode_describe,
    encode_message,
    encode_neighbour,
    encode_plan,
    encode_ready,
    rows_payload_size,
)
from engine.rounds import Op, RoundPlan, StreamEntry

U32 = st.integers(0, 2**32 - 1)


def frame_of(data: bytes) -> Frame:
    parser = FrameParser(1 << 20)
    parser.feed(data)
    frame = parser.next_frame()
    assert isinstance(frame, Frame)
    return frame


def test_prefix_is_tfsp():
    payload = encode_plan(RoundPlan(1, ()))
    assert payload[:4] == b"TFSP" and payload[4:6] == b"\x01\x00"
    assert payload[6] == 3 and payload[7] == 0
    assert encode_describe(DESCRIBE)[6] == 1 and encode_ready(Ready(0))[6] == 2


def test_describe_round_trip_and_offsets():
    payload = encode_describe(DESCRIBE)
    assert decode_describe(payload) == DESCRIBE
    assert len(payload) == 62 + len(DESCRIBE.engine_version)
    assert int.from_bytes(payload[28:32], "little") == DESCRIBE.hidden
    assert payload[24] == Backend.TORCH_CUDA and payload[27] == DESCRIBE.planes
    assert int.from_bytes(payload[56:60], "little") == DESCRIBE.recurrent_states
    assert payload[62:] == b"0.1.0"


def test_backend_and_dtype_labels():
    assert [b.label for b in Backend] == [
        "torch-cuda", "torch-mps", "torch-cpu", "mlx-metal", "mlx-cuda", "mlx-cpu"]
    assert Backend.from_label("mlx-metal") is Backend.MLX_METAL
    with pytest.raises(ValueError, match="known"):
        Backend.from_label("tpu")
    assert [d.itemsize for d in Dtype] == [4, 2, 2]


@pytest.mark.parametrize(("change", "error"), [
    ({"engine_version": ""}, errors.BadText),
    ({"engine_version": "v" * 65}, errors.BadText),
    ({"planes": 0}, errors.FieldOutOfRange),
    ({"planes": 256}, errors.FieldOutOfRange),
    ({"hidden": -1}, errors.FieldOutOfRange),
    ({"kv_rows": 2**32}, errors.FieldOutOfRange),
    ({"backend": 9}, errors.UnknownBackend),
    ({"row_dtype": 0}, errors.UnknownDtype),
])
def test_describe_encoder_refuses(change, error):
    with pytest.raises(error):
        encode_describe(dataclasses.replace(DESCRIBE, **change))


def test_ready_round_trip():
    for ready in (Ready(0), Ready(7, warm=False)):
        assert decode_ready(encode_ready(ready)) == ready
    assert len(encode_ready(Ready(0))) == 16


def entry(sid: int, op: Op, first: int = 0, rows: int = 0, accepted: int = 0, resume: int = 0,
          generation: int = 0) -> StreamEntry:
    return StreamEntry(sid, op, first, rows, accepted, resume, generation)


def test_plan_round_trip_and_size():
    payload = encode_plan(PLAN)
    assert len(payload) == 16 + 5 * ENTRY_BYTES + 2 * 4
    assert decode_plan(payload, round_no=PLAN.round_no) == PLAN
    data = encode_message(PLAN)
    assert frame_of(data).round_no == 7
    assert decode_message(frame_of(data)) == PLAN


def test_keepalive_is_an_empty_plan():
    plan = decode_message(frame_of(encode_message(RoundPlan(99, ()))))
    assert isinstance(plan, RoundPlan) and plan.is_keepalive and plan.round_no == 99


@pytest.mark.parametrize(("entries", "cuts", "error"), [
    ([entry(1, Op.CONTINUE, 5, 1), entry(1, Op.CONTINUE, 5, 1)], (), errors.BadStreamOrder),
    ([entry(2, Op.CONTINUE, 5, 1), entry(1, Op.CONTINUE, 5, 1)], (), errors.BadStreamOrder),
    ([entry(0, Op.OPEN, 1, 4)], (), errors.BadEntry),
    ([entry(0, Op.OPEN, 0, 4, accepted=2)], (), errors.BadEntry),
    ([entry(0, Op.OPEN, 0, 4, generation=1)], (), errors.BadEntry),
    ([entry(0, Op.CLOSE, 9, 1)], (), errors.BadEntry),
    ([entry(0, Op.CANCEL, 9, 1)], (), errors.BadEntry),
    ([entry(0, Op.RESUME, 9, 1, resume=0)], (), errors.BadEntry),
    ([entry(0, Op.RESUME, 9, 1, resume=10)], (), errors.BadEntry),
    ([entry(0, Op.CONTINUE, 9, 1, resume=3)], (), errors.BadEntry),
    ([entry(0, Op.OPEN, 0, 4)], (2, 2), errors.BadChunkCuts),
    ([entry(0, Op.OPEN, 0, 4)], (3, 1), errors.BadChunkCuts),
    ([entry(0, Op.OPEN, 0, 4)], (4,), errors.BadChunkCuts),
    ([entry(0, Op.OPEN, 0, 4)], (0,), errors.BadChunkCuts),
    ([], (1,), errors.BadChunkCuts),
    ([entry(0, Op.CONTINUE, 2**32, 1)], (), errors.FieldOutOfRange),
    ([entry(0, 7, 0, 1)], (), errors.UnknownOp),  # type: ignore[arg-type]
    ([entry(i, Op.CONTINUE, 1, 1) for i in range(4097)], (), errors.TooManyStreams),
])
def test_plan_encoder_refuses_what_the_decoder_refuses(entries, cuts, error):
    with pytest.raises(error):
        encode_plan(RoundPlan(0, tuple(entries), tuple(cuts)))


def test_resume_at_first_is_allowed():
    plan = RoundPlan(3, (entry(4, Op.RESUME, 9, 2, resume=9, generation=5),), (1,))
    assert decode_plan(encode_plan(plan), round_no=3) == plan


def test_largest_plan_fits_the_control_bound():
    assert MAX_PLAN_BYTES <= MAX_CONTROL_PAYLOAD_BYTES
    plan = RoundPlan(1, tuple(entry(i, Op.CONTINUE, 1, 2) for i in range(4096)),
                     tuple(range(1, 4097)))
    data = encode_message(plan)
    assert len(data) == 32 + MAX_PLAN_BYTES
    assert decode_message(frame_of(data)) == plan


@st.composite
def valid_plans(draw) -> RoundPlan:
    ids = sorted(draw(st.sets(U32, max_size=12)))
    entries = []
    for sid in ids:
        op = draw(st.sampled_from(list(Op)))
        rows = 0 if op in (Op.CLOSE, Op.CANCEL) else draw(st.integers(0, 64))
        if op is Op.OPEN:
            entries.append(entry(sid, op, 0, rows))
        elif op is Op.RESUME:
            first = draw(st.integers(1, 2**31))
            entries.append(entry(sid, op, first, rows, draw(U32), draw(st.integers(1, first)),
                                 draw(U32)))
        else:
            entries.append(entry(sid, op, draw(U32), rows, draw(U32), 0, draw(U32)))
    total = sum(e.rows for e in entries)
    cuts = sorted(draw(st.sets(st.integers(1, total - 1), max_size=6))) if total > 1 else []
    return RoundPlan(draw(st.integers(0, 2**64 - 1)), tuple(entries), tuple(cuts))


@settings(max_examples=200, deadline=None)
@given(valid_plans())
def test_plan_property_round_trip(plan):
    data = encode_message(plan)
    assert decode_message(frame_of(data)) == plan


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.sampled_from(["describe", "ready", "plan", "neighbour",
                                                 "abort"]))
def test_fuzz_payload_decoders_raise_only_protocol_errors(payload, which):
    decode = {"describe": decode_describe, "ready": decode_ready,
              "plan": lambda p: decode_plan(p, round_no=0), "neighbour": decode_neighbour,
              "abort": decode_abort}[which]
    try:
        decode(payload)
    except errors.ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=120), st.sampled_from([b"TFSP\x01\x00\x01\x00", b"TFSP\x01\x00\x02\x00",
                                                 b"TFSP\x01\x00\x03\x00"]))
def test_fuzz_past_a_valid_prefix(tail, prefix):
    for decode in (decode_describe, decode_ready, lambda p: decode_plan(p, round_no=0)):
        try:
            decode(prefix + tail)
        except errors.ProtocolError:
            pass


def test_rows_size_and_check():
    assert rows_payload_size(3, 8, 2, Dtype.BFLOAT16) == 96
    assert rows_payload_size(3, 8, 1, Dtype.FLOAT32, drafter_width=5) == 96 + 60
    frame = Frame(FrameKind.ROWS, 0, 4, 3, bytes(96))
    check_rows_frame(frame, hidden=8, planes=2, dtype=Dtype.BFLOAT16)
    check_rows_frame(frame.header, hidden=8, planes=2, dtype=Dtype.FLOAT16, expect_rows=3)
    with pytest.raises(errors.RowsSizeMismatch, match="96-byte payload"):
        check_rows_frame(frame, hidden=8, planes=2, dtype=Dtype.FLOAT32)
    with pytest.raises(errors.RowsSizeMismatch, match="the plan has 4"):
        check_rows_frame(frame, hidden=8, planes=2, dtype=Dtype.BFLOAT16, expect_rows=4)
    with pytest.raises(errors.UnexpectedFrame):
        check_rows_frame(Frame(FrameKind.PLAN, 0, 0, 0, b""), hidden=8, planes=2,
                         dtype=Dtype.BFLOAT16)


def test_neighbour_round_trip_and_refusals():
    for n in (Neighbour(2, "10.1.2.3", 7000), Neighbour(0, "mac-studio.local", 1),
              Neighbour(1, "fe80::1", 65535)):
        assert decode_neighbour(encode_neighbour(n)) == n
    for host in ("", "0.0.0.0", "::", "*", "[::]"):
        with pytest.raises(errors.BadAddress):
            encode_neighbour(Neighbour(1, host, 7000))
    with pytest.raises(errors.BadAddress):
        encode_neighbour(Neighbour(1, "10.0.0.1", 0))
    with pytest.raises(errors.FieldOutOfRange):
        encode_neighbour(Neighbour(1, "10.0.0.1", 70000))


def test_wildcard_hosts():
    for host in ("", "*", "0.0.0.0", "::", "0::0", "[::]", " 0.0.0.0 "):
        assert is_wildcard_host(host), host
    for host in ("127.0.0.1", "::1", "10.0.0.2", "localhost", "gb10.lan"):
        assert not is_wildcard_host(host), host


def test_abort_round_trip_and_truncated_reason():
    abort = Abort("BadProof", "la clé diffère")
    assert decode_abort(encode_abort(abort)) == abort
    long = Abort("Deadline", "é" * 3000)  # 6000 bytes: cut to 4096 on a character boundary
    decoded = decode_abort(encode_abort(long))
    assert decoded.reason == "é" * 2048
    with pytest.raises(errors.BadText):
        encode_abort(Abort("not a name", "x"))
    assert Abort.from_error(errors.LayoutGap("gap")) == Abort("LayoutGap", "gap")


def test_error_from_abort_rebuilds_named_remote_errors():
    error = errors.error_from_abort("CapacityTooSmall", "rank 1 holds 10 KV rows")
    assert type(error) is errors.CapacityTooSmall and error.remote
    unknown = errors.error_from_abort("SomethingNew", "why")
    assert type(unknown) is errors.PeerAborted and "SomethingNew" in str(unknown)
    assert type(errors.error_from_abort("ConnectionFailed", "x")) is errors.PeerAborted


def test_decode_message_dispatch():
    assert decode_message(frame_of(encode_message(DESCRIBE))) == DESCRIBE
    assert decode_message(frame_of(encode_message(Ready(1)))) == Ready(1)
    assert decode_message(Frame(FrameKind.GO, 0, 0, 0, b"")) is None
    with pytest.raises(errors.TrailingBytes):
        decode_message(Frame(FrameKind.GOODBYE, 0, 0, 0, b"x"))
    with pytest.raises(errors.UnexpectedFrame):
        decode_message(Frame(FrameKind.ROWS, 0, 0, 0, b""))
    with pytest.raises(TypeError):
        encode_message("hello")  # type: ignore[arg-type]

"""The golden frames, checked against byte layouts written by hand from the wire format.

The good fixtures are made by our own encoders, so comparing the encoders with them only
pins the encoders to themselves. Here every frame, good and bad, is written out again,
field by field, from the tables of docs/wire-format.md and RFC section 6.4, with `struct`
and byte literals and nothing from `engine.link`: a change to a width, an offset, an enum
value or a reserved byte in the encoders (and so in regenerated fixtures) fails here, where
a peer written in another language would fail. Each bad frame also carries the error the
wire format names for it, checked against the manifest.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from pathlib import Path

import pytest

FIXTURE_DIR = Path(__file__).resolve().parents[2] / "engine" / "link" / "fixtures"

# The inputs the fixtures were made from (their manifest's proof_inputs and notes).
KEY = b"ringfleet fixture link key 32 B!"
FINGERPRINT = hashlib.sha256(b"ringfleet fixture: checkpoint + layout").digest()
NONCE_RANK0 = bytes(range(32))
NONCE_RANK1 = bytes(range(32, 64))

# Frame kinds (wire-format §1, "Kinds").
HELLO, PROOF, DESCRIBE, READY, PLAN, ROWS, NEIGHBOUR, GO, ABORT, GOODBYE = range(1, 11)
# Enumerations (wire-format §3): backend and dtype bytes.
TORCH_CUDA, MLX_METAL = 1, 4
FLOAT16, BFLOAT16 = 3, 2
# Plan ops (wire-format §3.4, RFC 6.4 "Plan").
OPEN, CONTINUE, CLOSE, CANCEL, RESUME = 1, 2, 3, 4, 5


def u8(v: int) -> bytes:
    return struct.pack("<B", v)


def u16(v: int) -> bytes:
    return struct.pack("<H", v)


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def header(kind: int, length: int, *, round_no: int = 0, rows: int = 0) -> bytes:
    """The 32-byte frame header (wire-format §1, "Header")."""
    out = (b"RFLK"          # 0: magic u32 0x4B4C4652
           + u16(1)         # 4: framing version
           + u8(kind)       # 6: kind
           + u8(0)          # 7: flags, none defined
           + u64(round_no)  # 8: round
           + u32(rows)      # 16: rows (ROWS frames only)
           + u32(length)    # 20: payload length
           + bytes(8))      # 24: reserved
    assert len(out) == 32
    return out


def frame(kind: int, payload: bytes, *, round_no: int = 0, rows: int = 0) -> bytes:
    return header(kind, len(payload), round_no=round_no, rows=rows) + payload


def tfsp(message: int) -> bytes:
    """RFC 6.4's 8-byte payload prefix: magic 0x50534654 ("TFSP"), version 1, message, 0."""
    return b"TFSP" + u16(1) + u8(message) + u8(0)


def hello(rank: int, world: int, nonce: bytes) -> bytes:
    return u32(rank) + u32(world) + FINGERPRINT + nonce  # wire-format §2, 72 bytes


def proof_rank1_to_rank0() -> bytes:
    """Wire-format §2 "PROOF payload": the prover (rank 1) is the higher rank, role 0x01."""
    message = (b"ringfleet-link-v0" + b"\x01" + NONCE_RANK1 + NONCE_RANK0 + u32(1) + u32(0)
               + FINGERPRINT)
    return hmac.new(KEY, message, hashlib.sha256).digest()


def describe(*, rank: int, layers: tuple[int, int], backend: int, kv_dtype: int,
             version: str) -> bytes:
    """Wire-format §3.2: a 2-stage layout of a 2048-wide model, bf16 rows in 2 planes."""
    text = version.encode("utf-8")
    return (tfsp(1)
            + u32(rank) + u32(2)                # 8: rank, 12: world
            + u32(layers[0]) + u32(layers[1])   # 16: layer first, 20: layer end
            + u8(backend) + u8(kv_dtype)        # 24: backend, 25: kv dtype
            + u8(BFLOAT16) + u8(2)              # 26: row dtype, 27: planes
            + u32(2048)                         # 28: hidden
            + u32(512) + u32(544)               # 32: prompt chunk, 36: max rows a round
            + u32(4) + u32(8192)                # 40: parallel, 44: context
            + u32(0)                            # 48: drafter width
            + u32(32768) + u32(4)               # 52: kv rows, 56: recurrent states
            + u16(len(text)) + text)            # 60: version length, 62: version


def entry(stream_id: int, op: int, first: int, rows: int, accepted: int, resume: int,
          generation: int, *, reserved: bytes = b"\x00\x00\x00") -> bytes:
    """Wire-format §3.4 stream entry, 28 bytes: op u8 and 3 reserved bytes, u32s elsewhere."""
    out = (u32(stream_id) + u8(op) + reserved + u32(first) + u32(rows) + u32(accepted)
           + u32(resume) + u32(generation))
    assert len(out) == 28
    return out


# The plan fixture's streams: (id, op, first, rows, accepted, resume, generation), 10 rows.
PLAN_STREAMS = ((0, OPEN, 0, 5, 0, 0, 0), (2, CONTINUE, 12, 1, 1, 0, 3),
                (3, CLOSE, 30, 0, 0, 0, 1), (5, CANCEL, 4, 0, 0, 0, 2),
                (9, RESUME, 8, 4, 0, 6, 2))
PLAN_CUTS = (5, 6)


def plan(streams=PLAN_STREAMS, cuts=PLAN_CUTS, *, reserved: bytes = b"\x00\x00\x00") -> bytes:
    """Wire-format §3.4 payload: prefix, S, C, S entries, C cuts."""
    return (tfsp(3) + u32(len(streams)) + u32(len(cuts))
            + b"".join(entry(*s, reserved=reserved) for s in streams)
            + b"".join(u32(c) for c in cuts))


PLAN_ENTRIES = b"".join(entry(*s) for s in PLAN_STREAMS)
ABORT_NAME = b"FingerprintMismatch"
ABORT_REASON = "peer rank 1 has fingerprint 0a1b… (another layout)".encode()
NEIGHBOUR_HOST = b"10.0.0.2"

LAYOUTS: dict[str, bytes] = {
    "hello.bin": frame(HELLO, hello(1, 2, NONCE_RANK1)),
    "proof.bin": frame(PROOF, proof_rank1_to_rank0()),
    "describe.bin": frame(DESCRIBE, describe(rank=0, layers=(0, 20), backend=TORCH_CUDA,
                                             kv_dtype=BFLOAT16, version="0.1.0")),
    "describe_mlx.bin": frame(DESCRIBE, describe(rank=1, layers=(20, 36), backend=MLX_METAL,
                                                 kv_dtype=FLOAT16, version="0.1.0+mac")),
    "ready.bin": frame(READY, tfsp(2) + u32(1) + b"\x01" + bytes(3)),
    "plan.bin": frame(PLAN, tfsp(3) + u32(5) + u32(2) + PLAN_ENTRIES + u32(5) + u32(6),
                      round_no=7),
    "keepalive.bin": frame(PLAN, tfsp(3) + u32(0) + u32(0), round_no=8),
    "neighbour.bin": frame(NEIGHBOUR, u32(1) + u16(29501) + u16(len(NEIGHBOUR_HOST))
                           + NEIGHBOUR_HOST),
    "abort.bin": frame(ABORT, u16(len(ABORT_NAME)) + u16(len(ABORT_REASON)) + ABORT_NAME
                       + ABORT_REASON),
    "rows.bin": frame(ROWS, bytes(range(32)), round_no=7, rows=2),  # 2 rows x 2 planes x 4 bf16
    "go.bin": frame(GO, b""),
    "goodbye.bin": frame(GOODBYE, b""),
}


def test_every_good_fixture_has_a_hand_written_layout():
    manifest = json.loads((FIXTURE_DIR / "manifest.json").read_text(encoding="utf-8"))
    good = {e["file"] for e in manifest["fixtures"] if e["stage"] == "ok"}
    assert good == set(LAYOUTS)
    proof_inputs = manifest["proof_inputs"]
    assert bytes.fromhex(proof_inputs["key_hex"]) == KEY
    assert proof_inputs["label"] == "ringfleet-link-v0"


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_golden_file_is_the_hand_written_layout(name):
    on_disk = (FIXTURE_DIR / name).read_bytes()
    want = LAYOUTS[name]
    differ = next((i for i, (a, b) in enumerate(zip(on_disk, want)) if a != b), None)
    assert on_disk == want, (f"{name}: {len(on_disk)} bytes on disk, {len(want)} by hand; "
                             f"first difference at byte {differ}")


def test_the_hand_written_sizes_are_the_documented_ones():
    """The lengths the tables state, so a slip in this file's own layouts shows too."""
    payload = {name: data[32:] for name, data in LAYOUTS.items()}
    assert len(payload["hello.bin"]) == 72
    assert len(payload["proof.bin"]) == 32
    assert len(payload["describe.bin"]) == 62 + len("0.1.0")
    assert len(payload["ready.bin"]) == 16
    assert len(payload["plan.bin"]) == 16 + 28 * 5 + 4 * 2
    assert len(payload["keepalive.bin"]) == 16
    assert len(payload["neighbour.bin"]) == 8 + len(NEIGHBOUR_HOST)
    assert len(payload["rows.bin"]) == 2 * 2 * 4 * 2
    assert struct.unpack_from("<I", LAYOUTS["hello.bin"])[0] == 0x4B4C4652
    assert struct.unpack_from("<I", payload["ready.bin"])[0] == 0x50534654


# The bad frames: each a good layout with the one field the wire format forbids, and the
# error the wire format names for it.


def payload_of(name: str) -> bytes:
    return LAYOUTS[name][32:]


def patched(data: bytes, offset: int, value: bytes) -> bytes:
    return data[:offset] + value + data[offset + len(value):]


def plan_with(index: int, **fields: int) -> tuple[tuple[int, ...], ...]:
    """PLAN_STREAMS with fields of one stream changed."""
    names = ("id", "op", "first", "rows", "accepted", "resume", "generation")
    streams = [list(s) for s in PLAN_STREAMS]
    for key, value in fields.items():
        streams[index][names.index(key)] = value
    return tuple(tuple(s) for s in streams)


ROWS_BOUND = 1 << 20  # the manifest's frame_max_payload_bytes: the fixtures' receiver limit
CONTROL_BOUND = 262144  # wire-format §1: every kind but ROWS, 256 KiB
HELLO_P, DESCRIBE_P, READY_P = payload_of("hello.bin"), payload_of("describe.bin"), \
    payload_of("ready.bin")
KEEPALIVE_P, NEIGHBOUR_P = payload_of("keepalive.bin"), payload_of("neighbour.bin")


def plan_frame(payload: bytes) -> bytes:
    return frame(PLAN, payload, round_no=7)


BAD_LAYOUTS: dict[str, tuple[bytes, str]] = {
    # §1 header, refused from the header alone
    "bad_magic.bin": (patched(LAYOUTS["hello.bin"], 0, b"XXXX"), "BadMagic"),
    "bad_version.bin": (patched(LAYOUTS["hello.bin"], 4, u16(2)), "UnsupportedVersion"),
    "unknown_kind.bin": (frame(200, b""), "UnknownKind"),
    "unknown_kind_zero.bin": (frame(0, b""), "UnknownKind"),
    "unknown_flags.bin": (patched(LAYOUTS["go.bin"], 7, b"\x01"), "UnknownFlags"),
    "nonzero_reserved.bin": (patched(LAYOUTS["go.bin"], 31, b"\x01"), "NonZeroReserved"),
    "rows_count_on_plan.bin": (frame(PLAN, KEEPALIVE_P, round_no=7, rows=3),
                               "UnexpectedRowCount"),
    "oversize_rows.bin": (header(ROWS, ROWS_BOUND + 1, rows=1), "PayloadTooLarge"),
    "oversize_control.bin": (header(HELLO, CONTROL_BOUND + 1), "PayloadTooLarge"),
    "oversize_u32.bin": (header(ROWS, 0xFFFF_FFFF, rows=1), "PayloadTooLarge"),
    "truncated_header.bin": (LAYOUTS["hello.bin"][:20], "TruncatedFrame"),
    "truncated_frame.bin": (LAYOUTS["hello.bin"][:32 + 40], "TruncatedFrame"),
    # §2 hello and proof
    "hello_truncated.bin": (frame(HELLO, HELLO_P[:40]), "TruncatedPayload"),
    "hello_trailing.bin": (frame(HELLO, HELLO_P + b"\x00"), "TrailingBytes"),
    "hello_rank_outside_world.bin": (frame(HELLO, u32(2) + u32(2) + FINGERPRINT + bytes(32)),
                                     "RankMismatch"),
    "hello_world_zero.bin": (frame(HELLO, u32(0) + u32(0) + bytes(64)), "WorldMismatch"),
    "proof_truncated.bin": (frame(PROOF, bytes(31)), "TruncatedPayload"),
    # §3.1 prefix
    "tfsp_bad_magic.bin": (frame(DESCRIBE, patched(DESCRIBE_P, 0, b"UFSP")), "BadPrefix"),
    "tfsp_bad_version.bin": (frame(DESCRIBE, patched(DESCRIBE_P, 4, u16(2))), "BadPrefix"),
    "tfsp_bad_message.bin": (frame(PLAN, tfsp(1) + KEEPALIVE_P[8:], round_no=8), "BadPrefix"),
    "tfsp_nonzero_reserved.bin": (frame(DESCRIBE, patched(DESCRIBE_P, 7, b"\x01")),
                                  "BadPrefix"),
    "tfsp_short.bin": (frame(READY, tfsp(2)[:6]), "TruncatedPayload"),
    # §3.2 describe
    "describe_unknown_backend.bin": (frame(DESCRIBE, patched(DESCRIBE_P, 24, b"\x07")),
                                     "UnknownBackend"),
    "describe_unknown_dtype.bin": (frame(DESCRIBE, patched(DESCRIBE_P, 26, b"\x09")),
                                   "UnknownDtype"),
    "describe_truncated.bin": (frame(DESCRIBE, DESCRIBE_P[:-1]), "TruncatedPayload"),
    "describe_trailing.bin": (frame(DESCRIBE, DESCRIBE_P + b"x"), "TrailingBytes"),
    "describe_bad_utf8.bin": (frame(DESCRIBE, DESCRIBE_P[:-5] + b"\xff\xfe\xfd\xfc\xfb"),
                              "BadText"),
    # §3.3 ready
    "ready_bad_warm.bin": (frame(READY, patched(READY_P, 12, b"\x02")), "BadFlagValue"),
    "ready_nonzero_reserved.bin": (frame(READY, patched(READY_P, 15, b"\x01")),
                                   "NonZeroReserved"),
    "ready_trailing.bin": (frame(READY, READY_P + bytes(4)), "TrailingBytes"),
    # §3.4 plan
    "plan_descending_ids.bin": (plan_frame(plan(PLAN_STREAMS[1::-1], ())), "BadStreamOrder"),
    "plan_duplicate_id.bin": (plan_frame(plan(plan_with(1, id=0)[:2], ())), "BadStreamOrder"),
    "plan_unknown_op.bin": (plan_frame(plan(plan_with(1, op=6))), "UnknownOp"),
    "plan_op_zero.bin": (plan_frame(plan(plan_with(1, op=0))), "UnknownOp"),
    "plan_entry_reserved.bin": (plan_frame(plan(reserved=b"\x00\x01\x00")), "NonZeroReserved"),
    "plan_open_first_nonzero.bin": (plan_frame(plan(plan_with(0, first=3))), "BadEntry"),
    "plan_open_accepted.bin": (plan_frame(plan(plan_with(0, accepted=1))), "BadEntry"),
    "plan_open_generation.bin": (plan_frame(plan(plan_with(0, generation=1))), "BadEntry"),
    "plan_close_with_rows.bin": (plan_frame(plan(plan_with(2, rows=1))), "BadEntry"),
    "plan_cancel_with_rows.bin": (plan_frame(plan(plan_with(3, rows=2))), "BadEntry"),
    "plan_resume_zero.bin": (plan_frame(plan(plan_with(4, resume=0))), "BadEntry"),
    "plan_resume_past_first.bin": (plan_frame(plan(plan_with(4, resume=9))), "BadEntry"),
    "plan_resume_on_continue.bin": (plan_frame(plan(plan_with(1, resume=4))), "BadEntry"),
    "plan_cuts_not_ascending.bin": (plan_frame(plan(cuts=(6, 5))), "BadChunkCuts"),
    "plan_cut_repeated.bin": (plan_frame(plan(cuts=(5, 5))), "BadChunkCuts"),
    "plan_cut_zero.bin": (plan_frame(plan(cuts=(0, 5))), "BadChunkCuts"),
    "plan_cut_outside_round.bin": (plan_frame(plan(cuts=(5, 10))), "BadChunkCuts"),
    "keepalive_with_cut.bin": (plan_frame(plan((), (1,))), "BadChunkCuts"),
    "plan_too_many_streams.bin": (plan_frame(tfsp(3) + u32(4097) + u32(0)), "TooManyStreams"),
    "plan_too_many_cuts.bin": (plan_frame(tfsp(3) + u32(0) + u32(4097)), "TooManyCuts"),
    "plan_truncated.bin": (plan_frame(plan()[:-2]), "TruncatedPayload"),
    "plan_trailing.bin": (plan_frame(plan() + bytes(4)), "TrailingBytes"),
    "plan_counts_missing.bin": (plan_frame(tfsp(3) + bytes(4)), "TruncatedPayload"),
    # §5 neighbour, §6 abort, §4 rows, §1 empty kinds
    "neighbour_port_zero.bin": (frame(NEIGHBOUR, patched(NEIGHBOUR_P, 4, u16(0))),
                                "BadAddress"),
    "neighbour_wildcard.bin": (frame(NEIGHBOUR, u32(1) + u16(29501) + u16(7) + b"0.0.0.0"),
                               "BadAddress"),
    "neighbour_truncated.bin": (frame(NEIGHBOUR, NEIGHBOUR_P[:-1]), "TruncatedPayload"),
    "abort_bad_utf8.bin": (frame(ABORT, u16(8) + u16(2) + b"BadProof" + b"\xc3\x28"),
                           "BadText"),
    "abort_empty_name.bin": (frame(ABORT, u16(0) + u16(0)), "BadText"),
    "rows_size_mismatch.bin": (frame(ROWS, bytes(range(30)), round_no=7, rows=2),
                               "RowsSizeMismatch"),
    "go_with_payload.bin": (frame(GO, b"\x00"), "TrailingBytes"),
}


def test_every_bad_fixture_has_a_hand_written_layout_and_the_documented_error():
    manifest = json.loads((FIXTURE_DIR / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["frame_max_payload_bytes"] == ROWS_BOUND
    assert manifest["control_max_payload_bytes"] == CONTROL_BOUND
    bad = {e["file"]: e["raises"] for e in manifest["fixtures"] if e["stage"] != "ok"}
    assert set(bad) == set(BAD_LAYOUTS)
    assert bad == {name: error for name, (_, error) in BAD_LAYOUTS.items()}


@pytest.mark.parametrize("name", sorted(BAD_LAYOUTS))
def test_the_bad_golden_file_is_the_hand_written_layout(name):
    on_disk = (FIXTURE_DIR / name).read_bytes()
    want = BAD_LAYOUTS[name][0]
    differ = next((i for i, (a, b) in enumerate(zip(on_disk, want)) if a != b), None)
    assert on_disk == want, (f"{name}: {len(on_disk)} bytes on disk, {len(want)} by hand; "
                             f"first difference at byte {differ}")

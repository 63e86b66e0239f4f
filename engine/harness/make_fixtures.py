"""Regenerates the stage link's golden bytes: engine/link/fixtures/*.bin and manifest.json.

    python -m engine.harness.make_fixtures           # rewrite the files
    python -m engine.harness.make_fixtures --check   # exit 1 if a file differs

Every `.bin` is one whole frame (header and payload), or just a header where the header
alone must be refused. Good ones are made by the encoders from the objects below, so the
tests' byte-for-byte comparison pins the encoders; bad ones are built by hand from the
same structs, each with the error class it must raise and the stage that raises it:
"frame" (the frame parser), "eof" (the parser, once the stream ends) or "payload" (the
message's decoder). `manifest.json` is what a peer in another language tests against.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from engine.link.frame import (
    HEADER,
    MAGIC_U32,
    MAX_CONTROL_PAYLOAD_BYTES,
    RESERVED,
    Frame,
    FrameKind,
    encode_frame,
)
from engine.link.hello import Hello, decode_hello, decode_proof, encode_hello, proof_mac
from engine.link.messages import (
    ENTRY,
    PREFIX,
    TFSP_MAGIC,
    Abort,
    Backend,
    Describe,
    Dtype,
    MessageType,
    Neighbour,
    Ready,
    check_empty,
    check_rows_frame,
    decode_abort,
    decode_describe,
    decode_neighbour,
    decode_plan,
    decode_ready,
    encode_abort,
    encode_describe,
    encode_message,
    encode_neighbour,
    encode_plan,
    encode_ready,
)
from engine.rounds import Op, RoundPlan, StreamEntry

FIXTURE_DIR = Path(__file__).parents[1] / "link" / "fixtures"
MANIFEST = "manifest.json"
# The frame parser's rows bound the fixtures assume (the control bound is fixed).
FIXTURE_MAX_PAYLOAD_BYTES = 1 << 20
FIXTURE_KEY = b"ringfleet fixture link key 32 B!"
FIXTURE_FINGERPRINT = hashlib.sha256(b"ringfleet fixture: checkpoint + layout").digest()
HELLO_RANK0 = Hello(0, 2, FIXTURE_FINGERPRINT, bytes(range(32)))
HELLO_RANK1 = Hello(1, 2, FIXTURE_FINGERPRINT, bytes(range(32, 64)))
ROWS_FORMAT = {"hidden": 4, "planes": 2, "dtype": Dtype.BFLOAT16, "drafter_width": 0}

DESCRIBE = Describe(
    engine_version="0.1.0", backend=Backend.TORCH_CUDA, kv_dtype=Dtype.BFLOAT16, rank=0,
    world=2, layer_first=0, layer_end=20, hidden=2048, row_dtype=Dtype.BFLOAT16, planes=2,
    prompt_chunk=512, max_rows_per_round=544, parallel=4, context=8192, drafter_width=0,
    kv_rows=32768, recurrent_states=4,
)
DESCRIBE_MLX = dataclasses.replace(
    DESCRIBE, backend=Backend.MLX_METAL, rank=1, layer_first=20, layer_end=36,
    kv_dtype=Dtype.FLOAT16, engine_version="0.1.0+mac",
)
PLAN = RoundPlan(
    round_no=7,
    entries=(
        StreamEntry(0, Op.OPEN, first=0, rows=5, accepted=0, resume=0, generation=0),
        StreamEntry(2, Op.CONTINUE, first=12, rows=1, accepted=1, resume=0, generation=3),
        StreamEntry(3, Op.CLOSE, first=30, rows=0, accepted=0, resume=0, generation=1),
        StreamEntry(5, Op.CANCEL, first=4, rows=0, accepted=0, resume=0, generation=2),
        StreamEntry(9, Op.RESUME, first=8, rows=4, accepted=0, resume=6, generation=2),
    ),
    cuts=(5, 6),
)
KEEPALIVE = RoundPlan(round_no=8, entries=())
NEIGHBOUR = Neighbour(successor_rank=1, host="10.0.0.2", port=29501)
ABORT = Abort("FingerprintMismatch", "peer rank 1 has fingerprint 0a1b… (another layout)")
ROWS_PAYLOAD = bytes(range(32))  # 2 rows x 2 planes x 4 values x bf16


@dataclass(frozen=True)
class Fixture:
    """One golden file and what reading it must give."""

    name: str
    data: bytes
    message: str  # which decoder reads the payload (see `decode_fixture`)
    stage: str  # "ok", or where the error is raised: "frame", "eof" or "payload"
    value: object = None  # good: the object it decodes to
    raises: str | None = None  # bad: the ProtocolError subclass name
    note: str = ""


# Raw builders (they skip every check, to make bad bytes) ---------------------------------


def raw_header(kind: int, length: int, *, round_no: int = 0, rows: int = 0, flags: int = 0,
               magic: int = MAGIC_U32, version: int = 1, reserved: bytes = RESERVED) -> bytes:
    return HEADER.pack(magic, version, kind, flags, round_no, rows, length, reserved)


def raw_frame(kind: int, payload: bytes, **header: int) -> bytes:
    return raw_header(kind, len(payload), **header) + payload


def raw_prefix(message: int, *, magic: int = TFSP_MAGIC, version: int = 1,
               reserved: int = 0) -> bytes:
    return PREFIX.pack(magic, version, message, reserved)


def raw_plan(entries: list[tuple[int, int, int, int, int, int, int]], cuts: list[int], *,
             counts: tuple[int, int] | None = None, reserved: bytes = bytes(3),
             prefix: bytes | None = None) -> bytes:
    """entries: (id, op, first, rows, accepted, resume, generation)."""
    streams, n_cuts = counts if counts is not None else (len(entries), len(cuts))
    out = prefix if prefix is not None else raw_prefix(MessageType.PLAN)
    out += struct.pack("<II", streams, n_cuts)
    for sid, op, first, rows, accepted, resume, generation in entries:
        out += ENTRY.pack(sid, op, reserved, first, rows, accepted, resume, generation)
    return out + b"".join(struct.pack("<I", c) for c in cuts)


def _entry(e: StreamEntry) -> tuple[int, int, int, int, int, int, int]:
    return (e.stream_id, int(e.op), e.first, e.rows, e.accepted, e.resume, e.generation)


def _plan_frame(payload: bytes, round_no: int = 7) -> bytes:
    return raw_frame(FrameKind.PLAN, payload, round_no=round_no)


# The fixtures ---------------------------------------------------------------------------


def _good() -> list[Fixture]:
    proof = proof_mac(FIXTURE_KEY, prover=HELLO_RANK1, verifier=HELLO_RANK0)
    return [
        Fixture("hello.bin", encode_frame(FrameKind.HELLO, encode_hello(HELLO_RANK1)), "hello",
                "ok", HELLO_RANK1, note="rank 1 of 2"),
        Fixture("proof.bin", encode_frame(FrameKind.PROOF, proof), "proof", "ok", proof,
                note="rank 1's proof to rank 0: HMAC-SHA256(key, label + 01 + nonce1 + "
                     "nonce0 + u32 1 + u32 0 + fingerprint)"),
        Fixture("describe.bin", encode_message(DESCRIBE), "describe", "ok", DESCRIBE),
        Fixture("describe_mlx.bin", encode_message(DESCRIBE_MLX), "describe", "ok",
                DESCRIBE_MLX),
        Fixture("ready.bin", encode_message(Ready(rank=1, warm=True)), "ready", "ok",
                Ready(rank=1, warm=True)),
        Fixture("plan.bin", encode_message(PLAN), "plan", "ok", PLAN,
                note="open, continue, close, cancel, resume; cuts 5 and 6 of 10 rows"),
        Fixture("keepalive.bin", encode_message(KEEPALIVE), "plan", "ok", KEEPALIVE,
                note="an empty plan"),
        Fixture("neighbour.bin", encode_message(NEIGHBOUR), "neighbour", "ok", NEIGHBOUR),
        Fixture("abort.bin", encode_message(ABORT), "abort", "ok", ABORT),
        Fixture("rows.bin", encode_frame(FrameKind.ROWS, ROWS_PAYLOAD, round_no=7, rows=2),
                "rows", "ok", ROWS_PAYLOAD, note="2 rows, 2 planes, hidden 4, bfloat16"),
        Fixture("go.bin", encode_frame(FrameKind.GO), "empty", "ok", None),
        Fixture("goodbye.bin", encode_frame(FrameKind.GOODBYE), "empty", "ok", None),
    ]


def _bad_frames() -> list[Fixture]:
    hello = encode_hello(HELLO_RANK1)

    def bad(name: str, data: bytes, raises: str, note: str, stage: str = "frame") -> Fixture:
        return Fixture(name, data, "frame", stage, raises=raises, note=note)

    return [
        bad("bad_magic.bin", raw_frame(FrameKind.HELLO, hello, magic=0x58585858), "BadMagic",
            "magic XXXX"),
        bad("bad_version.bin", raw_frame(FrameKind.HELLO, hello, version=2),
            "UnsupportedVersion", "frame version 2"),
        bad("unknown_kind.bin", raw_frame(200, b""), "UnknownKind", "kind 200"),
        bad("unknown_kind_zero.bin", raw_frame(0, b""), "UnknownKind", "kind 0"),
        bad("unknown_flags.bin", raw_frame(FrameKind.GO, b"", flags=0x01), "UnknownFlags",
            "flags 0x01"),
        bad("nonzero_reserved.bin", raw_frame(FrameKind.GO, b"", reserved=bytes(7) + b"\x01"),
            "NonZeroReserved", "last reserved byte 1"),
        bad("rows_count_on_plan.bin",
            _plan_frame(encode_plan(KEEPALIVE))[:16] + struct.pack("<I", 3)
            + _plan_frame(encode_plan(KEEPALIVE))[20:],
            "UnexpectedRowCount", "a PLAN frame with row count 3"),
        bad("oversize_rows.bin", raw_header(FrameKind.ROWS, FIXTURE_MAX_PAYLOAD_BYTES + 1, rows=1),
            "PayloadTooLarge", "header only: a ROWS payload one byte over the rows bound"),
        bad("oversize_control.bin", raw_header(FrameKind.HELLO, MAX_CONTROL_PAYLOAD_BYTES + 1),
            "PayloadTooLarge", "header only: a HELLO over the 256 KiB control bound"),
        bad("oversize_u32.bin", raw_header(FrameKind.ROWS, 0xFFFF_FFFF, rows=1),
            "PayloadTooLarge", "header only: a 4 GiB ROWS payload"),
        bad("truncated_header.bin", raw_frame(FrameKind.HELLO, hello)[:20], "TruncatedFrame",
            "20 of 32 header bytes, then end of stream", stage="eof"),
        bad("truncated_frame.bin", raw_frame(FrameKind.HELLO, hello)[:72], "TruncatedFrame",
            "40 of 72 payload bytes, then end of stream", stage="eof"),
    ]


def _bad_payloads() -> list[Fixture]:
    hello = encode_hello(HELLO_RANK1)
    describe = encode_describe(DESCRIBE)
    ready = encode_ready(Ready(1))
    plan = [_entry(e) for e in PLAN.entries]
    cuts = list(PLAN.cuts)
    neighbour = encode_neighbour(NEIGHBOUR)
    out: list[Fixture] = []

    def bad(name: str, kind: FrameKind, payload: bytes, message: str, raises: str, note: str,
            **header: int) -> None:
        out.append(Fixture(name, raw_frame(kind, payload, **header), message, "payload",
                           raises=raises, note=note))

    def bad_plan(name: str, payload: bytes, raises: str, note: str) -> None:
        bad(name, FrameKind.PLAN, payload, "plan", raises, note, round_no=7)

    def replace(entry_index: int, **fields: int) -> list[tuple[int, ...]]:
        names = ("id", "op", "first", "rows", "accepted", "resume", "generation")
        entries = [list(e) for e in plan]
        for key, value in fields.items():
            entries[entry_index][names.index(key)] = value
        return [tuple(e) for e in entries]

    h = FrameKind.HELLO
    bad("hello_truncated.bin", h, hello[:40], "hello", "TruncatedPayload", "40 of 72 bytes")
    bad("hello_trailing.bin", h, hello + b"\x00", "hello", "TrailingBytes", "73 bytes")
    bad("hello_rank_outside_world.bin", h, encode_hello(Hello(2, 2, FIXTURE_FINGERPRINT,
        bytes(32))), "hello", "RankMismatch", "rank 2 in a world of 2")
    bad("hello_world_zero.bin", h, struct.pack("<II", 0, 0) + bytes(64), "hello",
        "WorldMismatch", "world 0")
    bad("proof_truncated.bin", FrameKind.PROOF, bytes(31), "proof", "TruncatedPayload",
        "31-byte proof")

    d = FrameKind.DESCRIBE
    bad("tfsp_bad_magic.bin", d, raw_prefix(1, magic=0x50534655) + describe[8:], "describe",
        "BadPrefix", "prefix magic UFSP")
    bad("tfsp_bad_version.bin", d, raw_prefix(1, version=2) + describe[8:], "describe",
        "BadPrefix", "protocol version 2")
    bad("tfsp_bad_message.bin", FrameKind.PLAN, raw_prefix(MessageType.DESCRIBE)
        + encode_plan(KEEPALIVE)[8:], "plan", "BadPrefix", "a PLAN frame whose prefix says "
        "describe (1)", round_no=8)
    bad("tfsp_nonzero_reserved.bin", d, raw_prefix(1, reserved=1) + describe[8:], "describe",
        "BadPrefix", "prefix reserved byte 1")
    bad("tfsp_short.bin", FrameKind.READY, raw_prefix(2)[:6], "ready", "TruncatedPayload",
        "6 bytes: shorter than the prefix")
    bad("describe_unknown_backend.bin", d, describe[:24] + b"\x07" + describe[25:], "describe",
        "UnknownBackend", "backend byte 7")
    bad("describe_unknown_dtype.bin", d, describe[:26] + b"\x09" + describe[27:], "describe",
        "UnknownDtype", "row dtype byte 9")
    bad("describe_truncated.bin", d, describe[:-1], "describe", "TruncatedPayload",
        "engine version one byte short")
    bad("describe_trailing.bin", d, describe + b"x", "describe", "TrailingBytes",
        "one byte after the engine version")
    bad("describe_bad_utf8.bin", d, describe[:-5] + b"\xff\xfe\xfd\xfc\xfb", "describe",
        "BadText", "engine version is not UTF-8")

    r = FrameKind.READY
    bad("ready_bad_warm.bin", r, ready[:12] + b"\x02" + ready[13:], "ready", "BadFlagValue",
        "warm flag 2")
    bad("ready_nonzero_reserved.bin", r, ready[:15] + b"\x01", "ready", "NonZeroReserved",
        "reserved byte 1")
    bad("ready_trailing.bin", r, ready + bytes(4), "ready", "TrailingBytes", "20 bytes")

    bad_plan("plan_descending_ids.bin", raw_plan([plan[1], plan[0]], []), "BadStreamOrder",
             "stream 2 then stream 0")
    bad_plan("plan_duplicate_id.bin", raw_plan(replace(1, id=0)[:2], []), "BadStreamOrder",
             "stream 0 twice")
    bad_plan("plan_unknown_op.bin", raw_plan(replace(1, op=6), cuts), "UnknownOp", "op 6")
    bad_plan("plan_op_zero.bin", raw_plan(replace(1, op=0), cuts), "UnknownOp", "op 0")
    bad_plan("plan_entry_reserved.bin", raw_plan(plan, cuts, reserved=b"\x00\x01\x00"),
             "NonZeroReserved", "entry reserved bytes 00 01 00")
    bad_plan("plan_open_first_nonzero.bin", raw_plan(replace(0, first=3), cuts), "BadEntry",
             "open at position 3")
    bad_plan("plan_open_accepted.bin", raw_plan(replace(0, accepted=1), cuts), "BadEntry",
             "open with 1 accepted")
    bad_plan("plan_open_generation.bin", raw_plan(replace(0, generation=1), cuts), "BadEntry",
             "open with generation 1")
    bad_plan("plan_close_with_rows.bin", raw_plan(replace(2, rows=1), cuts), "BadEntry",
             "close carrying 1 row")
    bad_plan("plan_cancel_with_rows.bin", raw_plan(replace(3, rows=2), cuts), "BadEntry",
             "cancel carrying 2 rows")
    bad_plan("plan_resume_zero.bin", raw_plan(replace(4, resume=0), cuts), "BadEntry",
             "resume point 0")
    bad_plan("plan_resume_past_first.bin", raw_plan(replace(4, resume=9), cuts), "BadEntry",
             "resume point 9 past first 8")
    bad_plan("plan_resume_on_continue.bin", raw_plan(replace(1, resume=4), cuts), "BadEntry",
             "a continue naming a resume point")
    bad_plan("plan_cuts_not_ascending.bin", raw_plan(plan, [6, 5]), "BadChunkCuts",
             "cuts 6 then 5")
    bad_plan("plan_cut_repeated.bin", raw_plan(plan, [5, 5]), "BadChunkCuts", "cut 5 twice")
    bad_plan("plan_cut_zero.bin", raw_plan(plan, [0, 5]), "BadChunkCuts", "cut at row 0")
    bad_plan("plan_cut_outside_round.bin", raw_plan(plan, [5, 10]), "BadChunkCuts",
             "cut at row 10 of a 10-row round")
    bad_plan("keepalive_with_cut.bin", raw_plan([], [1]), "BadChunkCuts",
             "a cut in a round with no rows")
    bad_plan("plan_too_many_streams.bin", raw_plan([], [], counts=(4097, 0)), "TooManyStreams",
             "declares 4097 streams in a 16-byte payload")
    bad_plan("plan_too_many_cuts.bin", raw_plan([], [], counts=(0, 4097)), "TooManyCuts",
             "declares 4097 cuts in a 16-byte payload")
    bad_plan("plan_truncated.bin", raw_plan(plan, cuts)[:-2], "TruncatedPayload",
             "last cut cut short")
    bad_plan("plan_trailing.bin", raw_plan(plan, cuts) + bytes(4), "TrailingBytes",
             "4 bytes after the last cut")
    bad_plan("plan_counts_missing.bin", raw_prefix(MessageType.PLAN) + bytes(4),
             "TruncatedPayload", "12 bytes: the cut count is missing")

    n = FrameKind.NEIGHBOUR
    bad("neighbour_port_zero.bin", n, neighbour[:4] + b"\x00\x00" + neighbour[6:], "neighbour",
        "BadAddress", "port 0")
    bad("neighbour_wildcard.bin", n, encode_neighbour(NEIGHBOUR)[:6] + struct.pack("<H", 7)
        + b"0.0.0.0", "neighbour", "BadAddress", "host 0.0.0.0")
    bad("neighbour_truncated.bin", n, neighbour[:-1], "neighbour", "TruncatedPayload",
        "host one byte short")
    bad("abort_bad_utf8.bin", FrameKind.ABORT, encode_abort(Abort("BadProof", "ab"))[:-2]
        + b"\xc3\x28", "abort", "BadText", "reason is not UTF-8")
    bad("abort_empty_name.bin", FrameKind.ABORT, struct.pack("<HH", 0, 0), "abort", "BadText",
        "no error name")
    bad("rows_size_mismatch.bin", FrameKind.ROWS, ROWS_PAYLOAD[:-2], "rows", "RowsSizeMismatch",
        "30 bytes for 2 rows x 2 planes x 4 x bf16 (32)", round_no=7, rows=2)
    bad("go_with_payload.bin", FrameKind.GO, b"\x00", "empty", "TrailingBytes",
        "GO carries one byte")
    return out


def build() -> list[Fixture]:
    """Every fixture, good then bad, in manifest order."""
    fixtures = _good() + _bad_frames() + _bad_payloads()
    names = [f.name for f in fixtures]
    assert len(names) == len(set(names)), "fixture names repeat"
    return fixtures


# Reading them back ----------------------------------------------------------------------

_DECODERS: dict[str, Callable[[Frame], object]] = {
    "hello": lambda f: decode_hello(f.payload),
    "proof": lambda f: decode_proof(f.payload),
    "describe": lambda f: decode_describe(f.payload),
    "ready": lambda f: decode_ready(f.payload),
    "plan": lambda f: decode_plan(f.payload, round_no=f.round_no),
    "neighbour": lambda f: decode_neighbour(f.payload),
    "abort": lambda f: decode_abort(f.payload),
    "rows": lambda f: (check_rows_frame(f, **ROWS_FORMAT), f.payload)[1],
    "empty": lambda f: check_empty(f),
}


def decode_fixture(frame: Frame, message: str) -> object:
    """Decode a fixture frame's payload with the decoder its manifest entry names."""
    return _DECODERS[message](frame)


def to_jsonable(value: object) -> object:
    """The manifest's rendering: dataclasses as objects, enums by label, bytes as hex."""
    if isinstance(value, Enum):
        return getattr(value, "label", value.name.lower())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {key: to_jsonable(v) for key, v in value.items()}
    if isinstance(value, tuple | list):
        return [to_jsonable(v) for v in value]
    return value


def manifest(fixtures: list[Fixture]) -> dict[str, object]:
    entries = []
    for f in fixtures:
        entry: dict[str, object] = {"file": f.name, "message": f.message, "stage": f.stage}
        if f.stage == "ok":
            header = HEADER.unpack_from(f.data)
            entry["frame"] = {"kind": FrameKind(header[2]).name, "round": header[4],
                              "rows": header[5], "payload_length": header[6]}
            entry["decodes_to"] = to_jsonable(f.value)
        else:
            entry["raises"] = f.raises
        if f.note:
            entry["note"] = f.note
        entries.append(entry)
    return {
        "about": "ringfleet stage link golden frames; byte layouts in docs/wire-format.md. "
                 "stage: ok | frame (parser raises) | eof (parser raises at end of stream) | "
                 "payload (the message decoder raises).",
        "frame_max_payload_bytes": FIXTURE_MAX_PAYLOAD_BYTES,
        "control_max_payload_bytes": MAX_CONTROL_PAYLOAD_BYTES,
        "rows_format": to_jsonable(ROWS_FORMAT),
        "proof_inputs": {"key_hex": FIXTURE_KEY.hex(), "label": "ringfleet-link-v0",
                         "prover": to_jsonable(HELLO_RANK1), "verifier": to_jsonable(HELLO_RANK0)},
        "fixtures": entries,
    }


def manifest_text(fixtures: list[Fixture]) -> str:
    return json.dumps(manifest(fixtures), indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    fixtures = build()
    wanted = {f.name: f.data for f in fixtures}
    wanted[MANIFEST] = manifest_text(fixtures).encode("utf-8")
    if args.check:
        stale = [name for name, data in wanted.items()
                 if not (FIXTURE_DIR / name).is_file() or (FIXTURE_DIR / name).read_bytes() != data]
        extra = sorted(p.name for p in FIXTURE_DIR.glob("*") if p.name not in wanted)
        for name in stale + extra:
            sys.stderr.write(f"fixture out of date: {name}\n")
        return 1 if stale or extra else 0
    FIXTURE_DIR.mkdir(exist_ok=True)
    for old in FIXTURE_DIR.glob("*.bin"):
        if old.name not in wanted:
            old.unlink()
    for name, data in wanted.items():
        (FIXTURE_DIR / name).write_bytes(data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The good golden frames, checked against byte layouts written by hand from the wire format.

The fixtures are made by our own encoders, so comparing the encoders with them only pins
the encoders to themselves. Here every good frame is written out again, field by field,
from the tables of docs/wire-format.md and RFC section 6.4, with `struct` and byte literals
and nothing from `engine.link`: a change to a width, an offset, an enum value or a reserved
byte in the encoders (and so in regenerated fixtures) fails here, where a peer written in
another language would fail.
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


def frame(kind: int, payload: bytes, *, round_no: int = 0, rows: int = 0) -> bytes:
    """The 32-byte header (wire-format §1, "Header") and its payload."""
    header = (b"RFLK"          # 0: magic u32 0x4B4C4652
              + u16(1)         # 4: framing version
              + u8(kind)       # 6: kind
              + u8(0)          # 7: flags, none defined
              + u64(round_no)  # 8: round
              + u32(rows)      # 16: rows (ROWS frames only)
              + u32(len(payload))  # 20: payload length
              + bytes(8))      # 24: reserved
    assert len(header) == 32
    return header + payload


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
          generation: int) -> bytes:
    """Wire-format §3.4 stream entry, 28 bytes: op u8 and 3 reserved bytes, u32s elsewhere."""
    out = (u32(stream_id) + u8(op) + b"\x00\x00\x00" + u32(first) + u32(rows) + u32(accepted)
           + u32(resume) + u32(generation))
    assert len(out) == 28
    return out


PLAN_ENTRIES = (entry(0, OPEN, 0, 5, 0, 0, 0) + entry(2, CONTINUE, 12, 1, 1, 0, 3)
                + entry(3, CLOSE, 30, 0, 0, 0, 1) + entry(5, CANCEL, 4, 0, 0, 0, 2)
                + entry(9, RESUME, 8, 4, 0, 6, 2))
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

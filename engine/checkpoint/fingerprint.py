"""Fingerprints that bind a ring's stages to one checkpoint and one layout (the link's hello).

The checkpoint digest covers config.json, tokenizer.json and every safetensors file's name,
size and JSON header (each tensor's name, dtype, shape and offsets), plus the first and
last MiB of each file's tensor data, so two checkpoints of one shape (a base model and its
fine-tune) differ. It does not hash every weight byte: a stage reads only its own range,
and hashing a whole 16 GB checkpoint at every start would cost more than loading the range.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

SAMPLE_BYTES = 1 << 20
DIGEST_BYTES = 32


def _header_and_sample(path: Path) -> tuple[bytes, bytes]:
    """The file's JSON header, and its first and last MiB of tensor data."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = f.read(length)
        data_start, size = 8 + length, path.stat().st_size
        head = f.read(SAMPLE_BYTES)
        f.seek(max(data_start, size - SAMPLE_BYTES))
        return header, head + f.read(SAMPLE_BYTES)


def checkpoint_digest(directory: Path | str) -> bytes:
    """32 bytes naming the checkpoint in `directory` (see the module docstring for what is read)."""
    directory = Path(directory)
    h = hashlib.sha256(b"ringfleet-checkpoint-v1")
    for name in ("config.json", "tokenizer.json"):
        data = (directory / name).read_bytes()
        h.update(name.encode() + struct.pack("<Q", len(data)) + data)
    for path in sorted(directory.glob("*.safetensors")):
        header, sample = _header_and_sample(path)
        h.update(path.name.encode() + struct.pack("<QQ", path.stat().st_size, len(header)))
        h.update(header + sample)
    return h.digest()


def layout_fingerprint(checkpoint: bytes, ranges: list[tuple[int, int]]) -> bytes:
    """32 bytes naming the checkpoint and every rank's half-open range, backend-free."""
    if len(checkpoint) != DIGEST_BYTES:
        raise ValueError(f"checkpoint digest is {len(checkpoint)} bytes, not {DIGEST_BYTES}")
    for rank, (start, end) in enumerate(ranges):
        if not 0 <= start <= end < 1 << 32:
            raise ValueError(f"rank {rank}: layer range [{start}, {end}) is not a half-open range")
    h = hashlib.sha256(b"ringfleet-layout-v1" + checkpoint + struct.pack("<I", len(ranges)))
    for start, end in ranges:
        h.update(struct.pack("<II", start, end))
    return h.digest()

"""Request bodies decoded within their bound (`engine.api.bodies`): a gzip bomb is refused
with a 413 having produced no more than the bound plus one piece, whatever it expands to;
plain, gzip (several members), x-gzip and deflate (wrapped and raw) bodies decode to the
same bytes; truncated, broken and unknown encodings are named errors."""

from __future__ import annotations

import gzip
import zlib

import pytest

from engine.api.bodies import MAX_GZIP_MEMBERS, PIECE_BYTES, BoundedDecoder
from engine.api.errors import ApiError

BODY = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"hi " * 5000 + b'"}]}'


def gzip_bomb(expanded_bytes: int) -> bytes:
    """A gzip stream of zeros: about 1 byte per 1,000 it expands to."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(1 << 20)
    return b"".join([packer.compress(zeros) for _ in range(expanded_bytes >> 20)]
                    + [packer.flush()])


def feed_all(decoder: BoundedDecoder, data: bytes, piece: int = 65536) -> bytes:
    out = b"".join(decoder.feed(data[i:i + piece]) for i in range(0, len(data), piece))
    decoder.finish()
    return out


def test_a_gzip_bomb_stops_at_the_bound_with_a_413():
    bomb = gzip_bomb(256 << 20)
    assert len(bomb) < 300_000  # 256 MiB of zeros, a quarter of a megabyte on the wire
    limit = 1 << 20
    decoder = BoundedDecoder("gzip", limit)
    fed = 0
    with pytest.raises(ApiError) as refused:
        for i in range(0, len(bomb), 4096):
            fed += 4096
            decoder.feed(bomb[i:i + 4096])
    assert refused.value.status == 413 and str(limit) in refused.value.message
    # What bounds the memory: no zlib call made more than a piece, and in all no more than
    # one byte past the bound was made before the refusal; the rest was never read.
    assert decoder.largest_piece <= PIECE_BYTES
    assert decoder.decoded == limit + 1
    assert fed < len(bomb) // 50


@pytest.mark.parametrize("encoding, packed", [
    ("", BODY), ("identity", BODY), ("gzip", gzip.compress(BODY)),
    ("x-gzip", gzip.compress(BODY)), ("GZIP", gzip.compress(BODY)),
    ("gzip", gzip.compress(BODY[:100]) + gzip.compress(BODY[100:])),  # two members
    ("deflate", zlib.compress(BODY)),
    ("deflate", zlib.compress(BODY)[2:-4]),  # raw deflate, as some clients send it
])
def test_bodies_decode_to_the_same_bytes_fed_whole_or_byte_by_byte(encoding, packed):
    assert feed_all(BoundedDecoder(encoding, len(BODY)), packed) == BODY
    assert feed_all(BoundedDecoder(encoding, len(BODY)), packed, piece=1) == BODY
    with pytest.raises(ApiError) as refused:  # one byte less room: refused by name
        feed_all(BoundedDecoder(encoding, len(BODY) - 1), packed)
    assert refused.value.status == 413


@pytest.mark.parametrize("encoding, packed, status, named", [
    ("gzip", gzip.compress(BODY)[:-10], 400, "truncated"),
    ("gzip", b"not gzip at all", 400, "not valid gzip"),
    ("deflate", zlib.compress(BODY) + b"x", 400, "after the end"),
    ("gzip", gzip.compress(b"{}") * (MAX_GZIP_MEMBERS + 1), 400, "members"),
    ("br", b"...", 415, "'br'"),
    ("gzip, gzip", b"...", 415, "'gzip, gzip'"),
])
def test_broken_and_unknown_encodings_are_named(encoding, packed, status, named):
    with pytest.raises(ApiError) as refused:
        feed_all(BoundedDecoder(encoding, 1 << 20), packed)
    assert refused.value.status == status and named in refused.value.message

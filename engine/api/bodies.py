"""A request body read whole within its byte bound, decompressed (gzip, deflate) in a
stream that stops at the bound, so a small body that expands far past it costs no more
memory than the bound itself.

aiohttp's own decompression inflates each received piece before anything counts the
bytes, so a 1 MB gzip body of zeros grew the process by well over 100 MB before its 413.
Rank 0 and the front door serve with aiohttp's decompression off and read their bodies
here: `BoundedDecoder` never asks zlib for more than the room left (plus one byte, to know
the bound is passed), and the reading stops at the first byte past it.
"""

from __future__ import annotations

import asyncio
import zlib

from aiohttp import web

from engine.api.errors import ApiError

PIECE_BYTES = 64 << 10  # the most one decompress call may produce
MAX_GZIP_MEMBERS = 64  # concatenated gzip members are legal; thousands are an attack
GZIP_WBITS = 16 + zlib.MAX_WBITS
ENCODINGS = ("identity", "gzip", "x-gzip", "deflate")


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes",
                    code="request_too_large")


class BoundedDecoder:
    """Content-Encoding undone piece by piece; `feed` raises a 413 `ApiError` as soon as
    the decoded bytes pass `limit`, having produced at most `limit` + PIECE_BYTES of them
    in all (and at most PIECE_BYTES per zlib call), whatever the input expands to."""

    def __init__(self, encoding: str, limit: int) -> None:
        coding = encoding.strip().lower() or "identity"
        if coding not in ENCODINGS:
            raise ApiError(415, f"Content-Encoding {encoding!r} is not supported (use one "
                           f"of: {', '.join(ENCODINGS)})", code="unsupported_encoding")
        self.coding, self.limit = coding, limit
        self.decoded = 0  # bytes produced so far
        self.largest_piece = 0  # the most one zlib call produced (what bounds memory)
        self.members = 1
        self._zlib: zlib._Decompress | None = None
        if coding in ("gzip", "x-gzip"):
            self._zlib = zlib.decompressobj(GZIP_WBITS)

    def _count(self, out: bytes) -> bytes:
        self.decoded += len(out)
        self.largest_piece = max(self.largest_piece, len(out))
        if self.decoded > self.limit:
            raise too_large(self.limit)
        return out

    def feed(self, data: bytes) -> bytes:
        if self.coding == "identity":
            return self._count(data)
        if self._zlib is None:  # deflate: zlib-wrapped as the RFC says, or raw as some send
            wbits = zlib.MAX_WBITS if data and data[0] & 0x0F == 8 else -zlib.MAX_WBITS
            self._zlib = zlib.decompressobj(wbits)
        pieces = []
        while data:
            room = self.limit - self.decoded + 1  # one byte past the bound is enough to know
            try:
                out = self._zlib.decompress(data, min(PIECE_BYTES, room))
            except zlib.error as exc:
                raise self._bad(exc) from exc
            pieces.append(self._count(out))
            data = self._zlib.unconsumed_tail
            if self._zlib.eof:
                data = self._zlib.unused_data + data
                if data and self.coding != "deflate":  # the next gzip member
                    self.members += 1
                    if self.members > MAX_GZIP_MEMBERS:
                        raise ApiError(400, f"the gzip body has more than {MAX_GZIP_MEMBERS} "
                                       "members", code="bad_encoding")
                    self._zlib = zlib.decompressobj(GZIP_WBITS)
                elif data:
                    raise ApiError(400, "bytes after the end of the deflate body",
                                   code="bad_encoding")
        return b"".join(pieces)

    def finish(self) -> None:
        """The body ended: a compressed one must have ended with its stream."""
        if self.coding != "identity" and (self._zlib is None or not self._zlib.eof):
            raise ApiError(400, f"the {self.coding} body is truncated", code="bad_encoding")

    def _bad(self, exc: zlib.error) -> ApiError:
        return ApiError(400, f"the body is not valid {self.coding}: {exc}", code="bad_encoding")


async def read_body(request: web.Request, limit: int, within_s: float) -> bytes:
    """The whole body, decoded, or an `ApiError`: 408 past `within_s`, 413 past `limit`
    bytes (compressed or decoded), 415 an encoding not supported, 400 a broken one.
    The app must serve with aiohttp's decompression off (`auto_decompress=False`)."""
    decoder = BoundedDecoder(request.headers.get("Content-Encoding", ""), limit)
    body = bytearray()
    received = 0
    try:
        async with asyncio.timeout(within_s):
            while chunk := await request.content.readany():
                received += len(chunk)
                if received > limit:
                    raise too_large(limit)
                body += decoder.feed(chunk)
    except TimeoutError as exc:
        raise ApiError(408, f"the request body did not arrive within {within_s:g} s",
                       code="request_timeout") from exc
    decoder.finish()
    return bytes(body)

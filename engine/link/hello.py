"""The link's hello and shared-key proof, both ways, as a sans-IO handshake.

Each side sends HELLO (rank, world, fingerprint, a fresh nonce), checks the other's, then
sends PROOF = HMAC-SHA256(key, label + role + own nonce + peer nonce + own rank + peer
rank + fingerprint) and verifies the peer's with `hmac.compare_digest`. The role byte is
0 in the proof of the lower rank and 1 in the proof of the higher, so neither side's proof
is ever the one it expects back, whichever side connected. Nothing here touches a socket
(engine.link.transport drives it).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from engine.link.errors import (
    BadKeyFile,
    BadProof,
    ConnectionFailed,
    FingerprintMismatch,
    ProtocolError,
    RankMismatch,
    TrailingBytes,
    TruncatedPayload,
    UnexpectedFrame,
    WorldMismatch,
    error_from_abort,
)
from engine.link.frame import Frame, FrameKind, encode_frame
from engine.link.messages import decode_abort

HELLO = struct.Struct("<II32s32s")  # rank, world, fingerprint, nonce
HELLO_BYTES = HELLO.size  # 72
FINGERPRINT_BYTES = 32
NONCE_BYTES = 32
PROOF_BYTES = 32  # HMAC-SHA256
PROOF_LABEL = b"ringfleet-link-v0"
MIN_KEY_BYTES = 16
MAX_KEY_FILE_BYTES = 4096
# A real peer answers a hello within milliseconds of connecting; a stranger gets this long
# (a listener's accept loop runs each handshake under it).
HANDSHAKE_DEADLINE_S = 5.0
_RANKS = struct.Struct("<II")
_HEX_KEY = re.compile(rb"[0-9a-fA-F]+")


@dataclass(frozen=True)
class Hello:
    """What a side says about itself before anything else."""

    rank: int
    world: int
    fingerprint: bytes  # 32 bytes: the checkpoint and every rank's layer range
    nonce: bytes  # 32 fresh random bytes a connection


def encode_hello(hello: Hello) -> bytes:
    """The 72-byte HELLO payload."""
    if len(hello.fingerprint) != FINGERPRINT_BYTES or len(hello.nonce) != NONCE_BYTES:
        raise ValueError("a hello's fingerprint and nonce are 32 bytes each")
    return HELLO.pack(hello.rank, hello.world, hello.fingerprint, hello.nonce)


def decode_hello(payload: bytes) -> Hello:
    """Decode a HELLO payload; a rank outside its own world is refused here."""
    if len(payload) < HELLO_BYTES:
        raise TruncatedPayload(f"hello payload is {len(payload)} bytes; it is {HELLO_BYTES}")
    if len(payload) > HELLO_BYTES:
        raise TrailingBytes(f"hello payload is {len(payload)} bytes; it is {HELLO_BYTES}")
    rank, world, fingerprint, nonce = HELLO.unpack(payload)
    if world == 0:
        raise WorldMismatch("hello declares a world of 0 ranks")
    if rank >= world:
        raise RankMismatch(f"hello declares rank {rank} in a world of {world}")
    return Hello(rank, world, fingerprint, nonce)


def decode_proof(payload: bytes) -> bytes:
    """A PROOF payload is the 32-byte MAC, nothing else."""
    if len(payload) < PROOF_BYTES:
        raise TruncatedPayload(f"proof payload is {len(payload)} bytes; it is {PROOF_BYTES}")
    if len(payload) > PROOF_BYTES:
        raise TrailingBytes(f"proof payload is {len(payload)} bytes; it is {PROOF_BYTES}")
    return payload


def proof_mac(key: bytes, *, prover: Hello, verifier: Hello) -> bytes:
    """The 32-byte proof that `prover` sends to `verifier` (both hellos as sent)."""
    role = b"\x00" if prover.rank < verifier.rank else b"\x01"
    message = b"".join((
        PROOF_LABEL,
        role,
        prover.nonce,
        verifier.nonce,
        _RANKS.pack(prover.rank, verifier.rank),
        prover.fingerprint,
    ))
    return hmac.new(key, message, hashlib.sha256).digest()


def _refuse_other_kind(frame: Frame, expected: FrameKind) -> None:
    if frame.kind is FrameKind.ABORT:
        abort = decode_abort(frame.payload)
        raise error_from_abort(abort.error, abort.reason)
    if frame.kind is not expected:
        raise UnexpectedFrame(f"expected a {expected.name} frame during the handshake, "
                              f"got {frame.kind.name}")


class Handshake:
    """One side's hello-and-proof state machine; every refusal raises its named error.

    Use: send `hello_bytes()`, pass the peer's frame to `receive_hello`, send
    `proof_bytes()`, pass the peer's frame to `receive_proof`. `done` is then True.
    """

    def __init__(
        self,
        *,
        rank: int,
        world: int,
        fingerprint: bytes,
        key: bytes,
        expect_peer_rank: int | None = None,
        nonce: bytes | None = None,
    ) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a world of {world}")
        if len(fingerprint) != FINGERPRINT_BYTES:
            raise ValueError(f"fingerprint is {len(fingerprint)} bytes; it must be 32")
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"link key is {len(key)} bytes; it must be at least {MIN_KEY_BYTES}")
        if expect_peer_rank is not None and not 0 <= expect_peer_rank < world:
            raise ValueError(f"expected peer rank {expect_peer_rank} is outside a world of {world}")
        nonce = os.urandom(NONCE_BYTES) if nonce is None else nonce
        if len(nonce) != NONCE_BYTES:
            raise ValueError(f"nonce is {len(nonce)} bytes; it must be 32")
        self.own = Hello(rank, world, fingerprint, nonce)
        self.expect_peer_rank = expect_peer_rank
        self._key = key
        self.peer: Hello | None = None
        self.done = False
        self._failed: ProtocolError | None = None

    def hello_bytes(self) -> bytes:
        """Our HELLO frame."""
        return encode_frame(FrameKind.HELLO, encode_hello(self.own))

    def receive_hello(self, frame: Frame) -> Hello:
        """Check the peer's HELLO: world, fingerprint, then rank (each side checks alike)."""
        self._check_alive()
        if self.peer is not None:
            return self._fail(UnexpectedFrame("a second HELLO frame during the handshake"))
        try:
            _refuse_other_kind(frame, FrameKind.HELLO)
            peer = decode_hello(frame.payload)
            own = self.own
            if peer.world != own.world:
                raise WorldMismatch(
                    f"peer rank {peer.rank} runs a world of {peer.world}; "
                    f"rank {own.rank} runs {own.world}"
                )
            if not hmac.compare_digest(peer.fingerprint, own.fingerprint):
                raise FingerprintMismatch(
                    f"peer rank {peer.rank} has fingerprint {peer.fingerprint.hex()[:16]}…; "
                    f"rank {own.rank} has {own.fingerprint.hex()[:16]}… "
                    "(another checkpoint or layout)"
                )
            if peer.rank == own.rank:
                raise RankMismatch(f"peer claims rank {peer.rank}, which is our own rank")
            if self.expect_peer_rank is not None and peer.rank != self.expect_peer_rank:
                raise RankMismatch(
                    f"rank {own.rank} expected rank {self.expect_peer_rank} here; "
                    f"the peer is rank {peer.rank}"
                )
            if peer.nonce == own.nonce:
                raise BadProof("the peer's hello nonce equals ours (a reflected hello)")
        except ProtocolError as error:
            return self._fail(error)
        self.peer = peer
        return peer

    def proof_bytes(self) -> bytes:
        """Our PROOF frame; only after the peer's hello was accepted."""
        self._check_alive()
        if self.peer is None:
            raise RuntimeError("proof_bytes() before receive_hello() accepted a hello")
        return encode_frame(FrameKind.PROOF, proof_mac(self._key, prover=self.own,
                                                       verifier=self.peer))

    def receive_proof(self, frame: Frame) -> None:
        """Verify the peer's PROOF; `done` becomes True."""
        self._check_alive()
        if self.peer is None:
            return self._fail(UnexpectedFrame("a PROOF frame before the peer's HELLO"))
        try:
            _refuse_other_kind(frame, FrameKind.PROOF)
            mac = decode_proof(frame.payload)
            expected = proof_mac(self._key, prover=self.peer, verifier=self.own)
            if not hmac.compare_digest(mac, expected):
                raise BadProof(
                    f"rank {self.peer.rank}'s proof does not verify: "
                    "the peers hold different link keys"
                )
        except ProtocolError as error:
            self._fail(error)
        self.done = True

    def _fail(self, error: ProtocolError) -> NoReturn:
        self._failed = error
        raise error

    def _check_alive(self) -> None:
        if self._failed is not None:
            raise ConnectionFailed(self._failed)


def read_key_file(path: str | os.PathLike[str]) -> bytes:
    """The shared link key from FLEET_KEY_FILE: raw bytes, or hex text; at least 16 bytes.

    One trailing newline is dropped. A file holding only an even number of hex digits
    (surrounding whitespace aside) is read as hex, so `openssl rand -hex 32 > key` works.
    """
    key_path = Path(path)
    try:
        with key_path.open("rb") as handle:
            data = handle.read(MAX_KEY_FILE_BYTES + 1)
    except FileNotFoundError:
        raise BadKeyFile(f"link key file {key_path} does not exist") from None
    except OSError as error:
        raise BadKeyFile(f"link key file {key_path} cannot be read: {error}") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise BadKeyFile(f"link key file {key_path} is over {MAX_KEY_FILE_BYTES} bytes")
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    stripped = data.strip()
    if stripped and len(stripped) % 2 == 0 and _HEX_KEY.fullmatch(stripped):
        data = bytes.fromhex(stripped.decode("ascii"))
    if len(data) < MIN_KEY_BYTES:
        raise BadKeyFile(
            f"link key file {key_path} holds a {len(data)}-byte key; "
            f"it must be at least {MIN_KEY_BYTES} bytes (e.g. `openssl rand -hex 32`)"
        )
    return data

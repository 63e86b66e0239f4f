"""Mutation fuzz of every link parser: the frame parser, the hello handshake, each decoder.

Seeds are the golden fixtures (good and bad); each input is a seed with a few seeded
mutations (bit flips, interesting values in u16/u32 fields, cuts, inserts, repeats, splices
with another fixture). The rule (h11's): any input parses or raises the link's
`ProtocolError` base, never another exception, and never hangs (each run is bounded in
time). Whatever parses must also be what its bytes say: it re-encodes to the same bytes, a
hello the handshake accepts passes every check the handshake promises, a proof it accepts
is the true MAC. A failure names the seed, the case number and the input's hex.
"""

from __future__ import annotations

import random
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable

import pytest

from engine.harness.make_fixtures import (
    FIXTURE_FINGERPRINT,
    FIXTURE_KEY,
    FIXTURE_MAX_PAYLOAD_BYTES,
    HELLO_RANK0,
    HELLO_RANK1,
    ROWS_FORMAT,
    build,
    decode_fixture,
)
from engine.link import errors
from engine.link.accept_loop import AcceptLoop
from engine.link.frame import Frame, FrameKind, FrameParser, encode_frame
from engine.link.hello import Handshake, encode_hello, proof_mac
from engine.link.messages import (
    encode_abort,
    encode_describe,
    encode_neighbour,
    encode_plan,
    encode_ready,
)
from engine.link.transport import connect, handshake, listen

pytestmark = pytest.mark.timeout(120)  # a hang fails here rather than stalling the suite

CASES_PER_MESSAGE = 3000
TIME_BOUND_S = 30.0  # per message; a few thousand inputs take well under a second
FIXTURES = build()
MESSAGES = ["hello", "proof", "describe", "ready", "plan", "neighbour", "abort", "rows", "empty"]
DECODER_OF_KIND = {FrameKind.HELLO: "hello", FrameKind.PROOF: "proof",
                   FrameKind.DESCRIBE: "describe", FrameKind.READY: "ready",
                   FrameKind.PLAN: "plan", FrameKind.NEIGHBOUR: "neighbour",
                   FrameKind.ABORT: "abort", FrameKind.ROWS: "rows", FrameKind.GO: "empty",
                   FrameKind.GOODBYE: "empty"}
INTERESTING_U32 = (0, 1, 2, 0x7F, 0x80, 0xFF, 0x100, 4095, 4096, 4097, 0x7FFF_FFFF,
                   0x8000_0000, 0xFFFF_FFFE, 0xFFFF_FFFF)
INTERESTING_U16 = (0, 1, 64, 65, 255, 256, 4096, 4097, 0x7FFF, 0xFFFF)
HEADER_BYTES = 32


def seeds(message: str) -> list[bytes]:
    return [f.data for f in FIXTURES if f.message == message]


def mutate(data: bytes, rng: random.Random) -> bytes:
    """`data` after one to four random edits."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.randrange(8)
        at = rng.randrange(len(out) + 1)
        if choice == 0 and out:  # flip a bit
            i = rng.randrange(len(out))
            out[i] ^= 1 << rng.randrange(8)
        elif choice == 1 and out:  # a random byte
            out[rng.randrange(len(out))] = rng.randrange(256)
        elif choice == 2 and len(out) >= 4:  # an interesting u32 at any offset
            i = rng.randrange(len(out) - 3)
            out[i:i + 4] = struct.pack("<I", rng.choice(INTERESTING_U32))
        elif choice == 3 and len(out) >= 2:  # an interesting u16
            i = rng.randrange(len(out) - 1)
            out[i:i + 2] = struct.pack("<H", rng.choice(INTERESTING_U16))
        elif choice == 4:  # cut the end off
            del out[at:]
        elif choice == 5:  # insert random bytes
            out[at:at] = rng.randbytes(rng.randint(1, 40))
        elif choice == 6 and out:  # repeat a piece
            i = rng.randrange(len(out))
            out[at:at] = out[i:i + rng.randint(1, 32)]
        else:  # splice the tail of another fixture
            other = rng.choice(FIXTURES).data
            out[at:] = other[rng.randrange(len(other) + 1):]
    return bytes(out)


def reencode(message: str, frame: Frame, value: object) -> bytes | None:
    """The payload the encoder makes of what was decoded (None: nothing to compare)."""
    encoders: dict[str, Callable[[object], bytes]] = {
        "hello": encode_hello, "describe": encode_describe, "ready": encode_ready,
        "plan": encode_plan, "neighbour": encode_neighbour, "abort": encode_abort,
    }
    if message in encoders:
        return encoders[message](value)
    if message in ("proof", "rows"):
        return bytes(value) if isinstance(value, bytes | bytearray) else frame.payload
    return b""  # GO and GOODBYE


def check_decode(message: str, frame: Frame) -> str:
    """Decode `frame` as `message`; what decodes must re-encode to its own bytes."""
    try:
        value = decode_fixture(frame, message)
    except errors.ProtocolError:
        return "refused"
    assert reencode(message, frame, value) == frame.payload, (message, value)
    return "decoded"


def rank0_handshake() -> Handshake:
    return Handshake(rank=0, world=2, fingerprint=FIXTURE_FINGERPRINT, key=FIXTURE_KEY,
                     nonce=HELLO_RANK0.nonce)


def check_hello(frame: Frame) -> None:
    """Rank 0's handshake takes the frame as rank 1's hello: accepted means fully checked."""
    hs = rank0_handshake()
    try:
        peer = hs.receive_hello(frame)
    except errors.ProtocolError:
        with pytest.raises(errors.ConnectionFailed):  # and it stays failed
            hs.receive_hello(frame)
        return
    assert frame.kind is FrameKind.HELLO
    assert peer.world == 2 and peer.fingerprint == FIXTURE_FINGERPRINT
    assert peer.rank == 1 and peer.nonce != HELLO_RANK0.nonce


def check_proof(frame: Frame) -> None:
    """After a good hello, only the true MAC in a PROOF frame completes the handshake."""
    hs = rank0_handshake()
    hs.receive_hello(Frame(FrameKind.HELLO, 0, 0, 0, encode_hello(HELLO_RANK1)))
    try:
        hs.receive_proof(frame)
    except errors.ProtocolError:
        assert not hs.done
        return
    assert hs.done and frame.kind is FrameKind.PROOF
    assert frame.payload == proof_mac(FIXTURE_KEY, prover=HELLO_RANK1, verifier=HELLO_RANK0)


def feed_all(data: bytes, rng: random.Random) -> tuple[list[Frame], bool]:
    """Every frame the parser takes from `data`, fed in random pieces, then end of stream,
    and whether it refused the rest (a refusal leaves it failed for good)."""
    parser = FrameParser(FIXTURE_MAX_PAYLOAD_BYTES)
    frames: list[Frame] = []
    try:
        at = 0
        while at < len(data):
            step = rng.randint(1, 64)
            parser.feed(data[at:at + step])
            at += step
            frames.extend(parser)
        parser.feed_eof()
        frames.extend(parser)
    except errors.ProtocolError:
        with pytest.raises(errors.ConnectionFailed):
            parser.next_frame()
        return frames, True
    return frames, False


def fuzz(message: str, pool: list[bytes],
         case: Callable[[bytes, random.Random], str]) -> Counter[str]:
    """Run `case` on CASES_PER_MESSAGE mutations of the seeds in `pool`; how each ended."""
    rng = random.Random(f"link fuzz {message}")
    outcomes: Counter[str] = Counter()
    started = time.monotonic()
    for n in range(CASES_PER_MESSAGE):
        data = mutate(rng.choice(pool), rng)
        try:
            outcomes[case(data, rng)] += 1
        except BaseException as error:
            raise AssertionError(f"{message} case {n}: {type(error).__name__}: {error}; "
                                 f"input {data.hex()}") from error
        assert time.monotonic() - started < TIME_BOUND_S, f"{message}: slow at case {n}"
    return outcomes


@pytest.mark.parametrize("message", MESSAGES)
def test_mutated_frames_parse_or_raise_protocol_error(message):
    """Whole mutated frames through the parser, then each frame through its kind's decoder
    (a HELLO or PROOF also through the handshake)."""
    def case(data: bytes, rng: random.Random) -> str:
        frames, refused = feed_all(data, rng)
        outcome = "parser refused" if refused and not frames else "reached a decoder"
        for frame in frames:
            check_decode(DECODER_OF_KIND[frame.kind], frame)
            if frame.kind is FrameKind.HELLO:
                check_hello(frame)
            if frame.kind is FrameKind.PROOF:
                check_proof(frame)
        return outcome

    outcomes = fuzz(message, seeds(message), case)
    assert sum(outcomes.values()) == CASES_PER_MESSAGE
    # Both layers are exercised: not everything dies in the header.
    assert min(outcomes["parser refused"], outcomes["reached a decoder"]) > 150, outcomes


@pytest.mark.parametrize("message", MESSAGES)
def test_mutated_payloads_decode_or_raise_protocol_error(message):
    """Mutated payloads straight into the decoder, under the seed's own header, so the
    decoder (not the frame parser) meets every mutation."""
    kind = next(k for k, m in DECODER_OF_KIND.items() if m == message)
    row_bytes = ROWS_FORMAT["hidden"] * ROWS_FORMAT["planes"] * 2  # bfloat16

    def case(data: bytes, rng: random.Random) -> str:
        rows = len(data) // row_bytes + rng.choice((0, 0, 1)) if kind is FrameKind.ROWS else 0
        frame = Frame(kind, 0, rng.choice((0, 7)), rows, data)
        outcome = check_decode(message, frame)
        if message == "hello":
            check_hello(frame)
        if message == "proof":
            check_proof(frame)
        return outcome

    payloads = [f.data[HEADER_BYTES:] for f in FIXTURES if f.message == message]
    outcomes = fuzz(message, payloads, case)
    assert sum(outcomes.values()) == CASES_PER_MESSAGE
    assert outcomes["refused"] > 150, outcomes  # the mutations reach the decoder's checks


def test_an_accept_loop_survives_mutated_handshakes_over_real_sockets():
    """Mutated HELLO and PROOF bytes sent to a real listener: each connection is refused
    or ends, none blocks the loop, and the real peer still gets in afterwards."""
    rng = random.Random("link fuzz accept loop")
    hello_seeds = seeds("hello") + seeds("proof")
    listener = listen("127.0.0.1", 0)
    port = listener.getsockname()[1]
    refused: list[object] = []
    with AcceptLoop(listener, rank0_handshake, name="fuzzed port", on_refused=refused.append,
                    handshake_deadline_s=2.0) as loop:
        started = time.monotonic()
        for _ in range(200):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(mutate(rng.choice(hello_seeds), rng))
                sock.shutdown(socket.SHUT_WR)
                while sock.recv(4096):  # our HELLO, maybe an ABORT, then end of stream
                    pass
        assert time.monotonic() - started < 60
        link = connect("127.0.0.1", port, deadline_s=5)
        peer = Handshake(rank=1, world=2, fingerprint=FIXTURE_FINGERPRINT, key=FIXTURE_KEY)
        handshake(link, peer, deadline_s=5)
        admitted, hello = loop.next_peer(deadline_s=5)
        assert hello.rank == 1
        admitted.close()
        link.close()
    assert loop.refused == 200


def test_the_fuzz_seeds_cover_every_message_and_the_mutator_changes_them():
    assert all(seeds(message) for message in MESSAGES)
    rng = random.Random(0)
    hello = encode_frame(FrameKind.HELLO, encode_hello(HELLO_RANK1))
    assert sum(mutate(hello, rng) != hello for _ in range(100)) > 90

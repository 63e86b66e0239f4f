"""The sans-IO hello-and-proof handshake, the hello codec and reading the link key file."""

from __future__ import annotations

import hashlib
import hmac

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.link import errors
from engine.link.frame import Frame, FrameKind, FrameParser, encode_frame
from engine.link.hello import (
    Handshake,
    Hello,
    decode_hello,
    decode_proof,
    encode_hello,
    proof_mac,
    read_key_file,
)
from engine.link.messages import Abort, encode_message

KEY = b"k" * 32
FINGERPRINT = hashlib.sha256(b"model+layout").digest()


def frame_of(data: bytes) -> Frame:
    parser = FrameParser(1 << 16)
    parser.feed(data)
    frame = parser.next_frame()
    assert isinstance(frame, Frame)
    return frame


def pair(a: dict | None = None, b: dict | None = None) -> tuple[Handshake, Handshake]:
    base = {"world": 2, "fingerprint": FINGERPRINT, "key": KEY}
    return (Handshake(rank=0, **{**base, **(a or {})}),
            Handshake(rank=1, **{**base, **(b or {})}))


def exchange_hellos(a: Handshake, b: Handshake) -> tuple[object, object]:
    """Each side receives the other's hello; returns each side's outcome (Hello or error)."""
    outcomes = []
    for me, peer in ((a, b), (b, a)):
        try:
            outcomes.append(me.receive_hello(frame_of(peer.hello_bytes())))
        except errors.ProtocolError as error:
            outcomes.append(error)
    return outcomes[0], outcomes[1]


def test_handshake_succeeds_both_ways():
    a, b = pair()
    ha, hb = exchange_hellos(a, b)
    assert ha == b.own and hb == a.own
    a.receive_proof(frame_of(b.proof_bytes()))
    b.receive_proof(frame_of(a.proof_bytes()))
    assert a.done and b.done


def test_proofs_differ_by_direction():
    a, b = pair()
    exchange_hellos(a, b)
    assert a.proof_bytes() != b.proof_bytes()
    # A reflected proof (our own sent back) does not verify.
    with pytest.raises(errors.BadProof):
        a.receive_proof(frame_of(a.proof_bytes()))


@pytest.mark.parametrize(("a", "b", "error"), [
    ({}, {"world": 3}, errors.WorldMismatch),
    ({}, {"fingerprint": bytes(32)}, errors.FingerprintMismatch),
])
def test_hello_refusals_are_named_on_both_sides(a, b, error):
    side_a, side_b = pair(a, b)
    outcome_a, outcome_b = exchange_hellos(side_a, side_b)
    assert type(outcome_a) is error and type(outcome_b) is error
    assert not outcome_a.remote
    with pytest.raises(errors.ConnectionFailed):
        side_a.proof_bytes()


def test_wrong_key_is_bad_proof_on_both_sides():
    a, b = pair({}, {"key": b"x" * 32})
    exchange_hellos(a, b)
    proof_a, proof_b = a.proof_bytes(), b.proof_bytes()
    with pytest.raises(errors.BadProof, match="different link keys"):
        a.receive_proof(frame_of(proof_b))
    with pytest.raises(errors.BadProof):
        b.receive_proof(frame_of(proof_a))
    assert not a.done and not b.done


def test_expected_peer_rank():
    a, b = pair({"expect_peer_rank": 1})
    assert exchange_hellos(a, b)[0] == b.own
    a = Handshake(rank=0, world=3, fingerprint=FINGERPRINT, key=KEY, expect_peer_rank=2)
    b = Handshake(rank=1, world=3, fingerprint=FINGERPRINT, key=KEY)
    with pytest.raises(errors.RankMismatch, match="expected rank 2"):
        a.receive_hello(frame_of(b.hello_bytes()))


def test_same_rank_and_reflected_hello_are_refused():
    a, _ = pair()
    with pytest.raises(errors.RankMismatch, match="our own rank"):
        a.receive_hello(frame_of(a.hello_bytes()))
    a, b = pair({"nonce": bytes(32)}, {"nonce": bytes(32)})
    with pytest.raises(errors.BadProof, match="reflected"):
        a.receive_hello(frame_of(b.hello_bytes()))


def test_peer_abort_surfaces_as_remote_named_error():
    a, _ = pair()
    abort = encode_message(Abort("FingerprintMismatch", "rank 1 has another checkpoint"))
    with pytest.raises(errors.FingerprintMismatch) as raised:
        a.receive_hello(frame_of(abort))
    assert raised.value.remote is True and "another checkpoint" in str(raised.value)


def test_wrong_frame_kinds_and_order():
    a, b = pair()
    with pytest.raises(errors.UnexpectedFrame):
        a.receive_hello(frame_of(encode_frame(FrameKind.GO)))
    a, b = pair()
    with pytest.raises(errors.UnexpectedFrame, match="before the peer's HELLO"):
        a.receive_proof(frame_of(encode_frame(FrameKind.PROOF, bytes(32))))
    a, b = pair()
    exchange_hellos(a, b)
    with pytest.raises(errors.UnexpectedFrame):
        a.receive_proof(frame_of(b.hello_bytes()))


def test_garbage_hello_payload():
    a, _ = pair()
    with pytest.raises(errors.TruncatedPayload):
        a.receive_hello(frame_of(encode_frame(FrameKind.HELLO, b"garbage")))


def test_hello_codec_and_proof_formula():
    hello = Hello(3, 4, FINGERPRINT, bytes(range(32)))
    assert decode_hello(encode_hello(hello)) == hello
    assert len(encode_hello(hello)) == 72
    peer = Hello(1, 4, FINGERPRINT, bytes(range(32, 64)))
    message = (b"ringfleet-link-v0" + b"\x01" + hello.nonce + peer.nonce
               + (3).to_bytes(4, "little") + (1).to_bytes(4, "little") + FINGERPRINT)
    assert proof_mac(KEY, prover=hello, verifier=peer) == hmac.new(
        KEY, message, hashlib.sha256).digest()
    with pytest.raises(errors.TrailingBytes):
        decode_proof(bytes(33))


@pytest.mark.parametrize("kwargs", [
    {"rank": 2, "world": 2}, {"fingerprint": b"short"}, {"key": b"short"},
    {"nonce": b"n"}, {"expect_peer_rank": 5},
])
def test_handshake_arguments_are_checked(kwargs):
    base = {"rank": 0, "world": 2, "fingerprint": FINGERPRINT, "key": KEY}
    with pytest.raises(ValueError):
        Handshake(**{**base, **kwargs})


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=100))
def test_fuzz_hello_and_proof_decoders(payload):
    for decode in (decode_hello, decode_proof):
        try:
            decode(payload)
        except errors.ProtocolError:
            pass


def test_read_key_file(tmp_path):
    raw = tmp_path / "raw"
    raw.write_bytes(b"\x00\x01" * 8 + b"\n")
    assert read_key_file(raw) == b"\x00\x01" * 8
    hex_key = tmp_path / "hex"
    hex_key.write_text("ab" * 32 + "\n")
    assert read_key_file(hex_key) == bytes([0xAB]) * 32
    crlf = tmp_path / "crlf"
    crlf.write_bytes(b"p" * 20 + b"\r\n")
    assert read_key_file(crlf) == b"p" * 20


@pytest.mark.parametrize(("content", "match"), [
    (None, "does not exist"),
    (b"", "0-byte key"),
    (b"short\n", "5-byte key"),
    (b"ab" * 15, "15-byte key"),  # hex text: 15 bytes once decoded
    (b"x" * 5000, "over 4096 bytes"),
])
def test_read_key_file_refusals(tmp_path, content, match):
    path = tmp_path / "key"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(errors.BadKeyFile, match=match):
        read_key_file(path)


def test_read_key_file_directory(tmp_path):
    with pytest.raises(errors.BadKeyFile, match="cannot be read"):
        read_key_file(tmp_path)

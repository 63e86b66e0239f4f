"""Liveness over a real loopback link: a silent or lost peer ends the rank, named by rank and
the address it listens on."""

from __future__ import annotations

import hashlib
import threading
import time

from engine.link.hello import Handshake
from engine.link.transport import Link, accept, connect, handshake, listen
from engine.pipeline.liveness import Fate, LivenessConfig, watch

KEY = b"l" * 32
FINGERPRINT = hashlib.sha256(b"liveness test").digest()
HOST = "127.0.0.1"
PEER_LISTENS = "10.0.0.2:29501"  # what rank 1 announced; its socket's port is another


def linked_pair() -> tuple[Link, Link]:
    """Rank 0's accepted link to rank 1 (named as the ring names it) and rank 1's link."""
    listener = listen(HOST, 0)
    accepted: list[Link] = []

    def serve() -> None:
        link = accept(listener, deadline_s=5)
        handshake(link, Handshake(rank=0, world=2, fingerprint=FINGERPRINT, key=KEY),
                  deadline_s=5)
        accepted.append(link)

    thread = threading.Thread(target=serve)
    thread.start()
    dialled = connect(HOST, listener.getsockname()[1], deadline_s=5)
    handshake(dialled, Handshake(rank=1, world=2, fingerprint=FINGERPRINT, key=KEY), deadline_s=5)
    thread.join(5)
    listener.close()
    accepted[0].peer_listen = PEER_LISTENS
    return accepted[0], dialled


def watched(link: Link, config: LivenessConfig) -> tuple[threading.Event, list[str]]:
    reasons: list[str] = []
    failed = threading.Event()

    def on_fatal(reason: str) -> None:
        reasons.append(reason)
        failed.set()

    watch(link, config, Fate(lambda: [link], on_fatal), lambda frame: True)
    return failed, reasons


def test_a_silent_peer_is_a_dead_ring_named_by_rank_and_listen_address():
    rank0, rank1 = linked_pair()
    config = LivenessConfig(keepalive_s=0.1, dead_after=3)
    started = time.monotonic()
    failed, reasons = watched(rank0, config)
    try:
        assert failed.wait(10)
        assert 0.3 <= time.monotonic() - started < 3
        expected = (f"Deadline: nothing from rank 1 at {PEER_LISTENS} for 0.3 s "
                    "(3 keep-alive intervals of 0.1 s): the ring is dead")
        assert reasons == [expected]
    finally:
        rank1.close()


def test_a_lost_peer_is_named_by_rank_and_listen_address():
    rank0, rank1 = linked_pair()
    failed, reasons = watched(rank0, LivenessConfig(keepalive_s=5.0))
    rank1.close()
    assert failed.wait(10)
    assert reasons == [f"PeerClosed: rank 1 at {PEER_LISTENS} closed the connection"]

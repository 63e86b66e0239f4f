"""Ring bootstrap in one process over real loopback sockets: names, deadline, redial."""

from __future__ import annotations

import dataclasses
import hashlib
import socket
import threading
import time

import pytest

from engine.harness.make_fixtures import DESCRIBE
from engine.link import errors
from engine.link.accept_loop import AcceptLoop
from engine.link.transport import listen
from engine.pipeline.ring import (
    Ring,
    RingConfig,
    _BootClock,
    _dial,
    _new_handshake,
    boot_follower,
    boot_rank0,
)
from tests.waiting import connect_once_listening

HOST = "127.0.0.1"
KEY = b"r" * 32
FINGERPRINT = hashlib.sha256(b"ring boot test").digest()
LAYERS_PER_RANK = 4


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def configs(world: int, **change: object) -> list[RingConfig]:
    master, *listens = free_ports(world + 1)
    return [RingConfig(rank, world, (HOST, master), (HOST, listens[rank]), FINGERPRINT, KEY,
                       rows_bound_bytes=1024, **change) for rank in range(world)]


def describe(rank: int, world: int):
    return dataclasses.replace(DESCRIBE, rank=rank, world=world,
                               layer_first=rank * LAYERS_PER_RANK,
                               layer_end=(rank + 1) * LAYERS_PER_RANK)


def boot(config: RingConfig, world: int) -> Ring:
    own = describe(config.rank, world)
    if config.rank == 0:
        return boot_rank0(config, own, n_layers=world * LAYERS_PER_RANK,
                          engine_version=DESCRIBE.engine_version, context=DESCRIBE.context,
                          parallel=DESCRIBE.parallel)
    return boot_follower(config, own)


def boot_all(ring_configs: list[RingConfig]) -> list[Ring | BaseException]:
    world = len(ring_configs)
    results: list[Ring | BaseException | None] = [None] * world

    def run(config: RingConfig) -> None:
        try:
            results[config.rank] = boot(config, world)
        except BaseException as error:  # noqa: BLE001 - handed back to the test
            results[config.rank] = error

    threads = [threading.Thread(target=run, args=(c,)) for c in ring_configs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads)
    return results


def test_every_link_names_its_peer_by_rank_and_listen_address():
    ring_configs = configs(3)
    rings = boot_all(ring_configs)
    try:
        assert all(isinstance(r, Ring) for r in rings), rings
        listen_of = {c.rank: f"{HOST}:{c.listen[1]}" for c in ring_configs}
        master = f"{HOST}:{ring_configs[0].master[1]}"
        for rank, ring in enumerate(rings):
            prev, succ = (rank - 1) % 3, (rank + 1) % 3
            assert ring.from_prev.peer == f"rank {prev} at {listen_of[prev]}"
            assert ring.to_next.peer == f"rank {succ} at {listen_of[succ]}"
            for peer_rank, link in ring.control.items():
                where = master if peer_rank == 0 else listen_of[peer_rank]
                assert link.peer == f"rank {peer_rank} at {where}"
    finally:
        for ring in rings:
            if isinstance(ring, Ring):
                ring.close()


def test_one_boot_deadline_bounds_the_bootstrap_and_names_the_strangers():
    config = configs(2, boot_deadline_s=1.0)[0]
    outcome: list[BaseException | Ring] = []
    started = time.monotonic()
    thread = threading.Thread(target=lambda: outcome.extend(boot_all([config])[:1]))
    thread.start()
    stranger = connect_once_listening(config.master, within_s=10, poll_s=0.02,
                                      what="rank 0 listening, for the stranger")
    with stranger:
        stranger.sendall(b"\x00" * 32)
        address = "{}:{}".format(*stranger.getsockname()[:2])
        thread.join(30)
    assert isinstance(outcome[0], errors.Deadline), outcome
    assert time.monotonic() - started < 5
    assert f"the last from {address}: BadMagic" in str(outcome[0])


def test_the_dialler_dials_again_when_a_listener_only_hangs_up():
    """A listener flooded past its bound closes new connections at once: the real peer's
    dialler connects again until its handshake is answered (within the boot deadline)."""
    follower, rank0 = configs(2)[1], configs(2)[0]
    listener = listen(HOST, 0)
    address = listener.getsockname()[:2]
    hung_up = threading.Event()

    def hang_up_once_then_admit() -> None:
        conn, _ = listener.accept()
        conn.close()
        hung_up.set()

    thread = threading.Thread(target=hang_up_once_then_admit)
    thread.start()
    dialled: list[object] = []
    dialler = threading.Thread(target=lambda: dialled.append(
        _dial(follower, address, 0, _BootClock(follower), max_payload_bytes=1024)))
    dialler.start()
    assert hung_up.wait(10)
    thread.join(5)
    with AcceptLoop(listener, lambda: _new_handshake(rank0, None), name="test port") as loop:
        link, hello = loop.next_peer(deadline_s=10)
        dialler.join(10)
        assert hello.rank == 1 and dialled and dialled[0].authenticated
        link.close()
        dialled[0].close()


@pytest.mark.parametrize(("wrong", "error"), [("key", errors.BadProof),
                                               ("rank", errors.RankMismatch)])
def test_the_dialler_stops_at_a_named_refusal(wrong, error):
    follower, rank0 = configs(2)[1], configs(2)[0]
    if wrong == "key":
        follower = dataclasses.replace(follower, key=b"x" * 32)
    world3 = dataclasses.replace(rank0, world=3)
    listener = listen(HOST, 0)
    started = time.monotonic()
    # "rank": the listener is rank 0 of a world of 3 expecting rank 2, so rank 1 is refused.
    make = (lambda: _new_handshake(rank0, None)) if wrong == "key" else (
        lambda: _new_handshake(world3, 2))
    follower = follower if wrong == "key" else dataclasses.replace(follower, world=3)
    with AcceptLoop(listener, make, name="test port"), pytest.raises(error):
        _dial(follower, listener.getsockname()[:2], 0, _BootClock(follower),
              max_payload_bytes=1024)
    assert time.monotonic() - started < 5  # refused once, not dialled until the deadline

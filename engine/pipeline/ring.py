"""Bootstrap of one replica's ring: the control star on rank 0, then the data ring.

Every rank listens for its ring predecessor on FLEET_LISTEN and dials rank 0's control
port. Rank 0 authenticates each follower (hello + shared-key proof), gathers their
descriptions, refuses any mismatch by name, tells each rank where its successor listens,
waits until every data link is up and every stage is ready, and says GO. Rows then flow
rank i -> i + 1 directly, the last rank back to rank 0; plans go rank 0 -> every rank.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from socket import socket

import structlog

from engine.link.errors import ProtocolError, RankMismatch, UnexpectedFrame
from engine.link.frame import Frame, FrameKind
from engine.link.hello import Handshake
from engine.link.layout import check_descriptions
from engine.link.messages import Describe, Neighbour, Ready, decode_message
from engine.link.transport import Link, accept, connect, handshake, listen

log = structlog.get_logger()


@dataclass(frozen=True)
class RingConfig:
    rank: int
    world: int
    master: tuple[str, int]  # rank 0's control listener
    listen: tuple[str, int]  # this rank's data listener (its predecessor dials it)
    fingerprint: bytes  # checkpoint + whole layout
    key: bytes
    rows_bound_bytes: int  # largest ROWS payload this rank accepts
    boot_deadline_s: float = 120.0  # peers load checkpoints at their own pace
    io_deadline_s: float = 30.0


@dataclass
class Ring:
    """This rank's links once the ring is up."""

    config: RingConfig
    control: dict[int, Link]  # rank 0: every follower by rank; a follower: {0: rank 0}
    to_next: Link  # rows to the successor
    from_prev: Link  # rows from the predecessor
    describes: dict[int, Describe]  # rank 0 only: every rank's description
    rows_buffer: bytearray = field(init=False)  # where the predecessor's rows land

    def __post_init__(self) -> None:
        self.rows_buffer = bytearray(self.config.rows_bound_bytes)

    def links(self) -> list[Link]:
        return [*self.control.values(), self.to_next, self.from_prev]

    def close(self) -> None:
        for link in self.links():
            link.close()


def _expect(frame: Frame, kind: FrameKind, peer: str):
    if frame.kind is not kind:
        raise UnexpectedFrame(f"expected {kind.name} from {peer}, got {frame.kind.name}")
    return decode_message(frame)


def _handshake(link: Link, config: RingConfig, peer_rank: int | None) -> int:
    hs = Handshake(rank=config.rank, world=config.world, fingerprint=config.fingerprint,
                   key=config.key, expect_peer_rank=peer_rank)
    return handshake(link, hs, deadline_s=config.io_deadline_s).rank


def _data_links(config: RingConfig, listener: socket, successor: Neighbour) -> tuple[Link, Link]:
    """Dial the successor while accepting the predecessor, so no rank waits on another."""
    prev_rank = (config.rank - 1) % config.world
    accepted: dict[str, Link | BaseException] = {}

    def accept_prev() -> None:
        try:
            link = accept(listener, deadline_s=config.boot_deadline_s,
                          max_payload_bytes=config.rows_bound_bytes)
            _handshake(link, config, prev_rank)
            accepted["link"] = link
        except Exception as exc:  # noqa: BLE001 - handed to the booting thread below
            accepted["link"] = exc

    thread = threading.Thread(target=accept_prev, name="accept-prev", daemon=True)
    thread.start()
    to_next = connect(successor.host, successor.port, deadline_s=config.boot_deadline_s,
                      max_payload_bytes=config.rows_bound_bytes)
    _handshake(to_next, config, successor.successor_rank)
    thread.join(config.boot_deadline_s + config.io_deadline_s)
    from_prev = accepted.get("link")
    if isinstance(from_prev, BaseException):
        to_next.close()
        raise from_prev
    if from_prev is None:
        to_next.close()
        raise ProtocolError(f"rank {prev_rank} never dialled this rank's ring listener")
    return to_next, from_prev


def boot_rank0(config: RingConfig, own: Describe, *, n_layers: int, engine_version: str,
               context: int, parallel: int) -> Ring:
    """Rank 0's side: accept, check and wire every follower; returns once all are ready."""
    control_listener = listen(*config.master)
    data_listener = listen(*config.listen)
    control: dict[int, Link] = {}
    try:
        describes, listens = {0: own}, {0: config.listen}
        while len(control) < config.world - 1:
            link = accept(control_listener, deadline_s=config.boot_deadline_s)
            try:
                peer_rank = _handshake(link, config, None)
            except ProtocolError as error:  # the peer was told why; keep waiting for ours
                log.warning("refused a peer", peer=link.peer_address,
                            reason=f"{type(error).__name__}: {error}")
                continue
            if peer_rank == 0 or peer_rank in control:
                link.abort(RankMismatch(f"rank {peer_rank} is already in this ring"))
                continue
            control[peer_rank] = link
            describes[peer_rank] = _expect(link.recv(deadline_s=config.io_deadline_s),
                                           FrameKind.DESCRIBE, link.peer)
            announced = _expect(link.recv(deadline_s=config.io_deadline_s),
                                FrameKind.NEIGHBOUR, link.peer)
            listens[peer_rank] = (announced.host, announced.port)
            log.info("stage joined", peer=peer_rank, layers=f"{describes[peer_rank].layer_first}:"
                     f"{describes[peer_rank].layer_end}", backend=describes[peer_rank].backend.name)
        check_descriptions(list(describes.values()), n_layers=n_layers,
                           engine_version=engine_version, context=context, parallel=parallel)
        for rank, link in control.items():
            successor = (rank + 1) % config.world
            link.send_message(Neighbour(successor, *listens[successor]),
                              deadline_s=config.io_deadline_s)
        to_next, from_prev = _data_links(config, data_listener, Neighbour(1, *listens[1]))
        for rank, link in control.items():
            ready = _expect(link.recv(deadline_s=config.boot_deadline_s), FrameKind.READY,
                            link.peer)
            if ready.rank != rank:
                raise RankMismatch(f"{link.peer} reported ready as rank {ready.rank}")
        for link in control.values():
            link.send(FrameKind.GO, deadline_s=config.io_deadline_s)
    except BaseException as exc:
        for link in control.values():
            link.abort(exc)
        raise
    finally:
        control_listener.close()
        data_listener.close()
    return Ring(config, control, to_next, from_prev, describes)


def boot_follower(config: RingConfig, own: Describe) -> Ring:
    """A follower's side: dial rank 0, describe, wire the data ring, report ready, await GO."""
    data_listener = listen(*config.listen)
    link = None
    try:
        link = connect(*config.master, deadline_s=config.boot_deadline_s)
        _handshake(link, config, 0)
        link.send_message(own, deadline_s=config.io_deadline_s)
        link.send_message(Neighbour(config.rank, *config.listen), deadline_s=config.io_deadline_s)
        successor = _expect(link.recv(deadline_s=config.boot_deadline_s), FrameKind.NEIGHBOUR,
                            link.peer)
        to_next, from_prev = _data_links(config, data_listener, successor)
        link.send_message(Ready(config.rank), deadline_s=config.io_deadline_s)
        _expect(link.recv(deadline_s=config.boot_deadline_s), FrameKind.GO, link.peer)
    except BaseException as exc:
        if link is not None:
            link.abort(exc)
        raise
    finally:
        data_listener.close()
    return Ring(config, {0: link}, to_next, from_prev, {})

"""Bootstrap of one replica's ring: the control star on rank 0, then the data ring.

Every rank listens for its ring predecessor on FLEET_LISTEN and dials rank 0's control
port. Rank 0 authenticates each follower (hello + shared-key proof), gathers their
descriptions, refuses any mismatch by name, tells each rank where its successor and its
predecessor listen, waits until every data link is up and every stage is ready, and says
GO. Rows then flow rank i -> i + 1 directly, the last rank back to rank 0; plans go rank 0
-> every rank.

Listeners admit through an `AcceptLoop`: anything that reaches them before the expected
peer (a port scan, garbage, a wrong key, a silent socket) is refused and logged with its
address, and never ends or stalls the boot. One boot deadline bounds the whole bootstrap.
`boot_ring` is the entry point: this rank's part, from its environment contract.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import structlog

from engine import ENGINE_VERSION
from engine.addresses import format_host_port
from engine.backend_names import Backend
from engine.backends.base import Stage
from engine.checkpoint.fingerprint import checkpoint_digest, layout_fingerprint
from engine.config import ModelConfig
from engine.env import EngineEnv
from engine.link.accept_loop import AcceptLoop, Refusal
from engine.link.errors import (
    ConnectionFailed,
    Deadline,
    PeerClosed,
    ProtocolError,
    RankMismatch,
    UnexpectedFrame,
)
from engine.link.frame import MAX_CONTROL_PAYLOAD_BYTES, Frame, FrameKind
from engine.link.hello import HANDSHAKE_DEADLINE_S, Handshake, read_key_file
from engine.link.layout import check_descriptions
from engine.link.messages import Describe, Neighbour, Ready, decode_message
from engine.link.transport import Link, connect, handshake, listen
from engine.pipeline.hop_transport import Hops, setup_hops

log = structlog.get_logger()
# Pause before dialling again a peer that hung up during the handshake.
REDIAL_PAUSE_S = 0.2


@dataclass(frozen=True)
class RingConfig:
    rank: int
    world: int
    master: tuple[str, int]  # rank 0's control listener
    listen: tuple[str, int]  # this rank's data listener (its predecessor dials it)
    fingerprint: bytes  # checkpoint + whole layout
    key: bytes
    rows_bound_bytes: int  # largest ROWS payload this rank accepts
    boot_deadline_s: float = 120.0  # the whole bootstrap; peers load at their own pace
    io_deadline_s: float = 30.0
    handshake_deadline_s: float = HANDSHAKE_DEADLINE_S  # a connection this rank accepted


@dataclass
class Ring:
    """This rank's links once the ring is up."""

    config: RingConfig
    control: dict[int, Link]  # rank 0: every follower by rank; a follower: {0: rank 0}
    to_next: Link  # rows to the successor
    from_prev: Link  # rows from the predecessor
    rows_buffer: bytearray = field(init=False)  # where the predecessor's rows land
    hops: Hops = field(default_factory=Hops)  # hops on torch.distributed instead of the links

    def __post_init__(self) -> None:
        self.rows_buffer = bytearray(self.config.rows_bound_bytes)

    def links(self) -> list[Link]:
        return [*self.control.values(), self.to_next, self.from_prev]

    def close(self) -> None:
        for link in self.links():
            link.close()


def describe(stage: Stage, env: EngineEnv) -> Describe:
    """What this rank tells rank 0 about itself at boot (RFC 6.4 Describe)."""
    rows = stage.row_format
    start, end = stage.layer_range
    return Describe(
        engine_version=ENGINE_VERSION, backend=Backend.from_label(env.backend),
        kv_dtype=rows.dtype, rank=env.rank, world=env.world_size, layer_first=start, layer_end=end,
        hidden=rows.hidden, row_dtype=rows.dtype, planes=rows.planes,
        prompt_chunk=env.chunk, max_rows_per_round=env.parallel + env.chunk,
        parallel=env.slots, context=env.context, drafter_width=0,
        kv_rows=stage.kv_capacity_rows(), recurrent_states=stage.recurrent_states(),
    )


def boot_ring(env: EngineEnv, stage: Stage, config: ModelConfig) -> Ring:
    """Authenticate and wire this rank into its replica's ring (blocks until GO)."""
    key = read_key_file(env.key_file)
    fingerprint = layout_fingerprint(checkpoint_digest(env.model_dir), list(env.layout))
    own = describe(stage, env)
    rows_bound = stage.row_format.nbytes(env.parallel + env.chunk)
    ring_config = RingConfig(env.rank, env.world_size, env.master, env.listen, fingerprint,
                             key, rows_bound, env.boot_deadline_s, env.round_deadline_s,
                             env.handshake_deadline_s)
    if env.rank == 0:
        ring = boot_rank0(ring_config, own, n_layers=config.num_hidden_layers,
                          engine_version=ENGINE_VERSION, context=env.context,
                          parallel=env.slots)
    else:
        ring = boot_follower(ring_config, own)
    try:  # the links are up and authenticated: each hop may now move to torch.distributed
        ring.hops = setup_hops(env.rank, env.world_size, ring.to_next, ring.from_prev,
                               env.hop_transport, env.placement, env.listen[0])
    except BaseException:
        ring.close()
        raise
    return ring


class _BootClock:
    """What is left of the one boot deadline, for each wait of the bootstrap."""

    def __init__(self, config: RingConfig) -> None:
        self.deadline_s = config.boot_deadline_s
        self._end = time.monotonic() + config.boot_deadline_s

    def left(self, doing: str) -> float:
        remaining = self._end - time.monotonic()
        if remaining <= 0:
            raise Deadline(f"the ring did not boot within {self.deadline_s:g} s ({doing})")
        return remaining


def _address(host_port: tuple[str, int]) -> str:
    return format_host_port(*host_port)


def _expect(frame: Frame, kind: FrameKind, peer: str):
    if frame.kind is not kind:
        raise UnexpectedFrame(f"expected {kind.name} from {peer}, got {frame.kind.name}")
    return decode_message(frame)


def _new_handshake(config: RingConfig, peer_rank: int | None) -> Handshake:
    return Handshake(rank=config.rank, world=config.world, fingerprint=config.fingerprint,
                     key=config.key, expect_peer_rank=peer_rank)


def _open_door(config: RingConfig, address: tuple[str, int], peer_rank: int | None, *,
               what: str, max_payload_bytes: int) -> AcceptLoop:
    """Listen on `address` and admit only peers that pass the handshake (of `peer_rank`)."""
    name = f"{what} {_address(address)}"

    def refused(refusal: Refusal) -> None:
        log.warning("refused a peer", peer=refusal.address, listener=name, reason=refusal.reason)

    return AcceptLoop(listen(*address), lambda: _new_handshake(config, peer_rank), name=name,
                      on_refused=refused, handshake_deadline_s=config.handshake_deadline_s,
                      max_payload_bytes=max_payload_bytes).start()


def _dial(config: RingConfig, address: tuple[str, int], peer_rank: int, clock: _BootClock, *,
          max_payload_bytes: int) -> Link:
    """Connect to `peer_rank` at `address` and authenticate, dialling again while the peer
    only hangs up (its listener may have turned us away while flooded): a refusal it
    names (ABORT) or any other error is final."""
    doing = f"dialling rank {peer_rank} at {_address(address)}"
    while True:
        link = connect(*address, deadline_s=clock.left(doing), max_payload_bytes=max_payload_bytes)
        try:
            handshake(link, _new_handshake(config, peer_rank),
                      deadline_s=min(config.io_deadline_s, clock.left(doing)))
            return link
        except ProtocolError as error:
            cause = error.cause if isinstance(error, ConnectionFailed) else error
            if not isinstance(cause, PeerClosed) or cause.remote:
                raise
            log.warning("peer hung up during the handshake; dialling again",
                        peer=f"rank {peer_rank} at {_address(address)}", reason=str(cause))
        time.sleep(min(REDIAL_PAUSE_S, clock.left(doing)))


def boot_rank0(config: RingConfig, own: Describe, *, n_layers: int, engine_version: str,
               context: int, parallel: int) -> Ring:
    """Rank 0's side: accept, check and wire every follower; returns once all are ready."""
    clock = _BootClock(config)
    last = config.world - 1
    control_door = _open_door(config, config.master, None, what="control port",
                              max_payload_bytes=MAX_CONTROL_PAYLOAD_BYTES)
    data_door = None
    control: dict[int, Link] = {}
    data: list[Link] = []
    try:
        data_door = _open_door(config, config.listen, last, what="ring listener",
                               max_payload_bytes=config.rows_bound_bytes)
        describes, listens = {0: own}, {0: config.listen}
        while len(control) < config.world - 1:
            link, hello = control_door.next_peer(
                deadline_s=clock.left(f"{len(control)} of {last} followers joined"))
            if hello.rank in control:
                duplicate = RankMismatch(f"rank {hello.rank} is already in this ring "
                                         f"({control[hello.rank].peer})")
                log.warning("refused a peer", peer=link.peer_address, reason=str(duplicate))
                link.abort(duplicate)
                continue
            control[hello.rank] = link
            io_s = min(config.io_deadline_s, clock.left(f"reading {link.peer}'s description"))
            describes[hello.rank] = _expect(link.recv(deadline_s=io_s), FrameKind.DESCRIBE,
                                            link.peer)
            announced = _expect(link.recv(deadline_s=io_s), FrameKind.NEIGHBOUR, link.peer)
            if announced.successor_rank != hello.rank:
                raise RankMismatch(f"{link.peer} announced the listen address of rank "
                                   f"{announced.successor_rank}")
            listens[hello.rank] = (announced.host, announced.port)
            link.peer_listen = _address(listens[hello.rank])
            log.info("stage joined", peer=link.peer,
                     layers=f"{describes[hello.rank].layer_first}:"
                            f"{describes[hello.rank].layer_end}",
                     backend=describes[hello.rank].backend.name)
        control_door.close()  # every follower is here: nobody else may join
        check_descriptions(list(describes.values()), n_layers=n_layers,
                           engine_version=engine_version, context=context, parallel=parallel)
        for rank, link in control.items():
            for neighbour in ((rank + 1) % config.world, (rank - 1) % config.world):
                link.send_message(Neighbour(neighbour, *listens[neighbour]),
                                  deadline_s=config.io_deadline_s)
        data.append(_dial(config, listens[1], 1, clock, max_payload_bytes=config.rows_bound_bytes))
        from_prev, _hello = data_door.next_peer(deadline_s=clock.left(f"rank {last} dialling in"))
        from_prev.peer_listen = _address(listens[last])
        data.append(from_prev)
        for rank, link in control.items():
            ready = _expect(link.recv(deadline_s=clock.left(f"{link.peer} getting ready")),
                            FrameKind.READY, link.peer)
            if ready.rank != rank:
                raise RankMismatch(f"{link.peer} reported ready as rank {ready.rank}")
        for link in control.values():
            link.send(FrameKind.GO, deadline_s=config.io_deadline_s)
    except BaseException as exc:
        for link in control.values():
            link.abort(exc)
        for link in data:
            link.close()
        raise
    finally:
        control_door.close()
        if data_door is not None:
            data_door.close()
    return Ring(config, control, data[0], data[1])


def boot_follower(config: RingConfig, own: Describe) -> Ring:
    """A follower's side: dial rank 0, describe, wire the data ring, report ready, await GO."""
    clock = _BootClock(config)
    successor_rank, prev_rank = (config.rank + 1) % config.world, (config.rank - 1) % config.world
    data_door = _open_door(config, config.listen, prev_rank, what="ring listener",
                           max_payload_bytes=config.rows_bound_bytes)
    link = None
    data: list[Link] = []
    try:
        link = _dial(config, config.master, 0, clock, max_payload_bytes=MAX_CONTROL_PAYLOAD_BYTES)
        link.send_message(own, deadline_s=config.io_deadline_s)
        link.send_message(Neighbour(config.rank, *config.listen), deadline_s=config.io_deadline_s)
        neighbours = []
        for expected in (successor_rank, prev_rank):
            neighbour = _expect(link.recv(deadline_s=clock.left("waiting for the other stages")),
                                FrameKind.NEIGHBOUR, link.peer)
            if neighbour.successor_rank != expected:
                raise RankMismatch(f"{link.peer} named rank {neighbour.successor_rank} as a "
                                   f"neighbour of rank {config.rank}; expected rank {expected}")
            neighbours.append(neighbour)
        successor, predecessor = neighbours
        data.append(_dial(config, (successor.host, successor.port), successor_rank, clock,
                          max_payload_bytes=config.rows_bound_bytes))
        from_prev, _hello = data_door.next_peer(
            deadline_s=clock.left(f"rank {prev_rank} dialling in"))
        from_prev.peer_listen = _address((predecessor.host, predecessor.port))
        data.append(from_prev)
        link.send_message(Ready(config.rank), deadline_s=config.io_deadline_s)
        _expect(link.recv(deadline_s=clock.left("waiting for GO")), FrameKind.GO, link.peer)
    except BaseException as exc:
        if link is not None:
            link.abort(exc)
        for data_link in data:
            data_link.close()
        raise
    finally:
        data_door.close()
    return Ring(config, {0: link}, data[0], data[1])

"""How each hop's rows travel: the TCP stage link, or torch.distributed (NCCL between two
CUDA stages, gloo between CPU stages, which is how CI tests the path).

What goes where: plans, keep-alives, ABORT and GOODBYE always stay on the TCP links. A hop
on torch.distributed carries only the rows' bytes; the round number and row count a ROWS
header would carry come from the plan both ends hold, and the rows arrive in plan order on
a 2-rank process group of that hop's own (several hops in one process never share a group).

Choice (`engine.hop_choice.choose`): a pure decision from FLEET_HOP_TRANSPORT and both ends' backends, read
from the placement id, so both ends decide alike without asking. When it says dist, the
sender (the hop's rank i) opens a TCPStore and proposes over the already authenticated
data link: one frame with the store's host:port and a fresh random token (the store's key
prefix), so only a peer that proved the shared key learns where and under what to meet.
Both ends build the group and pass one tensor each way, bounded by `INIT_TIMEOUT_S`; each
then tells the other over the link whether that worked, and the hop is dist only if both
succeeded. Otherwise both fall back to TCP and log one line saying why.

The setup frames are ROWS frames of round 0 with no rows (the wire's own kinds; rounds
never start at 0 before setup is over, and a TCP-only ring sends none).
"""

from __future__ import annotations

import json
import secrets
import threading
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import structlog

from engine.hop_choice import hop_plan
from engine.link.errors import Deadline, ProtocolError, UnexpectedFrame
from engine.link.frame import FrameKind
from engine.link.transport import Link

log = structlog.get_logger()

INIT_TIMEOUT_S = 10.0  # building a hop's group; past it both ends use TCP for that hop
SETUP_ROUND = 0  # the round number setup frames carry
# The longest one end waits for the other's word: the other may spend INIT_TIMEOUT_S on
# each of reaching the store, forming the group and passing the probe.
SETUP_DEADLINE_FACTOR = 4


class DistHop:
    """One hop's rows over its own 2-rank process group (rank 0 sends, rank 1 receives).

    Sends are posted, not waited for: a gloo or NCCL send completes only once its receiver
    has posted the matching receive, and with rounds in flight the receiver may itself be
    sending (rank 1 returning round k while rank 0 launches round k + 1), which would wait
    on each other in a cycle. TCP's socket buffers decouple the two; here the posted sends
    do, each holding its tensor until it completes. At most `MAX_POSTED` are outstanding:
    past that the oldest is waited for, bounded like every receive."""

    MAX_POSTED = 8  # more than any ring's rounds in flight

    def __init__(self, group: Any, store: Any, kind: str, *, sending: bool, peer: str) -> None:
        self.group = group
        self.store = store  # the sender's store serves the group for as long as it lives
        self.kind = kind  # "nccl" or "gloo"
        self.sending = sending
        self.peer = peer
        self._posted: deque[tuple[Any, Any, int]] = deque()  # (work, its tensor, round)

    def send(self, tensor: Any, round_no: int, deadline_s: float) -> None:
        """Post a round's rows (a uint8 tensor this hop now owns until the send completes)."""
        while self._posted and self._posted[0][0].is_completed():
            self._finish(self._posted.popleft(), deadline_s)
        while len(self._posted) >= self.MAX_POSTED:
            self._finish(self._posted.popleft(), deadline_s)
        self._posted.append((self.group.send([tensor], 1, 0), tensor, round_no))

    def recv_into(self, tensor: Any, round_no: int, deadline_s: float) -> None:
        self._wait(self.group.recv([tensor], 0, 0), f"receiving the rows of round {round_no}",
                   deadline_s)

    def _finish(self, posted: tuple[Any, Any, int], deadline_s: float) -> None:
        work, _tensor, round_no = posted
        self._wait(work, f"sending the rows of round {round_no}", deadline_s)

    def _wait(self, work: Any, doing: str, deadline_s: float) -> None:
        try:
            work.wait(timedelta(seconds=deadline_s))
        except RuntimeError as error:  # a dead peer or the timeout: a broken link, as TCP's
            raise Deadline(f"{self.kind} hop with {self.peer}: {doing} failed: {error}") from None


def send_rows(hop: DistHop, stage: Any, rows: Any, round_no: int, deadline_s: float) -> None:
    """A round's rows over the hop: a device copy of the rows on NCCL (the stage may reuse
    its output buffer next round, a CUDA graph's static output does), their bytes on gloo."""
    import torch

    if hop.kind == "nccl":
        with torch.inference_mode():
            tensor = rows.contiguous().view(-1).view(torch.uint8).clone()
    else:
        tensor = torch.frombuffer(bytearray(stage.rows_to_bytes(rows)), dtype=torch.uint8)
    hop.send(tensor, round_no, deadline_s)


def receive_rows(hop: DistHop, stage: Any, round_no: int, n_rows: int,
                 deadline_s: float) -> Any:
    """The rows of `round_no`, as this stage's tensors: the plan says how many, so the
    size received is the size checked (a peer sending another size fails the receive)."""
    import torch

    nbytes = stage.row_format.nbytes(n_rows)
    device = stage.device if hop.kind == "nccl" else torch.device("cpu")
    landing = torch.empty(nbytes, dtype=torch.uint8, device=device)
    hop.recv_into(landing, round_no, deadline_s)
    if hop.kind == "nccl":  # already on the device: a view in the stage's dtype
        with torch.inference_mode():
            return landing.view(stage.dtype).view(n_rows, -1)
    return stage.rows_from_bytes(memoryview(landing.numpy()), n_rows)


@dataclass
class Hops:
    """This rank's two hops once set up: None means the TCP link carries them."""

    out: DistHop | None = None  # rows to the successor
    into: DistHop | None = None  # rows from the predecessor
    transports: tuple[str, ...] = ()  # every hop's transport, as rank 0 reports it


def setup_hops(rank: int, world: int, to_next: Link, from_prev: Link, mode: str,
               placement: str, store_host: str) -> Hops:
    """Set up this rank's outgoing and incoming hops at once (each in its own thread: the
    ring's hops would wait on one another in a cycle if taken one after the other)."""
    plan = hop_plan(mode, placement, world)
    hops = Hops(transports=tuple(kind for kind, _ in plan))
    results: dict[str, DistHop | None] = {}
    errors: list[BaseException] = []
    outgoing, incoming = plan[rank], plan[(rank - 1) % world]

    def set_up(name: str, link: Link, kind: str, sending: bool) -> None:
        try:
            results[name] = _setup_one(rank, link, kind, sending=sending, host=store_host)
        except BaseException as error:  # noqa: BLE001 - a broken link fails the boot
            errors.append(error)

    jobs = [threading.Thread(target=set_up, args=(name, link, kind, sending), daemon=True)
            for name, link, kind, sending in (("out", to_next, outgoing[0], True),
                                              ("into", from_prev, incoming[0], False))
            if kind != "tcp"]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join(SETUP_DEADLINE_FACTOR * INIT_TIMEOUT_S + 5.0)
    if errors:
        raise errors[0]
    if any(job.is_alive() for job in jobs):
        raise Deadline(f"setting up rank {rank}'s torch.distributed hops did not end in time")
    hops.out, hops.into = results.get("out"), results.get("into")
    chosen = [kind if (i != rank or hops.out) and (i != (rank - 1) % world or hops.into)
              else "tcp" for i, (kind, _) in enumerate(plan)]
    hops.transports = tuple(chosen)
    log.info("hop transports", out=chosen[rank], into=chosen[(rank - 1) % world],
             hops=list(chosen), why_out=plan[rank][1])
    return hops


def store_address_for_offer(store: Any, host: str) -> tuple[str, int]:
    """Where the sender's store listens, as the offer names it (tests inject faults here)."""
    return host, store.port


def _setup_one(rank: int, link: Link, kind: str, *, sending: bool, host: str) -> DistHop | None:
    hop = f"rank {rank} -> {link.peer}" if sending else f"{link.peer} -> rank {rank}"
    try:
        group, store, reason = _rendezvous(link, kind, sending=sending, host=host)
    except ProtocolError:
        raise
    except Exception as error:  # noqa: BLE001 - any setup failure means TCP for this hop
        group, store, reason = None, None, f"{type(error).__name__}: {error}"
    own_ok = group is not None
    deadline = SETUP_DEADLINE_FACTOR * INIT_TIMEOUT_S
    link.send(FrameKind.ROWS, json.dumps({"ok": own_ok}).encode(), SETUP_ROUND,
              deadline_s=deadline)
    peer_ok = bool(_setup_frame(link, deadline).get("ok"))
    if own_ok and peer_ok:
        log.info("hop on torch.distributed", hop=hop, backend=kind)
        return DistHop(group, store, kind, sending=sending, peer=link.peer)
    why = reason if not own_ok else "the other end could not join the group"
    log.warning("hop falls back to tcp", hop=hop, backend=kind, reason=why)
    return None


def _setup_frame(link: Link, deadline_s: float) -> dict:
    frame = link.recv(deadline_s=deadline_s)
    if frame.kind is not FrameKind.ROWS or frame.round_no != SETUP_ROUND or frame.rows:
        raise UnexpectedFrame(f"expected a hop setup frame from {link.peer}, got "
                              f"{frame.kind.name} of round {frame.round_no}")
    try:
        return json.loads(frame.payload)
    except ValueError as error:
        raise UnexpectedFrame(f"{link.peer} sent an unreadable hop setup frame") from error


def _rendezvous(link: Link, kind: str, *, sending: bool,
                host: str) -> tuple[Any, Any, str]:
    """The hop's group (rank 0 = the sender) and its store, or None and why not."""
    import torch

    timeout = timedelta(seconds=INIT_TIMEOUT_S)
    if sending:
        store, offer = open_store(host, kind)
        link.send(FrameKind.ROWS, json.dumps(offer).encode(), SETUP_ROUND,
                  deadline_s=INIT_TIMEOUT_S)
    else:
        offer = _setup_frame(link, SETUP_DEADLINE_FACTOR * INIT_TIMEOUT_S)
        store = join_store(offer)
    group, device = make_group(kind, store, offer["token"], 0 if sending else 1)
    probe = torch.full((1,), 7 if sending else 0, dtype=torch.int32, device=device)
    work = group.send([probe], 1, 0) if sending else group.recv([probe], 0, 0)
    work.wait(timeout)
    if not sending and int(probe.item()) != 7:
        return None, None, f"the probe came back as {int(probe.item())}"
    return group, store, ""


def open_store(host: str, kind: str, init_timeout_s: float = INIT_TIMEOUT_S
               ) -> tuple[Any, dict[str, Any]]:
    """A 2-rank group's store on `host` (a free port) and the offer that names it: backend,
    host, port and a fresh random token, the prefix of every key. The offer must travel only
    over an authenticated channel: whoever reads it can join the group."""
    import torch.distributed as dist

    store = dist.TCPStore(host, 0, 2, True, timeout=timedelta(seconds=init_timeout_s),
                          wait_for_workers=False)
    store_host, store_port = store_address_for_offer(store, host)
    return store, {"backend": kind, "host": store_host, "port": store_port,
                   "token": secrets.token_hex(16)}


def join_store(offer: dict[str, Any], init_timeout_s: float = INIT_TIMEOUT_S) -> Any:
    """The store an offer names, reached as its second member."""
    import torch.distributed as dist

    return dist.TCPStore(offer["host"], int(offer["port"]), 2, False,
                         timeout=timedelta(seconds=init_timeout_s))


def make_group(kind: str, store: Any, token: str, rank: int,
               init_timeout_s: float = INIT_TIMEOUT_S) -> tuple[Any, Any]:
    """A 2-rank NCCL or gloo group of its own over `store` under the token's prefix (never
    the global default group), and the device its tensors live on."""
    import torch
    import torch.distributed as dist

    timeout = timedelta(seconds=init_timeout_s)
    prefixed = dist.PrefixStore(f"hop/{token}", store)
    if kind == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return (dist.ProcessGroupNCCL(prefixed, rank, 2, options),
                torch.device("cuda", torch.cuda.current_device()))
    return dist.ProcessGroupGloo(prefixed, rank, 2, timeout), torch.device("cpu")

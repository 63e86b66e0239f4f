"""How a front-door relay learns that its upstream is gone: the supervisor failed its
replica, or rank 0 sent nothing and did not answer for the ring's own dead-ring time.

A frozen rank 0 (SIGSTOP, a hung host) keeps its sockets open: the kernel still accepts
and acknowledges, so a relay that only waits for bytes waits until something kills the
process. Two bounds end that wait: every relay of a replica the supervisor marks failed is
ended at once (`Relays.replica_failed`), and a wait with no bytes for `UpstreamSilence`
asks rank 0's `/health`, which a live rank 0 answers even while it thinks for long.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from engine.pipeline.liveness import LivenessConfig

T = TypeVar("T")

RING_LIVENESS = LivenessConfig()  # the keep-alive and dead-ring count engines run with


class ReplicaLost(Exception):
    """The relay's upstream is gone; the message says how, for the client's error."""


@dataclass(frozen=True)
class UpstreamSilence:
    """How long a relay waits on rank 0 with no sign of life: the ring's dead-ring time.

    A wait with no bytes for `quiet_s` asks rank 0's /health with `probe_timeout_s`; no
    answer ends the relay. Bytes or an answer restart the count, so neither a long prompt nor
    a long whole reply is cut while rank 0 lives, and a frozen one is noticed within
    `limit_s` of its last sign of life.
    """

    keepalive_s: float = RING_LIVENESS.keepalive_s
    dead_after: int = RING_LIVENESS.dead_after

    @property
    def limit_s(self) -> float:
        return self.keepalive_s * self.dead_after

    @property
    def probe_timeout_s(self) -> float:
        return self.keepalive_s

    @property
    def quiet_s(self) -> float:
        return self.limit_s - self.probe_timeout_s


class ReplicaWatch:
    """One replica's relays share this: the event is set when the supervisor fails it."""

    def __init__(self) -> None:
        self.failed = asyncio.Event()
        self.reason = ""
        self.relays = 0
        self._probe: asyncio.Future[bool] | None = None
        self._closers: set[Callable[[], None]] = set()

    @contextmanager
    def closing(self, close: Callable[[], None]) -> Iterator[None]:
        """While inside, a failure of the replica calls `close` (an upstream reply's close,
        which wakes its pending read with an error), so reads need no waiter of their own."""
        self._closers.add(close)
        try:
            yield
        finally:
            self._closers.discard(close)

    def fail(self, reason: str) -> None:
        self.reason = reason
        self.failed.set()
        for close in list(self._closers):
            close()

    def lost(self, silence: UpstreamSilence) -> ReplicaLost:
        if self.failed.is_set():
            return ReplicaLost(f"the replica failed: {self.reason}")
        return ReplicaLost(f"rank 0 sent nothing and did not answer /health for "
                           f"{silence.limit_s:g} s (the ring's dead-ring time)")

    async def alive(self, ask: Callable[[], Awaitable[bool]]) -> bool:
        """`ask()`'s answer, one probe at a time: relays that fall silent together (every
        stream of a frozen rank 0 does) share it instead of each asking."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(ask())
        # Shielded: one relay's client leaving must not cancel the probe the others wait on.
        return await asyncio.shield(self._probe)


class Relays:
    """The front door's open relays, by replica, and the replicas failed lately."""

    REMEMBERED_FAILURES = 256  # replica ids are never reused; this only bounds memory

    def __init__(self) -> None:
        self._watches: dict[str, ReplicaWatch] = {}
        self._failed: OrderedDict[str, str] = OrderedDict()

    def failure(self, replica: str) -> str | None:
        """Why `replica` was failed, or None while it is not known to have failed."""
        return self._failed.get(replica)

    def open_count(self, replica: str) -> int:
        watch = self._watches.get(replica)
        return watch.relays if watch else 0

    @contextmanager
    def open(self, replica: str) -> Iterator[ReplicaWatch]:
        watch = self._watches.setdefault(replica, ReplicaWatch())
        if replica in self._failed:
            watch.fail(self._failed[replica])
        watch.relays += 1
        try:
            yield watch
        finally:
            watch.relays -= 1
            if watch.relays == 0:
                self._watches.pop(replica, None)

    def replica_failed(self, replica: str, reason: str) -> int:
        """End every open relay of `replica` now and refuse new ones; returns how many."""
        self._failed[replica] = reason or "the replica failed"
        self._failed.move_to_end(replica)
        while len(self._failed) > self.REMEMBERED_FAILURES:
            self._failed.popitem(last=False)
        watch = self._watches.get(replica)
        if watch is None:
            return 0
        watch.fail(self._failed[replica])
        return watch.relays


async def until_lost(work: Awaitable[T], watch: ReplicaWatch, silence: UpstreamSilence,
                     alive: Callable[[], Awaitable[bool]]) -> T:
    """`work`'s result, unless the replica is failed or falls silent first (`ReplicaLost`).

    `alive()` asks rank 0 for a sign of life (its /health, within the probe timeout). The
    work is cancelled whenever this returns without its result, the caller's cancellation
    (a client gone) included, so the upstream request ends with it.
    """
    task = asyncio.ensure_future(work)
    failed = asyncio.ensure_future(watch.failed.wait())
    try:
        while True:
            done, _ = await asyncio.wait({task, failed}, timeout=silence.quiet_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            if failed in done:
                raise watch.lost(silence)
            if not await watch.alive(alive) and not task.done():
                raise watch.lost(silence)
    finally:
        failed.cancel()
        if not task.done():
            task.cancel()
            # Collected so a late error of the abandoned request is not reported as lost.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())


async def read_until_lost(read: Callable[[], Awaitable[T]], watch: ReplicaWatch,
                          silence: UpstreamSilence, alive: Callable[[], Awaitable[bool]]) -> T:
    """`until_lost` for the many reads of one stream, at the cost of a timer: the caller
    holds `watch.closing(...)` open around its reads, so a failure wakes a pending read (its
    error is then reported as this `ReplicaLost`)."""
    while True:
        if watch.failed.is_set():
            raise watch.lost(silence)
        quiet = asyncio.timeout(silence.quiet_s)
        try:
            async with quiet:
                return await read()
        except TimeoutError:
            if not quiet.expired():
                raise
            if not await watch.alive(alive):
                raise watch.lost(silence) from None

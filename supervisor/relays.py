"""How a front-door relay learns that its upstream is gone: the supervisor failed its
replica, or rank 0 sent nothing and did not answer for the ring's own dead-ring time.

A frozen rank 0 (SIGSTOP, a hung host) keeps its sockets open: the kernel still accepts
and acknowledges, so a relay that only waits for bytes waits until something kills the
process. Two bounds end that wait: every relay of a replica the supervisor marks failed is
ended at once (`Relays.replica_failed`), and a wait with no bytes for `UpstreamSilence`
asks rank 0's `/health`, which a live rank 0 answers even while it thinks for long.

A replica whose rank 0 did not answer that probe is *suspect* here (`Relays.suspect`), with
no wait for the supervisor's verdict: the front door routes it nothing new, its relays still
waiting for a reply are handed to another replica at once, and only its `/health` answering
again (`Relays.recheck`, at most one probe per `RECHECK_S`) clears it.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from engine.pipeline.liveness import LivenessConfig

T = TypeVar("T")

RING_LIVENESS = LivenessConfig()  # the keep-alive and dead-ring count engines run with
RECHECK_S = RING_LIVENESS.keepalive_s  # a suspect's /health is asked at most this often


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

    def __init__(self, on_silent: Callable[[], None] = lambda: None) -> None:
        self.failed = asyncio.Event()
        self.reason = ""
        # Set while the replica is suspect: relays still waiting for their reply go elsewhere.
        self.suspected = asyncio.Event()
        self.relays = 0
        self._probe: asyncio.Future[bool] | None = None
        self._closers: set[Callable[[], None]] = set()
        self._on_silent = on_silent  # rank 0 did not answer a probe

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

    def suspect_lost(self) -> ReplicaLost:
        return ReplicaLost("rank 0 did not answer /health (seen from another request)")

    async def alive(self, ask: Callable[[], Awaitable[bool]]) -> bool:
        """`ask()`'s answer, one probe at a time: relays that fall silent together (every
        stream of a frozen rank 0 does) share it instead of each asking."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(ask())
            self._probe.add_done_callback(self._probed)
        # Shielded: one relay's client leaving must not cancel the probe the others wait on.
        return await asyncio.shield(self._probe)

    def _probed(self, probe: asyncio.Future[bool]) -> None:
        if not probe.cancelled() and probe.exception() is None and not probe.result():
            self._on_silent()


class Relays:
    """The front door's open relays, by replica, the replicas failed lately and those it
    saw not answering (suspect)."""

    REMEMBERED_FAILURES = 256  # replica ids are never reused; this only bounds memory

    def __init__(self, clock: Callable[[], float] = time.monotonic, *,
                 recheck_s: float = RECHECK_S) -> None:
        self._watches: dict[str, ReplicaWatch] = {}
        self._failed: OrderedDict[str, str] = OrderedDict()
        self._suspects: OrderedDict[str, str] = OrderedDict()  # replica -> why
        self._rechecked: dict[str, float] = {}  # replica -> when its last recheck began
        self._rechecks: dict[str, asyncio.Task[bool]] = {}
        self.clock, self.recheck_s = clock, recheck_s
        self.suspected_total = 0  # times a replica became suspect here (for /metrics)

    def failure(self, replica: str) -> str | None:
        """Why `replica` was failed, or None while it is not known to have failed."""
        return self._failed.get(replica)

    def open_count(self, replica: str) -> int:
        watch = self._watches.get(replica)
        return watch.relays if watch else 0

    def suspicion(self, replica: str) -> str | None:
        """Why `replica` is suspect (its rank 0 did not answer here), or None."""
        return self._suspects.get(replica)

    def suspect(self, replica: str, reason: str) -> None:
        """Route `replica` nothing new until its /health answers again (`recheck`), and hand
        its relays still waiting for a reply to another replica."""
        if replica not in self._suspects:
            self.suspected_total += 1
        self._suspects[replica] = reason
        self._suspects.move_to_end(replica)
        while len(self._suspects) > self.REMEMBERED_FAILURES:
            gone, _ = self._suspects.popitem(last=False)
            self._rechecked.pop(gone, None)
        self._rechecked.setdefault(replica, self.clock())  # the failed probe was the check
        watch = self._watches.get(replica)
        if watch is not None:
            watch.suspected.set()

    def clear(self, replica: str) -> None:
        self._suspects.pop(replica, None)
        self._rechecked.pop(replica, None)
        watch = self._watches.get(replica)
        if watch is not None:
            watch.suspected.clear()

    def recheck(self, replica: str,
                ask: Callable[[], Awaitable[bool]]) -> asyncio.Task[None] | None:
        """Ask a suspect's /health in the background (`ask()`), at most once per `recheck_s`
        and one at a time; an answer clears it. Called as requests for its model arrive, so
        a replica the routes no longer name is asked no more. Returns the probe started, if
        one was."""
        if replica not in self._suspects or replica in self._rechecks:
            return None
        if self.clock() - self._rechecked.get(replica, float("-inf")) < self.recheck_s:
            return None
        self._rechecked[replica] = self.clock()

        async def probe() -> None:
            try:
                answered = await ask()
            except Exception:  # noqa: BLE001 - a probe that fails leaves it suspect
                answered = False
            finally:
                self._rechecks.pop(replica, None)
            if answered:
                self.clear(replica)

        task = self._rechecks[replica] = asyncio.ensure_future(probe())
        return task

    async def close(self) -> None:
        """End the rechecks in flight (the front door is closing)."""
        tasks = list(self._rechecks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @contextmanager
    def open(self, replica: str) -> Iterator[ReplicaWatch]:
        watch = self._watches.get(replica)
        if watch is None:
            watch = self._watches[replica] = ReplicaWatch(lambda: self.suspect(
                replica, "rank 0 did not answer /health"))
        if replica in self._failed:
            watch.fail(self._failed[replica])
        if replica in self._suspects:
            watch.suspected.set()
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
                     alive: Callable[[], Awaitable[bool]], *, until_suspect: bool = False) -> T:
    """`work`'s result, unless the replica is failed or falls silent first (`ReplicaLost`),
    or, with `until_suspect`, is found suspect meanwhile (another relay's probe failed).

    `alive()` asks rank 0 for a sign of life (its /health, within the probe timeout). The
    work is cancelled whenever this returns without its result, the caller's cancellation
    (a client gone) included, so the upstream request ends with it.
    """
    task = asyncio.ensure_future(work)
    failed = asyncio.ensure_future(watch.failed.wait())
    suspected = asyncio.ensure_future(watch.suspected.wait() if until_suspect
                                      else asyncio.Event().wait())
    try:
        while True:
            done, _ = await asyncio.wait({task, failed, suspected}, timeout=silence.quiet_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            if failed in done:
                raise watch.lost(silence)
            if suspected in done:
                raise watch.suspect_lost()
            if not await watch.alive(alive) and not task.done():
                raise watch.lost(silence)
    finally:
        failed.cancel()
        suspected.cancel()
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

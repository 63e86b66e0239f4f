"""Rank 0's round runner for a pipeline: plan to every stage, rows round the ring, head.

Rank 0 embeds and runs its own range, sends the rows to rank 1, and gets back from the
last rank only the rows it needs (the last row of each stream in the round, every row of a
verify entry; every row of the round where it drafts with a draft head). The plan
goes to every follower before rank 0 computes, so all stages apply it to their slots.

Up to `depth` rounds are in flight: rank 0 launches round k+1 while round k is on the
next stages (RFC 6.3, v2 prompt chunks and v3 decode groups). Every stage runs the rounds
in the order of their plans and rows arrive over TCP in that order, so each slot's state
sees its rounds in order on every stage; the lane host never puts a stream into a round
while a round that decides its next input is in flight.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog

from engine.backends.base import Stage
from engine.link.errors import ProtocolError, UnexpectedFrame
from engine.link.frame import Frame, FrameKind
from engine.pipeline.liveness import Fate, KeepAlive, LivenessConfig, watch
from engine.pipeline.ring import Ring
from engine.pipeline.rows import receive_ring_rows, send_ring_rows
from engine.pipeline.runner import Head, LaunchAndLand, head_of
from engine.pipeline.timing import RoundClock
from engine.rounds import RoundPlan
from engine.sampling import SamplingBatch

log = structlog.get_logger()

T = TypeVar("T")


@dataclass(frozen=True)
class InFlight:
    """A launched round: its plan, what its head makes of the returned rows, its phases."""

    plan: RoundPlan
    head: Head
    clock: RoundClock


class PipelineRunner(LaunchAndLand):
    def __init__(self, stage: Stage, ring: Ring, liveness: LivenessConfig,
                 round_deadline_s: float, *, depth: int = 1) -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, not {depth}")
        self.stage = stage
        self.depth = depth  # rounds in flight at once: one per stage keeps every stage busy
        self._in_flight: deque[InFlight] = deque()
        self.ring = ring
        self.slots = stage.slots
        self.round_deadline_s = round_deadline_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failed: asyncio.Future[str] | None = None
        self.fate = Fate(ring.links, self._on_fatal)
        self.keepalive = KeepAlive(list(ring.control.values()), liveness, self.fate)
        self._on_drain: Callable[[], None] = lambda: None
        self.timings: deque[dict[str, float]] = deque(maxlen=1024)  # recent rounds' phases
        self._liveness = liveness

    def start(self, loop: asyncio.AbstractEventLoop | None = None,
              on_drain: Callable[[], None] = lambda: None) -> None:
        """Begin keep-alives and watching every follower (`loop`: the serving loop)."""
        self._loop = loop
        self._on_drain = on_drain
        self._failed = loop.create_future() if loop else None
        self.keepalive.start()
        for link in self.ring.control.values():
            watch(link, self._liveness, self.fate, self._on_follower_frame)

    async def ring_failed(self) -> str:
        """Completes with the reason when the ring dies (never, if not started on a loop)."""
        if self._failed is None:
            await asyncio.Event().wait()
        return await self._failed

    def _on_fatal(self, reason: str) -> None:
        if self._loop and self._failed and not self._failed.done():
            self._loop.call_soon_threadsafe(
                lambda: self._failed.done() or self._failed.set_result(reason))

    def _on_follower_frame(self, frame: Frame) -> bool:
        if frame.kind is FrameKind.PLAN:  # a follower's keep-alive
            return True
        if frame.kind is FrameKind.GOODBYE:  # a follower was asked to stop: drain the replica
            log.info("a stage asked to drain the replica")
            self._on_drain()
            return True
        raise UnexpectedFrame(f"a follower sent {frame.kind.name} on the control link")

    def launch(self, plan: RoundPlan, token_ids: Sequence[int],
               batch: SamplingBatch | None) -> None:
        """The plan to every follower, rank 0's layers, the rows to rank 1; no waiting for
        the ring, so the next round can start here while this one runs on the next stage."""
        self._guarded(lambda: self._launch(plan, token_ids, head_of(self.stage, plan, batch)))

    def land(self) -> Any:
        """The oldest round in flight: wait for its returned rows, run its head."""
        return self._guarded(self._land)

    def _guarded(self, action: Callable[[], T]) -> T:
        try:
            return action()
        except Exception as error:
            self.fate.fail(error)  # every follower learns the reason and exits
            raise

    def _launch(self, plan: RoundPlan, token_ids: Sequence[int], head: Head) -> None:
        if len(self._in_flight) >= self.depth:
            raise RuntimeError(f"round {plan.round_no} launched with {self.depth} rounds "
                               "already in flight: land one first")
        clock = RoundClock()
        for link in self.ring.control.values():
            link.send_message(plan, deadline_s=self.round_deadline_s)
        self.keepalive.sent(plan.round_no)
        clock.mark("plan")
        rows = self.stage.forward(plan, None, token_ids)
        clock.mark("compute")  # on a GPU: launching the kernels
        if plan.total_rows:
            send_ring_rows(self.ring, self.stage, rows, plan.round_no, plan.total_rows,
                           self.round_deadline_s, clock)
        self._in_flight.append(InFlight(plan, head, clock))

    def _land(self) -> Any:
        if not self._in_flight:
            raise RuntimeError("land() with no round in flight")
        round_ = self._in_flight.popleft()
        plan, clock = round_.plan, round_.clock
        if not plan.total_rows:
            return round_.head(None)  # it only closed slots: nothing comes back
        clock.mark("queued")  # rank 0 launching later rounds, or the lane host between rounds
        back = receive_ring_rows(self.ring, self.stage, plan.round_no,
                                 len(plan.returned_rows(self.stage.spec.draft_head)),
                                 self.round_deadline_s)
        clock.mark("ring")  # every other stage, and every hop
        result = round_.head(back)
        clock.mark("head")  # and sampling, when the head samples
        self.timings.append({"rows": plan.total_rows, **clock.phases_ms})
        return result

    def stop(self, reason: str, *, clean: bool) -> None:
        """End the replica: GOODBYE (followers exit 0) when clean, else ABORT with `reason`."""
        if not clean:
            self.fate.fail(RuntimeError(reason))
            return
        self.fate.stopping = True
        self.keepalive.stop()
        for link in self.ring.control.values():
            try:
                link.send(FrameKind.GOODBYE, deadline_s=1.0)
            except ProtocolError as error:  # a follower already gone needs no goodbye
                log.info("no goodbye to a follower", peer=link.peer, reason=str(error))
        self.ring.close()

"""Keep-alives, silence detection and fail-fast for one rank's control links.

Rank 0 sends an empty plan to every follower once `keepalive_s` passes without a plan,
idle or mid-round; each follower sends one upstream at the same pace. Any frame counts as
heard; a control link silent for `dead_after` intervals is a dead ring. The first fatal
error anywhere ends the rank: every link is aborted with the reason (so peers learn it by
name) and `on_fatal` runs once. A long forward on one stage never reads as a dead ring,
because keep-alives come from threads that never compute.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from engine.link.errors import Deadline, ProtocolError, UnexpectedFrame
from engine.link.frame import Frame, FrameKind
from engine.link.messages import decode_plan
from engine.link.transport import Link
from engine.rounds import RoundPlan

log = structlog.get_logger()


@dataclass(frozen=True)
class LivenessConfig:
    keepalive_s: float = 2.0
    dead_after: int = 3  # silent intervals before the ring counts as dead

    @property
    def silence_limit_s(self) -> float:
        return self.keepalive_s * self.dead_after


class Fate:
    """The first fatal error of this rank, acted on once; later callers wait for it."""

    HANDLING_LIMIT_S = 10.0  # aborts linger about a second each, in parallel

    def __init__(self, links: Callable[[], list[Link]], on_fatal: Callable[[str], None]) -> None:
        self._links = links
        self._on_fatal = on_fatal
        self._lock = threading.Lock()
        self._handled = threading.Event()
        self.reason: str | None = None
        self.stopping = False  # a clean stop: later link errors are expected, not fatal

    def fail(self, error: BaseException) -> None:
        with self._lock:
            first = self.reason is None and not self.stopping
            if first:
                self.reason = f"{type(error).__name__}: {error}"
        if not first:  # another thread is ending this rank; let it finish (it may exit)
            if not self.stopping:
                self._handled.wait(self.HANDLING_LIMIT_S)
            return
        log.error("ring failed", reason=self.reason)
        threads = [threading.Thread(target=link.abort, args=(error,), daemon=True)
                   for link in self._links()]
        for thread in threads:  # in parallel: each abort lingers briefly for its peer
            thread.start()
        for thread in threads:
            thread.join(1.0)
        for link in self._links():
            link.shutdown()
        try:
            self._on_fatal(self.reason)
        finally:
            self._handled.set()


class KeepAlive:
    """Sends an empty plan on `links` whenever `keepalive_s` passes without another send."""

    def __init__(self, links: list[Link], config: LivenessConfig, fate: Fate) -> None:
        self.links = links
        self.config = config
        self.fate = fate
        self.last_sent = time.monotonic()
        self.round_no = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="keepalive", daemon=True)

    def start(self) -> KeepAlive:
        self._thread.start()
        return self

    def sent(self, round_no: int) -> None:
        """A real plan went out: the next keep-alive is due one interval from now."""
        self.last_sent, self.round_no = time.monotonic(), round_no

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        interval = self.config.keepalive_s
        while not self._stop.wait(min(interval / 4, 0.25)):
            if time.monotonic() - self.last_sent < interval:
                continue
            try:
                for link in self.links:
                    link.send_message(RoundPlan(self.round_no, ()), deadline_s=interval)
            except (ProtocolError, OSError) as error:
                self.fate.fail(error)
                return
            self.last_sent = time.monotonic()


def watch(link: Link, config: LivenessConfig, fate: Fate,
          on_frame: Callable[[Frame], bool]) -> threading.Thread:
    """Read `link` until `on_frame` returns False; silence or any error is fatal."""

    def run() -> None:
        try:
            while True:
                frame = link.recv(deadline_s=config.silence_limit_s)
                if not on_frame(frame):
                    return
        except Deadline:
            fate.fail(Deadline(
                f"nothing from {link.peer} for {config.silence_limit_s:g} s "
                f"({config.dead_after} keep-alive intervals of {config.keepalive_s:g} s): "
                "the ring is dead"))
        except (ProtocolError, OSError) as error:
            fate.fail(error)

    thread = threading.Thread(target=run, name=f"watch-{link.peer}", daemon=True)
    thread.start()
    return thread


def plan_of(frame: Frame) -> RoundPlan:
    """The plan a control frame carries; only plans (and keep-alives) flow after GO."""
    if frame.kind is not FrameKind.PLAN:
        raise UnexpectedFrame(f"expected a PLAN frame after GO, got {frame.kind.name}")
    return decode_plan(frame.payload, round_no=frame.round_no)

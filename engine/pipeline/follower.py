"""A follower: take each plan from rank 0, rows from the predecessor, run, pass on.

`run_follower` is a follower process's life once its ring is up: signals ask rank 0 to
drain the replica, and any fatal error ends the process with one structured line.
"""

from __future__ import annotations

import os
import queue
import signal

import structlog

from engine.backends.base import Stage
from engine.env import EngineEnv
from engine.link.errors import ProtocolError
from engine.link.frame import Frame, FrameKind
from engine.pipeline.liveness import Fate, KeepAlive, LivenessConfig, plan_of, watch
from engine.pipeline.ring import Ring
from engine.pipeline.rows import receive_ring_rows, send_ring_rows
from engine.pipeline.timing import RoundClock
from engine.rounds import RoundPlan

log = structlog.get_logger()
GOODBYE = object()  # rank 0 ended the replica cleanly


def run_follower(env: EngineEnv, stage: Stage, ring: Ring, liveness: LivenessConfig) -> int:
    """Follow rank 0 until it ends the replica (exit 0); a fatal error exits 1 at once."""
    def on_fatal(reason: str) -> None:
        log.error("exiting", code=1, reason=reason)
        os._exit(1)  # threads may sit in blocking reads; the ring is over either way

    fate = Fate(ring.links, on_fatal)
    asked = []

    def on_signal(signum: int, _frame: object) -> None:
        # Any stage asked to stop asks rank 0 to drain the whole replica; asking again
        # (SIGTERM) changes nothing, a second Ctrl-C stops this stage at once.
        if asked and signum == signal.SIGINT:
            on_fatal("stopped by a second SIGINT")
        if asked:
            return
        asked.append(signum)
        log.info("asking rank 0 to drain the replica", signal=signal.Signals(signum).name)
        try:
            ring.control[0].send(FrameKind.GOODBYE, deadline_s=1.0)
        except ProtocolError as error:
            on_fatal(f"could not reach rank 0 to drain: {error}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info("ready", layers=f"{stage.layer_range[0]}:{stage.layer_range[1]}")
    try:
        follow(stage, ring, liveness, fate, env.round_deadline_s)
    except Exception as error:  # noqa: BLE001 - fate has the reason and exits
        fate.fail(error)  # ends the process, here or in the thread that failed first
        on_fatal(fate.reason or f"{type(error).__name__}: {error}")  # exits: never returns
    log.info("exiting", code=0, reason="rank 0 ended the replica")
    return 0


def follow(stage: Stage, ring: Ring, liveness: LivenessConfig, fate: Fate,
           round_deadline_s: float) -> None:
    """Serve rounds until rank 0 says goodbye; any error goes to `fate` (fail-fast)."""
    plans: queue.Queue[RoundPlan | object] = queue.Queue()

    def on_frame(frame: Frame) -> bool:
        if frame.kind is FrameKind.GOODBYE:
            plans.put(GOODBYE)
            return False
        plan = plan_of(frame)
        if not plan.is_keepalive:
            plans.put(plan)
        return True

    control = ring.control[0]
    keepalive = KeepAlive([control], liveness, fate).start()
    watch(control, liveness, fate, on_frame)
    try:
        while (plan := plans.get()) is not GOODBYE:
            run_round(stage, ring, plan, round_deadline_s)
    except Exception as error:
        fate.fail(error)
        raise
    finally:
        keepalive.stop()
    fate.stopping = True
    ring.close()


def run_round(stage: Stage, ring: Ring, plan: RoundPlan, deadline_s: float) -> None:
    if not plan.total_rows:  # closes and cancels: slots change, no rows travel
        stage.forward(plan, None, None)
        return
    clock = RoundClock()
    rows = receive_ring_rows(ring, stage, plan.round_no, plan.total_rows, deadline_s)
    clock.mark("wait_rows")  # the stages before this one computing, and the hop
    out = stage.forward(plan, rows, None)
    clock.mark("compute")  # on a GPU: launching the kernels
    send_ring_rows(ring, stage, out, plan.round_no, len(out), deadline_s, clock)
    log.debug("round timing", round=plan.round_no, rows=plan.total_rows, **clock.phases_ms)

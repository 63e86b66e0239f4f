"""A follower's loop: take each plan from rank 0, rows from the predecessor, run, pass on."""

from __future__ import annotations

import queue

import structlog

from engine.backends.base import Stage
from engine.link.frame import Frame, FrameKind
from engine.pipeline.liveness import Fate, KeepAlive, LivenessConfig, plan_of, watch
from engine.pipeline.ring import Ring
from engine.pipeline.rows import receive_rows
from engine.pipeline.timing import RoundClock
from engine.rounds import RoundPlan

log = structlog.get_logger()
GOODBYE = object()  # rank 0 ended the replica cleanly


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
    rows = receive_rows(ring.from_prev, stage, plan.round_no, plan.total_rows, deadline_s,
                        ring.rows_buffer)
    clock.mark("wait_rows")  # the stages before this one computing, and the hop
    out = stage.forward(plan, rows, None)
    clock.mark("compute")  # on a GPU: launching the kernels
    data = stage.rows_to_bytes(out)
    clock.mark("to_host")  # on a GPU: the kernels finishing, and the copy
    ring.to_next.send(FrameKind.ROWS, data, plan.round_no, len(out), deadline_s=deadline_s)
    clock.mark("send")
    log.debug("round timing", round=plan.round_no, rows=plan.total_rows, **clock.phases_ms)

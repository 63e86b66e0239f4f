"""One engine process of a pipeline: boot the ring, then serve (rank 0) or follow."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from typing import Any

import structlog

from engine import ENGINE_VERSION
from engine.backends.base import Stage
from engine.checkpoint.fingerprint import checkpoint_digest, layout_fingerprint
from engine.config import ModelConfig
from engine.env import EngineEnv
from engine.link.errors import ProtocolError
from engine.link.frame import FrameKind
from engine.link.hello import read_key_file
from engine.link.messages import Backend, Describe
from engine.pipeline.follower import follow
from engine.pipeline.liveness import Fate, LivenessConfig
from engine.pipeline.rank0 import PipelineRunner
from engine.pipeline.ring import Ring, RingConfig, boot_follower, boot_rank0

log = structlog.get_logger()


def describe(stage: Stage, env: EngineEnv) -> Describe:
    rows = stage.row_format
    start, end = stage.layer_range
    return Describe(
        engine_version=ENGINE_VERSION, backend=Backend.from_label(env.backend),
        kv_dtype=rows.dtype, rank=env.rank, world=env.world_size, layer_first=start, layer_end=end,
        hidden=rows.hidden, row_dtype=rows.dtype, planes=rows.planes,
        prompt_chunk=env.chunk, max_rows_per_round=env.parallel + env.chunk,
        parallel=env.parallel, context=env.context, drafter_width=0,
        kv_rows=stage.kv_capacity_rows(), recurrent_states=env.parallel,
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
        return boot_rank0(ring_config, own, n_layers=config.num_hidden_layers,
                          engine_version=ENGINE_VERSION, context=env.context,
                          parallel=env.parallel)
    return boot_follower(ring_config, own)


def run_pipeline_stage(env: EngineEnv, stage: Stage, codec: Any, config: ModelConfig,
                       serve_rank0: Callable) -> int:
    try:
        ring = boot_ring(env, stage, config)
    except ProtocolError as error:
        log.error("exiting", code=1, reason=f"{type(error).__name__}: {error}")
        return 1
    liveness = LivenessConfig(env.keepalive_s, env.dead_after)
    if env.rank == 0:
        log.info("ring up", world=env.world_size)
        return asyncio.run(serve_rank0(
            env, PipelineRunner(stage, ring, liveness, env.round_deadline_s), codec, config))
    return _follow(env, stage, ring, liveness)


def _follow(env: EngineEnv, stage: Stage, ring, liveness: LivenessConfig) -> int:
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

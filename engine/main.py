"""`fleet-engine`: run one stage from the environment contract; rank 0 also serves the API.

Read the environment, load this rank's layer range, then `run_stage`: rank 0 serves
(engine.api.serve) over a local runner or the ring's, a follower follows (engine.pipeline).
"""

from __future__ import annotations

import asyncio
import sys
import time

import structlog

from engine.api.serve import serve
from engine.backends.base import BackendError, Stage, StageSpec, load_stage
from engine.checkpoint.reader import CheckpointError, open_checkpoint
from engine.config import ConfigError, ModelConfig
from engine.env import EngineEnv, EnvError
from engine.lanes.text import TextCodec
from engine.link.errors import ProtocolError
from engine.logs import configure_logging
from engine.pipeline.follower import run_follower
from engine.pipeline.liveness import LivenessConfig
from engine.pipeline.rank0 import PipelineRunner
from engine.pipeline.ring import boot_ring
from engine.pipeline.runner import LocalRunner

log = structlog.get_logger()


def load_progress(what: str):
    """Log each layer as it loads, so a slow load on a big checkpoint shows where it is."""
    started = time.monotonic()

    def report(done: int, total: int, unit: str) -> None:
        log.info("loading", what=what, done=done, total=total, unit=unit,
                 elapsed_s=round(time.monotonic() - started, 2))

    return report


def run_stage(env: EngineEnv, stage: Stage, codec: TextCodec | None,
              config: ModelConfig) -> int:
    """This rank's part, top-down: rank 0 serves over its round runner, a follower follows.

    Returns the exit code; a ring that will not come up (a stranger, a wrong key, a peer
    that never came) exits 1 with its reason."""
    if env.world_size == 1:
        return asyncio.run(serve(env, LocalRunner(stage), codec, config))
    try:
        ring = boot_ring(env, stage, config)
    except ProtocolError as error:
        log.error("exiting", code=1, reason=f"{type(error).__name__}: {error}")
        return 1
    liveness = LivenessConfig(env.keepalive_s, env.dead_after)
    if env.rank != 0:
        return run_follower(env, stage, ring, liveness)
    log.info("ring up", world=env.world_size)
    runner = PipelineRunner(stage, ring, liveness, env.round_deadline_s, depth=env.depth)
    return asyncio.run(serve(env, runner, codec, config))


def main() -> int:
    try:
        env = EngineEnv.from_environ()
    except EnvError as exc:
        print(f"fleet-engine: {exc}", file=sys.stderr)
        return 2
    configure_logging(env.log_level, rank=env.rank, replica=env.placement)
    if env.cpu_threads and env.backend.startswith("torch-"):
        import torch  # only a torch stage pays for importing it

        # Stages that share a machine's cores spin against each other in OpenMP otherwise.
        torch.set_num_threads(env.cpu_threads)
    try:
        checkpoint = open_checkpoint(env.model_dir)
        config = ModelConfig.from_dict(checkpoint.config)
        spec = StageSpec.of(env, config.num_hidden_layers)
        stage = load_stage(spec, checkpoint=checkpoint, progress=load_progress(str(env.model_dir)))
        codec = TextCodec(env.model_dir) if env.rank == 0 else None
    except (CheckpointError, ConfigError, BackendError) as exc:
        log.error("exiting", code=2, reason=f"cannot start: {exc}")
        return 2
    except Exception as exc:  # noqa: BLE001 - a tokenizer that will not parse, say: one line
        log.error("exiting", code=1, reason=f"cannot start: {type(exc).__name__}: {exc}")
        return 1
    # The agent reads weights_bytes from this line: `fleetctl status` sets each stage's
    # resident set (which the agent samples) against it.
    log.info("loaded", layers=f"{spec.layer_range[0]}:{spec.layer_range[1]}",
             backend=env.backend, kv_bytes=stage.state_nbytes, weights_bytes=stage.weights_nbytes)
    try:
        return run_stage(env, stage, codec, config)
    except Exception as exc:  # noqa: BLE001 - whatever escaped still exits with one line
        log.error("exiting", code=1, reason=f"{type(exc).__name__}: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())

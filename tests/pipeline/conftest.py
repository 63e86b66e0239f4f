"""Pipelines with real follower processes and rank 0 in the test, driven by the lane host."""

from __future__ import annotations

import asyncio
import json
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from engine.backends.base import load_stage
from engine.config import ModelConfig
from engine.env import EngineEnv
from engine.lanes.host import Done, GenerationRequest, LaneHost
from engine.lanes.sampler import SamplingParams
from engine.lanes.text import TextCodec
from engine.launch import launch
from engine.pipeline.liveness import LivenessConfig
from engine.pipeline.rank0 import PipelineRunner
from engine.pipeline.stage_main import boot_ring
from engine.runner import LocalRunner


def n_layers(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]


@contextmanager
def pipeline(model_dir: Path, stages, tmp_path: Path, *, parallel=4, context=512, chunk=64,
             backends=None, extra_env=None):
    """Followers as fleet-engine processes; rank 0's runner here, in the test process."""
    fleet = launch(model_dir, stages, backends, context=context, parallel=parallel, chunk=chunk,
                   run_dir=tmp_path / "run", spawn=list(range(1, len(stages))),
                   extra_env=extra_env)
    runner = None
    try:
        env = EngineEnv.from_environ(fleet.envs[0])
        config = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
        stage = load_stage(env.stage_spec(config.num_hidden_layers))
        ring = boot_ring(env, stage, config)
        runner = PipelineRunner(stage, ring, LivenessConfig(env.keepalive_s, env.dead_after),
                                env.round_deadline_s)
        runner.start()
        yield runner
        runner.stop("test over", clean=True)
        codes = [p.wait(30) for p in fleet.processes[1:]]
        assert codes == [0] * len(codes), [fleet.log_tail(r) for r in range(1, len(stages))]
    finally:
        fleet.stop(grace_s=5)


def whole_runner(model_dir: Path, *, parallel=4, context=512, chunk=64) -> LocalRunner:
    env = EngineEnv.from_environ({"FLEET_MODEL": str(model_dir), "FLEET_PARALLEL": str(parallel),
                                  "FLEET_CONTEXT": str(context), "FLEET_CHUNK": str(chunk)})
    return LocalRunner(load_stage(env.stage_spec(n_layers(model_dir))))


def greedy_trace(runner, model_dir: Path, prompts: list[list[int]], *, steps: int,
                 chunk: int) -> list[tuple[object, bytes]]:
    """Every round's plan and the raw bytes of its logits, for streams submitted together."""
    rounds: list[tuple[object, bytes]] = []
    host = LaneHost(runner, TextCodec(model_dir), chunk=chunk, max_waiting=len(prompts),
                    on_round=lambda plan, logits: rounds.append(
                        (plan, np.ascontiguousarray(logits).tobytes())))

    async def go() -> None:
        streams = [host.submit(GenerationRequest(tuple(p), max_tokens=steps,
                                                 sampling=SamplingParams(temperature=0.0)))
                   for p in prompts]
        task = asyncio.create_task(host.run())
        for stream in streams:
            while not isinstance(await stream.events.get(), Done):
                pass
        # Let the round that closes the last slots run too.
        while host.slots_in_use():
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(go())
    host.close()
    return rounds

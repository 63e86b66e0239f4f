"""A replica on this machine with rank 0 inside the calling process, its rounds driven directly.

Followers are real `fleet-engine` processes on loopback; rank 0's runner is returned to the
caller, so tests and benchmarks can run rounds by hand and see every logit. `whole_runner`
is the same model in one process, the reference every pipeline is held to.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from engine.backends.base import StageSpec, load_stage
from engine.config import ModelConfig
from engine.env import EngineEnv
from engine.harness.launch import launch
from engine.pipeline.liveness import LivenessConfig
from engine.pipeline.rank0 import PipelineRunner
from engine.pipeline.ring import boot_ring
from engine.pipeline.runner import LocalRunner


def model_config(model_dir: Path) -> ModelConfig:
    return ModelConfig.from_dict(json.loads((Path(model_dir) / "config.json").read_text()))


@contextmanager
def local_pipeline(model_dir: Path, stages: list[tuple[int, int]], run_dir: Path, *,
                   backends: list[str] | None = None, parallel: int = 4, context: int = 512,
                   chunk: int = 64, extra_env: dict[str, str] | None = None,
                   rank_env: dict[int, dict[str, str]] | None = None,
                   depth: int | None = None) -> Iterator[PipelineRunner]:
    """Followers as processes, rank 0's `PipelineRunner` here; a clean goodbye at the end.
    `depth`: rounds in flight (None: FLEET_ROUNDS_IN_FLIGHT, else one per stage)."""
    fleet = launch(model_dir, stages, backends, context=context, parallel=parallel, chunk=chunk,
                   run_dir=run_dir, spawn=list(range(1, len(stages))), extra_env=extra_env,
                   rank_env=rank_env)
    try:
        env = EngineEnv.from_environ(fleet.envs[0])
        if env.cpu_threads and env.backend.startswith("torch-"):
            import torch

            torch.set_num_threads(env.cpu_threads)  # as the stage's own process would
        config = model_config(model_dir)
        stage = load_stage(StageSpec.of(env, config.num_hidden_layers))
        ring = boot_ring(env, stage, config)
        runner = PipelineRunner(stage, ring, LivenessConfig(env.keepalive_s, env.dead_after),
                                env.round_deadline_s, depth=depth or env.depth)
        runner.start()
        yield runner
        runner.stop("done", clean=True)
        codes = [p.wait(30) for p in fleet.processes[1:]]
        if codes != [0] * len(codes):
            tails = "\n".join(fleet.log_tail(r) for r in range(1, len(stages)))
            raise RuntimeError(f"followers exited with {codes}:\n{tails}")
    finally:
        fleet.stop(grace_s=5)


def whole_runner(model_dir: Path, *, backend: str = "torch-cpu", parallel: int = 4,
                 context: int = 512, chunk: int = 64, cuda_graphs: bool = True,
                 depth: int = 1, drafter: str = "off") -> LocalRunner:
    """The whole model in this process; `depth` groups rounds as a pipeline of that many
    stages would (the same row batches, so a pipeline can be held to it byte for byte);
    `drafter` as FLEET_DRAFTER (a hybrid keeps per-verify-row states only where it drafts)."""
    env = EngineEnv.from_environ({"FLEET_MODEL": str(model_dir), "FLEET_BACKEND": backend,
                                  "FLEET_PARALLEL": str(parallel), "FLEET_CONTEXT": str(context),
                                  "FLEET_CHUNK": str(chunk),
                                  "FLEET_CUDA_GRAPHS": "1" if cuda_graphs else "0",
                                  "FLEET_DRAFTER": drafter})
    return LocalRunner(load_stage(StageSpec.of(env, model_config(model_dir).num_hidden_layers)),
                       depth=depth)

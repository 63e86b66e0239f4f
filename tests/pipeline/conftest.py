"""Pipelines with real follower processes and rank 0 in the test, driven by the lane host."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from engine.harness.local_pipeline import local_pipeline
from engine.lanes.host import Done, Failed, GenerationRequest, LaneHost
from engine.lanes.text import TextCodec
from engine.sampling import SamplingParams
from tests.waiting import wait_until_async


def hybrid_prompts(count: int) -> list[list[int]]:
    """`count` prompts of 150, 139, 128, ... tokens: several chunks each, ending apart."""
    rng = np.random.default_rng(count)
    return [rng.integers(0, 300, 150 - 11 * i).tolist() for i in range(count)]


@contextmanager
def pipeline(model_dir: Path, stages, tmp_path: Path, *, extra_env=None, **kwargs):
    """Followers as fleet-engine processes; rank 0's runner here, in the test process.

    Every stage uses this process's CPU thread count: a matmul split over another number
    of threads sums in another order, and bit-exactness holds only for the same kernels.
    """
    import torch

    extra_env = {"FLEET_CPU_THREADS": str(torch.get_num_threads()), **(extra_env or {})}
    with local_pipeline(model_dir, stages, tmp_path / "run", extra_env=extra_env,
                        **kwargs) as runner:
        yield runner


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
            while not isinstance(event := await stream.events.get(), Done):
                assert not isinstance(event, Failed), f"a stream failed: {event.reason}"
        # Let the round that closes the last slots run too.
        await wait_until_async(lambda: host.slots_in_use() == 0 or task.done(), within_s=60,
                               what="the round that closes the last slots")
        assert not task.done(), f"the round loop ended: {host.failure}"
        task.cancel()

    asyncio.run(go())
    host.close()
    return rounds


def first_difference(got, expected) -> str | None:
    """Where two traces' logits first differ: the round, whether it ran prompt rows or only
    decode rows, how many rounds differ and the largest difference; None: none differ."""
    differ = [i for i, ((_, a), (_, b)) in enumerate(zip(got, expected, strict=True)) if a != b]
    if not differ:
        return None
    plan = expected[differ[0]][0]
    kind = "decode" if all(e.rows <= 1 for e in plan.entries) else "prompt"
    largest = max(float(np.abs(np.frombuffer(got[i][1], np.float32)
                               - np.frombuffer(expected[i][1], np.float32)).max())
                  for i in differ)
    return (f"{len(differ)} of {len(expected)} rounds differ, first round {differ[0]} "
            f"({kind}); largest |difference| {largest:.3g}")

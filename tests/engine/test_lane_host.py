"""The lane host's drain: it waits for the streams in flight (not for a clock), takes no new
ones, gives up at its deadline and ends at once when the engine fails. A real tiny model; the
one fault injected is a round that stalls."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.lanes.host import Busy, Done, GenerationRequest, LaneHost
from engine.lanes.sampler import SamplingParams
from engine.lanes.text import TextCodec
from engine.pipeline.runner import LocalRunner
from tests.engine.conftest import whole_stage


class StallingRunner(LocalRunner):
    """Holds every round after the first `free_rounds` until `release` is set."""

    def __init__(self, stage, free_rounds: int) -> None:
        super().__init__(stage)
        self.free_rounds, self.rounds = free_rounds, 0
        self.release = threading.Event()

    def run_round(self, plan, token_ids):
        self.rounds += 1
        if self.rounds > self.free_rounds:
            self.release.wait(30)
        return super().run_round(plan, token_ids)


def request(max_tokens: int) -> GenerationRequest:
    return GenerationRequest((1, 2, 3, 4), max_tokens=max_tokens,
                             sampling=SamplingParams(temperature=0.0))


@pytest.fixture
def model(make_model):
    model_dir = make_model("qwen3")
    return whole_stage(model_dir, parallel=2, context=64, chunk=16), TextCodec(model_dir)


def test_a_drain_returns_when_the_last_stream_ends_and_takes_no_new_one(model):
    stage, codec = model
    host = LaneHost(LocalRunner(stage), codec, chunk=16, max_waiting=2)

    async def go():
        loop_task = asyncio.create_task(host.run())
        streams = [host.submit(request(12)), host.submit(request(20))]
        drained = await host.drain(30)
        ended = [s.finished for s in streams]
        with pytest.raises(Busy, match="draining"):
            host.submit(request(1))
        loop_task.cancel()
        return drained, ended, [s.events.qsize() for s in streams]

    drained, ended, queued = asyncio.run(go())
    host.close()
    assert drained and ended == [True, True] and host.idle()
    assert queued == [13, 21]  # every token and the Done were there when the drain returned


def test_a_drain_gives_up_at_its_deadline(model):
    stage, codec = model
    runner = StallingRunner(stage, free_rounds=2)
    host = LaneHost(runner, codec, chunk=16, max_waiting=2)

    async def go():
        loop_task = asyncio.create_task(host.run())
        host.submit(request(30))
        started = time.monotonic()
        drained = await host.drain(0.5)
        waited = time.monotonic() - started
        runner.release.set()
        loop_task.cancel()
        return drained, waited

    try:
        drained, waited = asyncio.run(go())
    finally:
        runner.release.set()
        host.close()
    assert not drained and 0.5 <= waited < 5


def test_a_failure_ends_a_drain_at_once(model):
    stage, codec = model
    runner = StallingRunner(stage, free_rounds=1)
    host = LaneHost(runner, codec, chunk=16, max_waiting=2)

    async def go():
        loop_task = asyncio.create_task(host.run())
        stream = host.submit(request(30))
        asyncio.get_running_loop().call_later(0.2, host.fail, "the ring died")
        started = time.monotonic()
        drained = await host.drain(30)
        waited = time.monotonic() - started
        loop_task.cancel()
        events = [stream.events.get_nowait() for _ in range(stream.events.qsize())]
        return drained, waited, events

    try:
        drained, waited, events = asyncio.run(go())
    finally:
        runner.release.set()
        host.close()
    assert not drained and waited < 5
    assert events[-1].reason == "the ring died" and not any(isinstance(e, Done) for e in events)

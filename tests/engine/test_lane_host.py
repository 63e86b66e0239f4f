"""The lane host's drain: it waits for the streams in flight (not for a clock), takes no new
ones, gives up at its deadline and ends at once when the engine fails. A real tiny model; the
one fault injected is a round that stalls."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.lanes.host import Busy, Done, GenerationRequest, LaneHost
from engine.lanes.text import TextCodec
from engine.pipeline.runner import LocalRunner
from engine.sampling import SamplingParams
from tests.engine.conftest import whole_stage
from tests.stalling_runner import StallingRunner


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


async def drain_while_a_round_stalls(host: LaneHost, deadline_s: float,
                                     fail_after_s: float | None = None):
    """Submit one long stream, drain (failing the host after `fail_after_s`, if given);
    returns (drained, seconds waited, the stream's events)."""
    loop_task = asyncio.create_task(host.run())
    stream = host.submit(request(30))
    if fail_after_s is not None:
        asyncio.get_running_loop().call_later(fail_after_s, host.fail, "the ring died")
    started = time.monotonic()
    drained = await host.drain(deadline_s)
    waited = time.monotonic() - started
    host.runner.release.set()
    loop_task.cancel()
    return drained, waited, [stream.events.get_nowait() for _ in range(stream.events.qsize())]


def test_a_drain_gives_up_at_its_deadline(model):
    stage, codec = model
    runner = StallingRunner(stage, free_rounds=2)
    host = LaneHost(runner, codec, chunk=16, max_waiting=2)
    try:
        drained, waited, _events = asyncio.run(drain_while_a_round_stalls(host, 0.5))
    finally:
        runner.release.set()
        host.close()
    assert not drained and 0.5 <= waited < 5


def test_a_failure_ends_a_drain_at_once(model):
    stage, codec = model
    runner = StallingRunner(stage, free_rounds=1)
    host = LaneHost(runner, codec, chunk=16, max_waiting=2)
    try:
        drained, waited, events = asyncio.run(
            drain_while_a_round_stalls(host, 30, fail_after_s=0.2))
    finally:
        runner.release.set()
        host.close()
    assert not drained and waited < 5
    assert events[-1].reason == "the ring died" and not any(isinstance(e, Done) for e in events)


class HandClock:
    """The lane host's clock, moved by hand: `rounds_owed_s` is read against it."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rounds_owed_grow_only_while_no_round_lands(model):
    stage, codec = model
    runner = StallingRunner(stage, free_rounds=3)
    clock = HandClock()
    host = LaneHost(runner, codec, chunk=16, max_waiting=2, clock=clock)

    async def go():
        assert host.rounds_owed_s() == 0.0  # idle: nothing is owed, however long ago
        clock.now += 50
        loop_task = asyncio.create_task(host.run())
        stream = host.submit(request(30))
        owed_at_submit = host.rounds_owed_s()  # counted from the submit, not the start
        clock.now += 3  # before any round lands: the landings below count from here
        await asyncio.get_running_loop().run_in_executor(None, runner.stalled.wait, 20)
        landed = host.round_no
        clock.now += 7
        owed_while_stuck = host.rounds_owed_s()
        busy_while_stuck = host.round_thread_busy()
        runner.free_rounds = 10**6  # no more stalls once released
        runner.release.set()
        while not stream.finished:
            await stream.events.get()
        await asyncio.wait_for(host.drain(20), 20)
        loop_task.cancel()
        return owed_at_submit, landed, owed_while_stuck, busy_while_stuck

    owed_at_submit, landed, owed_while_stuck, busy_while_stuck = asyncio.run(go())
    host.close()
    assert owed_at_submit == 0.0 and landed >= 2
    assert owed_while_stuck == 7.0 and busy_while_stuck
    assert host.rounds_owed_s() == 0.0 and not host.round_thread_busy()

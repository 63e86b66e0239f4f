"""The lane host with several rounds in flight (RFC 6.3 v2/v3): what it launches while a
round is out, and what it never launches. A real tiny model in one process; the runner
only records the order of its launches and lands (tests/pipeline/test_overlap.py holds a
real ring to one process running the same rounds, byte for byte)."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from engine.lanes.host import Done, Failed, GenerationRequest, LaneHost
from engine.lanes.text import TextCodec
from engine.pipeline.runner import LocalRunner
from engine.rounds import Op
from engine.sampling import SamplingParams
from tests.engine.conftest import whole_stage


class RecordingRunner(LocalRunner):
    """A one-process runner that notes every launch and land, in order."""

    def __init__(self, stage, depth: int) -> None:
        super().__init__(stage, depth=depth)
        self.events: list[tuple[str, object]] = []

    def launch(self, plan, token_ids, batch) -> None:
        self.events.append(("launch", plan))
        super().launch(plan, token_ids, batch)

    def land(self):
        self.events.append(("land", None))
        return super().land()


def in_flight_sets(events) -> list[list]:
    """The plans in flight after each launch, oldest first."""
    flying, sets = [], []
    for kind, plan in events:
        if kind == "launch":
            flying.append(plan)
            sets.append(list(flying))
        else:
            flying.pop(0)
    return sets


def serve(runner, model_dir, prompts, max_tokens, *, chunk=16) -> list[list[int]]:
    host = LaneHost(runner, TextCodec(model_dir), chunk=chunk, max_waiting=len(prompts))

    async def go():
        task = asyncio.create_task(host.run())
        streams = [host.submit(GenerationRequest(tuple(p), max_tokens=max_tokens,
                                                 sampling=SamplingParams(temperature=0.0)))
                   for p in prompts]
        tokens = []
        for stream in streams:
            got = []
            while not isinstance(event := await stream.events.get(), Done):
                assert not isinstance(event, Failed), event.reason
                got.append(event.token_id)
            tokens.append(got)
        task.cancel()
        return tokens

    try:
        return asyncio.run(asyncio.wait_for(go(), 120))
    finally:
        host.close()


@pytest.fixture
def model_dir(make_model):
    return make_model("qwen3", seed=11)


def prompts(count: int, length: int) -> list[list[int]]:
    rng = np.random.default_rng(count * 1000 + length)
    return [rng.integers(0, 300, length).tolist() for _ in range(count)]


def test_a_prompts_next_chunk_is_launched_while_the_last_is_in_flight(model_dir):
    runner = RecordingRunner(whole_stage(model_dir, parallel=2, context=256, chunk=16), 2)
    serve(runner, model_dir, prompts(1, 80), 4)  # five chunks of 16
    overlapped = [s for s in in_flight_sets(runner.events) if len(s) == 2]
    # Chunks 1+2, 2+3, 3+4 and 4+5 were out together: the ring's stages all had work.
    chunk_pairs = [s for s in overlapped if all(p.total_rows == 16 for p in s)]
    assert len(chunk_pairs) == 4, [[(p.round_no, p.total_rows) for p in s] for s in overlapped]
    for older, newer in chunk_pairs:
        (a,), (b,) = older.entries, newer.entries
        assert a.stream_id == b.stream_id and b.first == a.end  # in order, one stream


def test_a_stream_waiting_for_its_next_token_rides_no_other_round(model_dir):
    runner = RecordingRunner(whole_stage(model_dir, parallel=4, context=256, chunk=16), 2)
    serve(runner, model_dir, prompts(4, 20), 12)
    for flying in in_flight_sets(runner.events):
        *older, newest = flying
        for plan in older:
            for entry in plan.entries:
                mid_prompt = entry.rows > 1 and entry.end < 20
                if not mid_prompt:  # a decode row, a prompt's last chunk, a close
                    assert entry.stream_id not in {e.stream_id for e in newest.entries}, (
                        f"stream {entry.stream_id} in round {plan.round_no} and in "
                        f"{newest.round_no}, which launched before the first landed")


@pytest.mark.parametrize("streams,depth", [(8, 2), (5, 2), (6, 3)])
def test_decode_rows_go_in_groups_that_occupy_different_stages(model_dir, streams, depth):
    runner = RecordingRunner(whole_stage(model_dir, parallel=8, context=256, chunk=64),
                             depth)
    serve(runner, model_dir, prompts(streams, 4), 10, chunk=64)
    decode_rounds = [p for kind, p in runner.events if kind == "launch"
                     and p.entries and all(e.rows == 1 for e in p.entries)]
    group = math.ceil(streams / depth)
    assert decode_rounds and all(len(p.entries) <= group for p in decode_rounds)
    full = [s for s in in_flight_sets(runner.events) if len(s) == depth]
    assert full, "the groups never had every stage busy at once"
    # Every stream was served: each got all its tokens, in rounds of at most `group` rows.
    rows = {e.stream_id for p in decode_rounds for e in p.entries if e.op is Op.CONTINUE}
    assert rows == set(range(streams))


def test_depth_one_runs_one_round_at_a_time(model_dir):
    runner = RecordingRunner(whole_stage(model_dir, parallel=4, context=256, chunk=16), 1)
    serve(runner, model_dir, prompts(3, 40), 6)
    assert max(len(s) for s in in_flight_sets(runner.events)) == 1
    kinds = [kind for kind, _ in runner.events]
    # Strictly alternating; the last round (a close after the final token) may still be
    # out when the test stops the host.
    assert set(kinds[0::2]) == {"launch"} and set(kinds[1::2]) == {"land"}, kinds


class FaultyRunner(RecordingRunner):
    """Raises in the launch or the landing of one round (an injected fault)."""

    def __init__(self, stage, depth: int, *, fail_in: str, round_no: int) -> None:
        super().__init__(stage, depth)
        self.fail_in, self.round_no = fail_in, round_no
        self._landing: list[int] = []

    def launch(self, plan, token_ids, batch) -> None:
        if self.fail_in == "launch" and plan.round_no == self.round_no:
            raise RuntimeError("injected launch fault")
        super().launch(plan, token_ids, batch)
        self._landing.append(plan.round_no)

    def land(self):
        if self.fail_in == "land" and self._landing.pop(0) == self.round_no:
            raise RuntimeError("injected land fault")
        return super().land()


@pytest.mark.parametrize("fail_in", ["launch", "land"])
def test_a_round_that_fails_to_launch_or_land_fails_the_engine_naming_it(model_dir, fail_in):
    # Round 3 is launched in the same trip to the round thread as round 2's landing: the
    # failure still names the round that raised, and every stream ends with it.
    runner = FaultyRunner(whole_stage(model_dir, parallel=2, context=256, chunk=16), 2,
                          fail_in=fail_in, round_no=3)
    host = LaneHost(runner, TextCodec(model_dir), chunk=16, max_waiting=2)

    async def go():
        task = asyncio.create_task(host.run())
        stream = host.submit(GenerationRequest(tuple(prompts(1, 80)[0]), max_tokens=4,
                                               sampling=SamplingParams(temperature=0.0)))
        while not isinstance(event := await stream.events.get(), (Done, Failed)):
            pass
        await asyncio.wait_for(task, 30)
        return event

    try:
        event = asyncio.run(asyncio.wait_for(go(), 120))
    finally:
        host.close()
    assert isinstance(event, Failed)
    assert event.reason == f"round 3 failed: injected {fail_in} fault", event.reason
    assert host.failure == event.reason

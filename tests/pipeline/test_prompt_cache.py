"""A second turn that resumes from the first turn's kept state gets the bytes of a fresh ring.

Turn 1 runs a prompt of several chunks and a reply; turn 2's prompt is turn 1's prompt, its
reply and a new message, as an OpenAI client resends a conversation. On the ring that served
turn 1, turn 2 resumes its slot at the last full chunk of turn 1's prompt and runs only the
rest; on a fresh ring it runs everything. The reply, and every round's logits from the
resume on, must be the same bytes (dense and hybrid, one process and two stages, PyTorch,
MLX and a mixed ring), and the reply must say how many prompt tokens were restored.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engine.harness.local_pipeline import whole_runner
from engine.lanes.host import Done, Failed, GenerationRequest, LaneHost, Token
from engine.lanes.sampler import SamplingParams
from engine.lanes.text import TextCodec
from engine.rounds import Op
from tests.pipeline.conftest import pipeline
from tests.waiting import wait_until_async

CHUNK = 32
STEPS = 12
FIRST = 100  # turn 1's prompt: three full chunks (96 positions) and 4 rows more


def conversation(runner, model_dir, prompts_of, *, settle=True):
    """Run requests one after another on one lane host; for each: (token ids, Done, the
    plans and logits bytes of its rounds). `prompts_of(replies)` gives the next prompt from
    the replies so far, or None to stop. `settle`: wait for the round that closes a slot
    before the next request; without it the next comes at its reply's end, as a client's."""
    host = LaneHost(runner, TextCodec(model_dir), chunk=CHUNK, max_waiting=1,
                    on_round=lambda plan, logits: rounds.append(
                        (plan, np.ascontiguousarray(logits).tobytes())))
    rounds: list = []
    turns: list = []

    async def go() -> None:
        task = asyncio.create_task(host.run())
        while (prompt := prompts_of([t[0] for t in turns])) is not None:
            rounds.clear()
            stream = host.submit(GenerationRequest(tuple(prompt), max_tokens=STEPS,
                                                   sampling=SamplingParams(temperature=0.0)))
            tokens = []
            while not isinstance(event := await stream.events.get(), Done):
                assert not isinstance(event, Failed), event.reason
                if isinstance(event, Token):
                    tokens.append(event.token_id)
            if settle:
                await wait_until_async(lambda: host.slots_in_use() == 0 or task.done(),
                                       within_s=60, what="the round that closes the slot")
            assert not task.done(), host.failure
            turns.append((tokens, event, list(rounds)))
        task.cancel()

    asyncio.run(go())
    host.close()
    return turns


def two_turns(first_prompt, extra):
    def prompts_of(replies):
        if not replies:
            return first_prompt
        if len(replies) == 1:
            return [*first_prompt, *replies[0], *extra]
        return None
    return prompts_of


def check_second_turn_is_fresh(cached_runner, fresh_runner, model_dir, *, settle=True):
    rng = np.random.default_rng(5)
    first, extra = rng.integers(0, 300, FIRST).tolist(), rng.integers(0, 300, 9).tolist()
    (reply1, done1, _), (reply2, done2, rounds2) = conversation(
        cached_runner, model_dir, two_turns(first, extra), settle=settle)
    assert done1.cached_tokens == 0
    assert done2.cached_tokens == 96  # the last full chunk of turn 1's prompt
    # Unsettled, turn 2 starts with the round that closes turn 1's slot; then it resumes.
    resumed = [i for i, (plan, _) in enumerate(rounds2)
               if any(e.op == Op.RESUME for e in plan.entries)]
    assert resumed == [0 if settle else 1]
    rounds2 = rounds2[resumed[0]:]
    # A fresh lane host on another ring runs turn 2's whole prompt, with nothing kept.
    second = [*first, *reply1, *extra]
    [(fresh_reply, fresh_done, fresh_rounds)] = conversation(
        fresh_runner, model_dir, lambda replies: None if replies else second)
    assert fresh_done.cached_tokens == 0
    assert reply2 == fresh_reply
    # Rounds that only close a slot run no rows; unsettled, turn 2's own close may come
    # after the host stopped, so they are left out of the comparison.
    rounds2, fresh_rounds = ([(plan, logits) for plan, logits in rs
                              if any(e.op not in (Op.CLOSE, Op.CANCEL) for e in plan.entries)]
                             for rs in (rounds2, fresh_rounds))
    tail = fresh_rounds[-len(rounds2):]
    assert len(fresh_rounds) > len(rounds2)  # the hit ran fewer rounds
    for (plan, logits), (_, want) in zip(rounds2, tail, strict=True):
        assert logits == want, f"round {plan.round_no} after the resume differs"


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("backend", ["torch-cpu", "mlx-cpu"])
def test_one_process(make_model, family, backend):
    model_dir = make_model(family, num_hidden_layers=3)
    check_second_turn_is_fresh(whole_runner(model_dir, backend=backend, chunk=CHUNK),
                               whole_runner(model_dir, backend=backend, chunk=CHUNK), model_dir)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_next_turn_at_once_waits_a_round_for_its_slot(make_model, family):
    # Turn 2 arrives while turn 1's slot still closes and other slots are free: it waits
    # for that slot rather than start over in another.
    model_dir = make_model(family, num_hidden_layers=3)
    check_second_turn_is_fresh(whole_runner(model_dir, chunk=CHUNK, parallel=3),
                               whole_runner(model_dir, chunk=CHUNK, parallel=3), model_dir,
                               settle=False)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_two_stages(make_model, tmp_path, family):
    model_dir = make_model(family, num_hidden_layers=3)
    with pipeline(model_dir, [(0, 1), (1, 3)], tmp_path / "a", chunk=CHUNK) as cached, \
            pipeline(model_dir, [(0, 1), (1, 3)], tmp_path / "b", chunk=CHUNK) as fresh:
        check_second_turn_is_fresh(cached, fresh, model_dir)


def test_a_mixed_ring(make_model, tmp_path):
    model_dir = make_model("qwen3_5", num_hidden_layers=3)
    backends = ["torch-cpu", "mlx-cpu"]
    with pipeline(model_dir, [(0, 1), (1, 3)], tmp_path / "a", chunk=CHUNK,
                  backends=backends) as cached, \
            pipeline(model_dir, [(0, 1), (1, 3)], tmp_path / "b", chunk=CHUNK,
                     backends=backends) as fresh:
        check_second_turn_is_fresh(cached, fresh, model_dir)


def test_slots_past_the_streams_keep_more_conversations(make_model):
    # One stream at a time over three slots (FLEET_PARALLEL=1, FLEET_PROMPT_CACHE_SLOTS=2):
    # three conversations stay kept, and the first one's next turn still resumes.
    model_dir = make_model("qwen3", num_hidden_layers=2)
    runner = whole_runner(model_dir, chunk=CHUNK, parallel=3)
    host = LaneHost(runner, TextCodec(model_dir), chunk=CHUNK, max_waiting=4, streams=1)
    rng = np.random.default_rng(7)
    histories = [rng.integers(0, 300, FIRST).tolist() for _ in range(3)]
    greedy = SamplingParams(temperature=0.0)

    async def go() -> list[Done]:
        task = asyncio.create_task(host.run())
        # Two at once: the second waits for the one stream.
        first = [host.submit(GenerationRequest(tuple(h), max_tokens=4, sampling=greedy))
                 for h in histories[:2]]
        assert host.slots_in_use() == 1 and len(host.waiting) == 1
        ends = [await until_done(s) for s in first]
        ends.append(await until_done(host.submit(
            GenerationRequest(tuple(histories[2]), max_tokens=4, sampling=greedy))))
        await wait_until_async(lambda: host.slots_in_use() == 0, within_s=60,
                               what="every slot closed")
        assert sum(k is not None for k in host.kept) == 3
        again = [*histories[0], *rng.integers(0, 300, 9).tolist()]
        ends.append(await until_done(host.submit(
            GenerationRequest(tuple(again), max_tokens=4, sampling=greedy))))
        task.cancel()
        return ends

    ends = asyncio.run(go())
    host.close()
    assert [e.cached_tokens for e in ends] == [0, 0, 0, 96]


async def until_done(stream) -> Done:
    while not isinstance(event := await stream.events.get(), Done):
        assert not isinstance(event, Failed), event.reason
    return event

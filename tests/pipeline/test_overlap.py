"""Overlapped rounds on a real ring (RFC 6.3 v2/v3): slots reused while rounds are in
flight keep the bits of one process running the same rounds, and a stage lost while
several rounds are out still ends every stage and tells every client."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import openai
from openai import OpenAI

from engine.harness.launch import launch
from engine.harness.local_pipeline import whole_runner
from tests.pipeline.conftest import greedy_trace, pipeline
from tests.waiting import rank0_health, wait_until

CHUNK = 16


def test_slots_reused_while_rounds_are_in_flight_keep_one_process_bits(make_model, tmp_path):
    """Two slots, five streams: three wait, and each takes a slot another stream released
    while the ring still had rounds out; every round's logits equal one process's."""
    model_dir = make_model("qwen3", num_hidden_layers=4, seed=5)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 300, 40 + 9 * i).tolist() for i in range(5)]
    whole = whole_runner(model_dir, parallel=2, chunk=CHUNK, depth=2)  # the ring's rounds
    expected = greedy_trace(whole, model_dir, prompts, steps=12, chunk=CHUNK)
    with pipeline(model_dir, [(0, 2), (2, 4)], tmp_path, parallel=2, chunk=CHUNK) as runner:
        assert runner.depth == 2
        got = greedy_trace(runner, model_dir, prompts, steps=12, chunk=CHUNK)
    assert [plan for plan, _ in got] == [plan for plan, _ in expected]
    for (plan, logits), (_, want) in zip(got, expected, strict=True):
        assert logits == want, f"round {plan.round_no} differs"
    opened = [e.stream_id for plan, _ in got for e in plan.entries if e.op.name == "OPEN"]
    assert len(opened) == 5 and set(opened) == {0, 1}  # slots reused


KEEPALIVE_S = 0.5
DEAD_AFTER = 3
EXIT_BOUND_S = KEEPALIVE_S * DEAD_AFTER + 5.0  # as tests/pipeline/test_faults.py says why


def test_a_stage_lost_while_prompt_chunks_are_in_flight_ends_the_ring(make_model, tmp_path):
    model = make_model("qwen2", num_hidden_layers=2, seed=9, hidden_size=256,
                       intermediate_size=1024)
    fleet = launch(model, [(0, 1), (1, 2)], run_dir=tmp_path / "run", context=8192,
                   parallel=2, chunk=CHUNK,
                   extra_env={"FLEET_KEEPALIVE_S": str(KEEPALIVE_S),
                              "FLEET_DEAD_AFTER": str(DEAD_AFTER)})
    try:
        fleet.wait_ready()
        client = OpenAI(base_url=fleet.url, api_key="x", max_retries=0, timeout=60)
        model_id = client.models.list().data[0].id
        outcome: list[object] = []

        def ask() -> None:  # 6,000 tokens, 375 chunks: rounds out on both stages
            try:
                outcome.append(client.completions.create(
                    model=model_id, prompt="go on " * 1200, max_tokens=4, temperature=0))
            except Exception as error:  # noqa: BLE001 - the outcome is what we check
                outcome.append(error)

        asker = threading.Thread(target=ask)
        asker.start()
        wait_until(lambda: outcome or rank0_health(fleet.http_port)["slots_in_use"] == 1,
                   within_s=30, what="the long prompt in a slot")
        assert not outcome, outcome
        killed_at = time.monotonic()
        os.kill(fleet.processes[1].pid, signal.SIGKILL)
        code = fleet.processes[0].wait(EXIT_BOUND_S + 10)
        after_s = time.monotonic() - killed_at
        assert code != 0 and after_s < EXIT_BOUND_S, (code, after_s)
        asker.join(30)
        assert isinstance(outcome[0], openai.InternalServerError), outcome
        assert outcome[0].status_code == 503  # nothing was sent: worth a retry elsewhere
    finally:
        fleet.stop(grace_s=2)

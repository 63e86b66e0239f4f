"""Fail-fast: kill -9 any rank mid-stream and every other rank exits, clients told honestly.

A stream that had sent tokens ends with an SSE error event and no finish_reason; a request
that had sent nothing gets a retryable 503. When rank 0 itself dies nobody is left to
answer, so its clients see the connection end without a finish_reason.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import openai
import pytest
from openai import OpenAI

from engine.harness.launch import launch
from tests.waiting import rank0_health, wait_until

KEEPALIVE_S = 0.5
DEAD_AFTER = 3
# The bound the design promises (three keep-alive intervals), plus room for a loaded
# 2-core machine to schedule the processes and for their interpreters to exit.
EXIT_BOUND_S = KEEPALIVE_S * DEAD_AFTER + 5.0


@pytest.mark.parametrize("victim", [0, 1, 2])
def test_kill_any_rank_mid_stream(make_model, tmp_path, victim):
    model = make_model("qwen2", num_hidden_layers=3, seed=7)  # not the suite's order
    fleet = launch(model, [(0, 1), (1, 2), (2, 3)], run_dir=tmp_path / "run", context=4096,
                   parallel=2, chunk=64,
                   extra_env={"FLEET_KEEPALIVE_S": str(KEEPALIVE_S),
                              "FLEET_DEAD_AFTER": str(DEAD_AFTER)})
    try:
        fleet.wait_ready()
        client = OpenAI(base_url=fleet.url, api_key="x", max_retries=0, timeout=60)
        model_id = client.models.list().data[0].id
        long = dict(model=model_id, prompt="go on", max_tokens=4000, temperature=0,
                    extra_body={"ignore_eos": True})
        whole_outcome: list[BaseException | object] = []

        def whole_request() -> None:
            try:
                whole_outcome.append(client.completions.create(**long))
            except Exception as error:  # noqa: BLE001 - the outcome is what we check
                whole_outcome.append(error)

        stream = client.completions.create(**long, stream=True)
        chunks = iter(stream)
        seen = [next(chunks) for _ in range(3)]  # tokens have gone out
        waiter = threading.Thread(target=whole_request)
        waiter.start()
        # Both slots held: the whole request is admitted and running, no byte sent yet. A
        # request that arrived only after the kill would get a 503 too, without this case.
        wait_until(lambda: rank0_health(fleet.http_port)["slots_in_use"] == 2, within_s=30,
                   what="the stream and the whole request both in a slot")
        assert not whole_outcome, whole_outcome

        killed_at = time.monotonic()
        os.kill(fleet.processes[victim].pid, signal.SIGKILL)
        exits = {}
        for rank, proc in enumerate(fleet.processes):
            if rank != victim:
                code = proc.wait(EXIT_BOUND_S + 10)
                exits[rank] = (code, time.monotonic() - killed_at)
        for rank, (code, after_s) in exits.items():
            assert code != 0, f"rank {rank} exited 0 after rank {victim} died"
            assert after_s < EXIT_BOUND_S, f"rank {rank} took {after_s:.1f} s to exit"
            assert "exiting" in fleet.log_tail(rank)

        finish_reasons = []
        with pytest.raises((openai.APIError, openai.APIConnectionError)):
            for chunk in chunks:
                seen.append(chunk)
                finish_reasons.append(chunk.choices[0].finish_reason if chunk.choices else None)
        assert all(reason is None for reason in finish_reasons)  # incomplete, and says so
        waiter.join(30)
        outcome = whole_outcome[0]
        if victim == 0:
            assert isinstance(outcome, (openai.APIConnectionError, openai.APIStatusError))
        else:
            assert isinstance(outcome, openai.InternalServerError), outcome
            assert outcome.status_code == 503
            assert outcome.response.headers["Retry-After"]
    finally:
        fleet.stop(grace_s=2)

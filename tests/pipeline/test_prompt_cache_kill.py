"""A follower killed (SIGKILL, a real process) while the prompt cache is saving a prefix
leaves no entry any stage would serve: rank 0 ends with its ring (fail-fast), so the slot
table it would match prompts against dies with it, and the replica started in its place
answers the resent conversation with the bytes of a fresh ring and 0 cached tokens.

Two moments, on a hybrid (whose stages save recurrent state where prompt chunks end):
while turn 1 is still decoding (its chunks' state saved, its CLOSE not sent) and just after
turn 1's reply ended (its CLOSE in flight or landed). The replacement restarts every rank
on the same ports, as the supervisor restarts a failed replica's stages.
"""

from __future__ import annotations

import os
import signal

import openai
import pytest
from openai import OpenAI

from engine.harness.launch import launch
from tests.waiting import rank0_health, wait_until

STAGES = [(0, 1), (1, 3)]
SHAPE = dict(context=512, parallel=1, chunk=32, prompt_cache_slots=2,
             extra_env={"FLEET_KEEPALIVE_S": "0.5", "FLEET_DEAD_AFTER": "3"})
TURN1 = [{"role": "user", "content": " ".join(f"word{i}" for i in range(15))}]
EXIT_WAIT_S = 60  # a bound on the wait, not a promise checked: rank 0 must exit at all


def ask(client: OpenAI, messages, max_tokens: int):
    """(content, every token's logprob, cached tokens) of a greedy reply."""
    reply = client.chat.completions.create(model=client.models.list().data[0].id,
                                           messages=messages, max_tokens=max_tokens,
                                           temperature=0, logprobs=True)
    choice = reply.choices[0]
    return (choice.message.content, [(t.token, t.logprob) for t in choice.logprobs.content],
            reply.usage.prompt_tokens_details.cached_tokens)


def client_of(fleet) -> OpenAI:
    return OpenAI(base_url=fleet.url, api_key="x", max_retries=0, timeout=60)


@pytest.mark.parametrize("moment", ["decoding", "closing"])
def test_a_follower_killed_while_a_prefix_is_kept_leaves_nothing_served(make_model, tmp_path,
                                                                       moment):
    model_dir = make_model("qwen3_5", num_hidden_layers=3)
    fresh_rings = iter(range(3))

    def on_a_fresh_ring(messages):
        with launch(model_dir, STAGES, run_dir=tmp_path / f"fresh{next(fresh_rings)}",
                    **SHAPE) as fresh:
            fresh.wait_ready()
            answer = ask(client_of(fresh), messages, 6)
        assert answer[2] == 0
        return answer

    reply1 = on_a_fresh_ring(TURN1)[0]
    turn2 = [*TURN1, {"role": "assistant", "content": reply1},
             {"role": "user", "content": "and then?"}]
    # What the client resends after the failure, answered by a ring that never kept it.
    resent = TURN1 if moment == "decoding" else turn2
    want = on_a_fresh_ring(resent)

    with launch(model_dir, STAGES, run_dir=tmp_path / "served", **SHAPE) as fleet:
        fleet.wait_ready()
        client = client_of(fleet)
        if moment == "decoding":
            stream = client.chat.completions.create(
                model=client.models.list().data[0].id, messages=TURN1, max_tokens=400,
                temperature=0, stream=True, extra_body={"ignore_eos": True})
            chunks = iter(stream)
            next(c for c in chunks if c.choices and c.choices[0].delta.content)
        else:
            assert ask(client, TURN1, 6)[0] == reply1
        os.kill(fleet.processes[1].pid, signal.SIGKILL)
        code = fleet.processes[0].wait(EXIT_WAIT_S)
        assert code != 0, "rank 0 outlived its ring and the slots it kept"
        if moment == "decoding":
            with pytest.raises((openai.APIError, openai.APIConnectionError)):
                for _ in chunks:
                    pass

        for rank in range(len(STAGES)):  # the replacement, on the same ports
            fleet.start_rank(rank)
        fleet.wait_ready()
        got = ask(client, resent, 6)
        assert got == want  # the fresh ring's reply, token by token, logprobs bit for bit
        # Now the replacement keeps it: the next turn is a correct hit, never a wrong one.
        wait_until(lambda: rank0_health(fleet.http_port)["prompt_cache"]["held"] == 1,
                   within_s=60, what="the resent turn's slot kept")
        if moment == "closing":
            turn3 = [*turn2, {"role": "assistant", "content": got[0]},
                     {"role": "user", "content": "more"}]
            hit = ask(client, turn3, 6)
            assert hit[2] > 0
            assert hit[:2] == on_a_fresh_ring(turn3)[:2]

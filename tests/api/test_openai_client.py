"""The official openai client against a running fleet-engine: every endpoint and mode."""

from __future__ import annotations

import json

import openai
import pytest

from tests.api.conftest import http


def test_models_lists_the_served_model(client, model_id, engine):
    models = client.models.list().data
    assert [m.id for m in models] == [model_id]
    assert model_id == engine.model_dir.name


def test_completion_from_text_and_from_token_ids(client, model_id):
    text = client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=8,
                                     temperature=0)
    assert text.object == "text_completion"
    assert text.choices[0].finish_reason == "length"
    assert text.usage.completion_tokens == 8
    assert text.usage.total_tokens == text.usage.prompt_tokens + 8
    assert text.system_fingerprint  # the placement id
    ids = client.completions.create(model=model_id, prompt=[5, 17, 99, 3], max_tokens=4,
                                    temperature=0)
    assert ids.usage.prompt_tokens == 4
    assert ids.usage.completion_tokens == 4


def test_streamed_completion_matches_the_whole_one(client, model_id):
    whole = client.completions.create(model=model_id, prompt="The ring", max_tokens=12,
                                      temperature=0)
    chunks = list(client.completions.create(model=model_id, prompt="The ring", max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


def test_chat_whole_and_streamed(client, model_id):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is a pipeline?"}]
    whole = client.chat.completions.create(model=model_id, messages=messages, max_tokens=10,
                                           temperature=0)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=model_id, messages=messages, max_tokens=10,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason


def test_seeded_sampling_is_reproducible(client, model_id):
    def ask(seed):
        return client.completions.create(model=model_id, prompt="Seeds", max_tokens=16,
                                         temperature=1.0, top_p=0.9, seed=seed,
                                         extra_body={"top_k": 50}).choices[0].text

    assert ask(7) == ask(7)
    assert len({ask(s) for s in range(4)}) > 1


def test_logprobs_in_completions_and_chat(client, model_id):
    out = client.completions.create(model=model_id, prompt="Odds", max_tokens=5, temperature=0,
                                    logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 5 and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(top) <= 3 for top in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen == pytest.approx(max(top.values()))
    chat = client.chat.completions.create(model=model_id, max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "hi"}],
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)


def test_stop_string_ends_the_text_before_it(client, model_id):
    free = client.completions.create(model=model_id, prompt="Stop here", max_tokens=24,
                                     temperature=0).choices[0].text
    stop = free[len(free) // 2: len(free) // 2 + 2]
    assert stop.strip(), f"the model's text {free!r} gives no usable stop string"
    out = client.completions.create(model=model_id, prompt="Stop here", max_tokens=24,
                                    temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == free[: free.index(stop)]


def test_stop_token_ids_end_the_stream(client, model_id):
    every_token = list(range(300))  # the generated checkpoints' vocabulary
    out = client.completions.create(model=model_id, prompt=[1, 2, 3], max_tokens=8,
                                    temperature=0, extra_body={"stop_token_ids": every_token})
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == 1 and out.choices[0].text == ""


BAD_REQUESTS = {
    "unknown model": dict(model="no-such-model", prompt="x"),
    "missing prompt": dict(prompt=None),
    "prompt longer than the context": dict(prompt=list(range(10)) * 30),
    "max_tokens past the context": dict(prompt="hello", max_tokens=10_000),
    "token id outside the vocabulary": dict(prompt=[1, 2, 100_000]),
    "negative token id": dict(prompt=[1, -2]),
    "temperature out of range": dict(prompt="x", temperature=5),
    "temperature of the wrong type": dict(prompt="x", extra_body={"temperature": "hot"}),
    "n above one": dict(prompt="x", n=2),
    "max_tokens zero": dict(prompt="x", max_tokens=0),
    "empty prompt": dict(prompt=""),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_completion_requests_get_400(client, model_id, case):
    kwargs = dict(model=model_id, max_tokens=4) | BAD_REQUESTS[case]
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(**kwargs)
    assert raised.value.status_code == 400
    assert raised.value.body["message"]


def test_bad_chat_requests_get_400(client, model_id):
    for messages in ([], [{"content": "no role"}], [{"role": "user", "content": 5}]):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=model_id, messages=messages, max_tokens=2)


def test_the_server_stays_up_after_bad_input(client, model_id, engine):
    status, text = http("POST", f"{engine.url}/completions", b"{not json")
    assert status == 400 and "error" in json.loads(text)
    assert client.completions.create(model=model_id, prompt="still", max_tokens=2).choices


def test_health_and_metrics(engine, client, model_id):
    base = engine.url.removesuffix("/v1")
    assert json.loads(http("GET", f"{base}/health")[1])["status"] == "ok"
    client.completions.create(model=model_id, prompt="count me", max_tokens=3)
    metrics = http("GET", f"{base}/metrics")[1]
    for name in ("ringfleet_requests_total", "ringfleet_generated_tokens_total",
                 "ringfleet_time_to_first_token_seconds_bucket",
                 "ringfleet_inter_token_latency_seconds_bucket", "ringfleet_slots_in_use"):
        assert name in metrics

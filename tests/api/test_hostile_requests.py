"""Valid-looking requests that used to kill the ring: each is refused with a 400 naming its
field, or (tiny temperatures) served greedily, while a bystander's stream carries on.
A real fleet-engine process over a generated checkpoint, real HTTP."""

from __future__ import annotations

import json

import pytest

from tests.api.conftest import http

CHAT = '"messages": [{"role": "user", "content": "hi"}]'
PROMPT = '"prompt": "the cat"'

# (raw JSON fields after "model", the field the 400 must name). Raw text, because Python's
# json writes neither lone surrogates nor NaN the way a hostile client can.
BAD = {
    "NaN temperature": (f'{PROMPT}, "temperature": NaN', "temperature"),
    "infinite temperature": (f'{PROMPT}, "temperature": Infinity', "temperature"),
    "float overflowing to inf": (f'{PROMPT}, "top_p": 1e400', "top_p"),
    "negative temperature": (f'{PROMPT}, "temperature": -0.5', "temperature"),
    "negative seed": (f'{PROMPT}, "seed": -1', "seed"),
    "seed beyond 64 bits": (f'{PROMPT}, "seed": {2**64}', "seed"),
    "max_tokens beyond 64 bits": (f'{PROMPT}, "max_tokens": {10**30}', "max_tokens"),
    "a huge integer anywhere": (f'{PROMPT}, "user": {{"x": [{-2**70}]}}', "user.x[0]"),
    "absurd logprobs": (f'{PROMPT}, "logprobs": 1000', "logprobs"),
    "absurd top_logprobs": (f'{CHAT}, "logprobs": true, "top_logprobs": 99', "top_logprobs"),
    "top_logprobs without logprobs": (f'{CHAT}, "top_logprobs": 2', "top_logprobs"),
    "n of two": (f'{PROMPT}, "n": 2', "n"),
    "fractional top_k": (f'{PROMPT}, "top_k": 2.5', "top_k"),
    "lone surrogate in a prompt": (r'"prompt": "a\ud800b"', "prompt"),
    "lone surrogate in a message": (
        r'"messages": [{"role": "user", "content": "x\udfff"}]', "messages[0].content"),
    "lone surrogate in a key": (rf'{PROMPT}, "user": {{"\ud800": 1}}', r"user.\ud800"),
    "non-string text part": (
        '"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]',
        "messages[0].content[0].text"),
    "image part": ('"messages": [{"role": "user", "content": [{"type": "image_url"}]}]',
                   "messages[0].content[0]"),
    "token id outside the vocabulary": ('"prompt": [1, 2, 300]', "prompt"),
    "boolean token id": ('"prompt": [1, true]', "prompt"),
    "stop token id outside the vocabulary": (f'{PROMPT}, "stop_token_ids": [7, 9999]',
                                             "stop_token_ids"),
    "non-numeric logit_bias": (f'{PROMPT}, "logit_bias": {{"5": "high"}}', "logit_bias"),
    "logit_bias out of range": (f'{PROMPT}, "logit_bias": {{"5": 500}}', "logit_bias"),
    "logit_bias outside the vocabulary": (f'{PROMPT}, "logit_bias": {{"9999": 1}}',
                                          "logit_bias"),
    "logit_bias key not a token id": (f'{PROMPT}, "logit_bias": {{"cat": 1}}', "logit_bias"),
    "too many stops": (f'{PROMPT}, "stop": ["a", "b", "c", "d", "e"]', "stop"),
    "a stop too long": (f'{PROMPT}, "stop": "{"x" * 1000}"', "stop"),
    "presence_penalty": (f'{PROMPT}, "presence_penalty": 0.5', "presence_penalty"),
    "frequency_penalty": (f'{CHAT}, "frequency_penalty": 1', "frequency_penalty"),
    "tools": (f'{CHAT}, "tools": [{{"type": "function"}}]', "tools"),
    "non-boolean include_usage": ((f'{PROMPT}, "stream": true, "stream_options": '
                                  '{"include_usage": "yes"}'), "include_usage"),
}


def post(engine, fields: str) -> tuple[int, dict]:
    path = "chat/completions" if '"messages"' in fields else "completions"
    body = f'{{"model": "{engine_model(engine)}", "max_tokens": 4, {fields}}}'
    status, text = http("POST", f"{engine.url}/{path}", body.encode("utf-8", "surrogatepass"))
    return status, json.loads(text)


def engine_model(engine) -> str:
    return json.loads(http("GET", f"{engine.url}/models")[1])["data"][0]["id"]


@pytest.mark.parametrize("case", sorted(BAD))
def test_each_bad_parameter_gets_a_400_naming_its_field(engine, case):
    fields, param = BAD[case]
    status, body = post(engine, fields)
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == param
    assert param.split(".")[-1].split("[")[0] in body["error"]["message"]


@pytest.mark.parametrize("raw", [b'{"model": "m", "prompt": "x", "user": ' + b"9" * 5000 + b"}",
                                 b"[" * 100_000 + b"]" * 100_000,
                                 b'{"model": "m", "prompt": ' + b"[" * 40 + b"]" * 40 + b"}"])
def test_bodies_no_parser_should_meet_get_a_400(engine, raw):
    status, body = http("POST", f"{engine.url}/completions", raw)
    assert status == 400 and body and json.loads(body)["error"]["message"]


def test_a_subnormal_temperature_is_greedy_and_a_bystander_stream_finishes(engine, client,
                                                                         model_id):
    bystander = client.completions.create(model=model_id, prompt="a long one", max_tokens=60,
                                          temperature=0.8, seed=3, stream=True,
                                          extra_body={"ignore_eos": True})
    chunks = iter(bystander)
    first = next(chunks)  # the bystander holds a slot and is generating
    greedy = [post(engine, f'{CHAT}, "temperature": 0, "max_tokens": 8'),
              post(engine, f'{PROMPT}, "temperature": 0, "max_tokens": 8')]
    for temperature in ("1e-310", "5e-324", "1e-6"):
        poisons = [post(engine, f'{CHAT}, "temperature": {temperature}, "max_tokens": 8'),
                   post(engine, f'{PROMPT}, "temperature": {temperature}, "max_tokens": 8')]
        for (status, body), (_, reference) in zip(poisons, greedy, strict=True):
            assert status == 200, body
            assert body["choices"][0] | {"logprobs": None} == reference["choices"][0] | {
                "logprobs": None}
    rest = [first, *chunks]
    assert rest[-1].choices[0].finish_reason == "length"
    assert sum(1 for c in rest if c.choices and c.choices[0].text) > 1
    assert json.loads(http("GET", f"{engine.url.removesuffix('/v1')}/health")[1])["status"] == "ok"
    assert engine.processes[0].poll() is None


def test_logit_bias_is_applied(engine, client, model_id):
    from engine.lanes.text import TextCodec

    token_text = TextCodec(engine.model_dir).token_text
    plain = client.completions.create(model=model_id, prompt=[5, 6, 7], max_tokens=4,
                                      temperature=0, extra_body={"ignore_eos": True})
    for token in (42, 77):
        forced = client.completions.create(model=model_id, prompt=[5, 6, 7], max_tokens=4,
                                           temperature=0.5, seed=1, logit_bias={str(token): 100},
                                           extra_body={"ignore_eos": True})
        assert forced.choices[0].text == token_text(token) * 4
    assert plain.choices[0].text != token_text(42) * 4


def test_the_largest_seed_is_accepted(engine):
    status, body = post(engine, f'{PROMPT}, "seed": {2**64 - 1}, "temperature": 1')
    assert status == 200, body

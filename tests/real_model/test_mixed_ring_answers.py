"""A real model through a torch-cpu + mlx-cpu ring answers as transformers does, through the
official `openai` client.

The ring is float32 end to end, but PyTorch and MLX sum in their own orders, so it is not
bit-exact with transformers (docs/exactness.md): the greedy text must be equal, and each
chosen token's log-probability and the top alternatives' within LOGPROB_TOLERANCE.
"""

from __future__ import annotations

import math

import pytest
from openai import OpenAI

MAX_TOKENS = 24  # the short answers end before it; the last prompt runs into it
TOP_LOGPROBS = 3
# Thirty float32 layers in two orders of summation move logits by ~1e-5 relative (measured
# on these prompts: at most a few 1e-5 in a log-probability); 1e-3 leaves room for another
# CPU's kernels while still catching a wrong layer, norm or rope (those move them by > 0.1).
LOGPROB_TOLERANCE = 1e-3

PROMPTS = {
    "capital": [{"role": "user", "content": "What is the capital of France?"}],
    "colors": [{"role": "user", "content": "Name three primary colors."}],
    "arithmetic": [{"role": "user", "content": "What is 2 + 2?"}],
    "own-system-turn": [{"role": "system", "content": "You are a terse geography teacher."},
                        {"role": "user", "content": "Which river flows through Paris?"}],
}


def transformers_greedy(reference, messages) -> tuple[str, list[int], list[dict[int, float]]]:
    """transformers' greedy text, its token ids, and every step's log-probabilities."""
    import torch

    model, tokenizer = reference
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False,
                             return_dict_in_generate=True, output_logits=True)
    new_ids = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    steps = [torch.log_softmax(logits[0].float(), dim=-1) for logits in out.logits]
    return tokenizer.decode(new_ids, skip_special_tokens=True), new_ids, steps


@pytest.fixture(scope="module")
def client(mixed_ring) -> OpenAI:
    return OpenAI(base_url=mixed_ring.url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model_id(client) -> str:
    return client.models.list().data[0].id


@pytest.mark.parametrize("name", list(PROMPTS))
def test_chat_answer_equals_transformers_greedy(client, model_id, reference, name):
    messages = PROMPTS[name]
    reply = client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        logprobs=True, top_logprobs=TOP_LOGPROBS)
    text, ids, steps = transformers_greedy(reference, messages)
    choice = reply.choices[0]
    assert choice.message.content == text
    if name == "capital":
        assert "Paris" in text
    # transformers stops at the end-of-turn token and returns it; the API does not.
    stopped = ids[-1] == reference[1].convert_tokens_to_ids("<|im_end|>")
    assert choice.finish_reason == ("stop" if stopped else "length")
    assert reply.usage.completion_tokens == len(ids)

    _, tokenizer = reference
    worst = 0.0
    for position, (served, step) in enumerate(zip(choice.logprobs.content, steps, strict=False)):
        assert served.token == tokenizer.decode([ids[position]]), position
        worst = max(worst, abs(served.logprob - step[ids[position]].item()))
        top = step.topk(TOP_LOGPROBS)
        theirs = [(tokenizer.decode([i]), v) for v, i in zip(top.values.tolist(),
                                                             top.indices.tolist(), strict=True)]
        ours = [(alt.token, alt.logprob) for alt in served.top_logprobs]
        assert [t for t, _ in ours] == [t for t, _ in theirs], position
        worst = max(worst, *(abs(a - b) for (_, a), (_, b) in zip(ours, theirs, strict=True)))
    print(f"{name}: {len(ids)} tokens, largest log-probability difference {worst:.2e}")
    assert worst <= LOGPROB_TOLERANCE
    assert math.isfinite(worst)

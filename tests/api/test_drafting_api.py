"""Speculative rounds through the API: a two-stage ring with prompt lookup on (a mixed
torch + MLX one) answers the official client as a ring without it does, and says what
was drafted: `usage.completion_tokens_details` (the fields OpenAI gives predicted
outputs) and rank 0's /metrics."""

from __future__ import annotations

import re
import urllib.request

import numpy as np
from openai import OpenAI

from engine.harness.launch import launch

CONTEXT, CHUNK, TOKENS = 256, 16, 40


def prompt() -> list[int]:
    rng = np.random.default_rng(11)
    stretch = rng.integers(0, 300, 12).tolist()
    return [*rng.integers(0, 300, 5).tolist(), *stretch, *stretch, *stretch[:3]]


def completions(fleet) -> tuple[object, list, str]:
    """A completion, its stream (with usage), and rank 0's /metrics."""
    client = OpenAI(base_url=fleet.url, api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    whole = client.completions.create(model=model, prompt=prompt(), max_tokens=TOKENS,
                                      temperature=0, logprobs=2)
    chunks = list(client.completions.create(model=model, prompt=prompt(), max_tokens=TOKENS,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    with urllib.request.urlopen(fleet.url.removesuffix("/v1") + "/metrics",
                                timeout=30) as reply:
        metrics = reply.read().decode()
    return whole, chunks, metrics


def plain_and_drafted(model_dir, stages, drafter: str, draft_tokens: int, tmp_path):
    """`completions` of a torch + MLX ring without a drafter, then with `drafter`."""
    runs = []
    for name in ("off", drafter):
        with launch(model_dir, stages, ["torch-cpu", "mlx-cpu"], context=CONTEXT, parallel=2,
                    chunk=CHUNK, run_dir=tmp_path / name,
                    extra_env={"FLEET_DRAFTER": name,
                               "FLEET_DRAFT_TOKENS": str(draft_tokens)}) as fleet:
            fleet.wait_ready()
            runs.append(completions(fleet))
    return runs


def counter(metrics: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", metrics, re.MULTILINE)
    assert found, f"{name} not in /metrics"
    return float(found[1])


def test_a_drafting_ring_answers_as_a_plain_one_and_counts_its_drafts(make_model, tmp_path):
    model_dir = make_model("llama", seed=8)
    (plain, _, plain_metrics), (drafted, chunks, metrics) = plain_and_drafted(
        model_dir, [(0, 1), (1, 3)], "ngram", 7, tmp_path)
    assert drafted.choices[0].text == plain.choices[0].text
    assert drafted.choices[0].logprobs.tokens == plain.choices[0].logprobs.tokens
    np.testing.assert_allclose(drafted.choices[0].logprobs.token_logprobs,
                               plain.choices[0].logprobs.token_logprobs, atol=1e-4)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    details = drafted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens > 0
    assert drafted.usage.completion_tokens == plain.usage.completion_tokens == TOKENS
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    assert plain.usage.completion_tokens_details.rejected_prediction_tokens == 0
    streamed = chunks[-1].usage.completion_tokens_details
    assert streamed.accepted_prediction_tokens == details.accepted_prediction_tokens
    # Both requests' drafts, counted where the lane host drafted them.
    accepted = counter(metrics, "ringfleet_accepted_tokens_total")
    drafted_total = counter(metrics, "ringfleet_drafted_tokens_total")
    assert accepted == 2 * details.accepted_prediction_tokens
    assert drafted_total == 2 * (details.accepted_prediction_tokens
                                 + details.rejected_prediction_tokens)
    assert counter(plain_metrics, "ringfleet_drafted_tokens_total") == 0


def test_a_ring_drafting_with_the_mtp_head_answers_as_a_plain_one(make_model, tmp_path):
    """`drafter: mtp` through real engine processes: rank 0 (torch) loads the checkpoint's
    MTP head, an MLX follower does not, and the reply is the plain ring's. On random
    weights its drafts are refused but for chance, so only that it drafted is checked."""
    model_dir = make_model("qwen3_5", mtp=True, seed=12)
    (plain, _, _), (drafted, chunks, metrics) = plain_and_drafted(
        model_dir, [(0, 2), (2, 4)], "mtp", 3, tmp_path)
    assert drafted.choices[0].text == plain.choices[0].text
    assert drafted.choices[0].logprobs.tokens == plain.choices[0].logprobs.tokens
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    details = drafted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0
    assert counter(metrics, "ringfleet_drafted_tokens_total") > 0

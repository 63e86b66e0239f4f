"""The PyTorch backend against transformers on generated checkpoints of every family."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from tests.engine.conftest import stage_driver, whole_stage

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
PROMPT_LENGTHS = (5, 23, 14)  # mistral's window of 9 is crossed by two of them


def reference(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 300, n).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_at_every_position(make_model, family, tie, shards):
    model_dir = make_model(family, tie=tie, shards=shards)
    ref = reference(model_dir)
    driver = stage_driver(whole_stage(model_dir))
    batch = prompts(1)
    expected = []
    with torch.no_grad():
        for ids in batch:
            expected.append(ref(torch.tensor([ids])).logits[0].numpy())
    # One row per stream per round, every stream in the same round: every position checked.
    for pos in range(max(PROMPT_LENGTHS)):
        feeds = {slot: [ids[pos]] for slot, ids in enumerate(batch) if pos < len(ids)}
        got = driver.round(feeds)
        for slot, logits in got.items():
            np.testing.assert_allclose(logits, expected[slot][pos], atol=1e-4, rtol=0)
    # Whole prompts as chunks in one round: the last position of each.
    driver.close(list(range(len(batch))))
    got = driver.round(dict(enumerate(batch)))
    for slot, ids in enumerate(batch):
        np.testing.assert_allclose(got[slot], expected[slot][-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_transformers(make_model, family):
    model_dir = make_model(family)
    ref = reference(model_dir)
    prompt = prompts(2)[1]
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                           min_new_tokens=64, pad_token_id=0)
    expected = out[0, len(prompt):].tolist()
    driver = stage_driver(whole_stage(model_dir))
    got = []
    logits = driver.round({0: prompt})[0]
    for _ in range(64):
        got.append(int(np.argmax(logits)))
        logits = driver.round({0: [got[-1]]})[0]
    assert got == expected
    assert len(set(got)) > 3, "a degenerate model would make this test meaningless"


def test_batched_round_gives_each_stream_its_own_tokens(make_model):
    model_dir = make_model("qwen3")
    batch = prompts(3)

    together = stage_driver(whole_stage(model_dir)).greedy(dict(enumerate(batch)), 24)
    for slot, ids in enumerate(batch):
        alone = stage_driver(whole_stage(model_dir)).greedy({slot: ids}, 24)
        assert alone[slot] == together[slot]

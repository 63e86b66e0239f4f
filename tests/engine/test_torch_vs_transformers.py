"""The PyTorch backend against transformers on generated checkpoints of every family."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from tests.engine.conftest import stage_driver, whole_stage
from tests.engine.logits_at_every_position import check_logits_at_every_position, prompts

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


def reference(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


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
    check_logits_at_every_position(driver, batch, expected)
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
    # Plain argmax for 64 steps, end token included: the driver does not stop at it, and
    # `min_new_tokens` would instead forbid it, so a model whose argmax is the end token at
    # some step (which depends on the seed, so on test order) would part the two.
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                           pad_token_id=0)
    expected = out[0, len(prompt):].tolist()
    driver = stage_driver(whole_stage(model_dir))
    got = driver.greedy({0: prompt}, 64)[0]
    assert got == expected
    assert len(set(got)) > 3, "a degenerate model would make this test meaningless"


def test_batched_round_gives_each_stream_its_own_tokens(make_model):
    model_dir = make_model("qwen3")
    batch = prompts(3)

    together = stage_driver(whole_stage(model_dir)).greedy(dict(enumerate(batch)), 24)
    for slot, ids in enumerate(batch):
        alone = stage_driver(whole_stage(model_dir)).greedy({slot: ids}, 24)
        assert alone[slot] == together[slot]

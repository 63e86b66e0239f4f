"""The anchor (bench/anchor.py) computes our model: its logits against our stage's.

The anchor is written gpt-fast's way, not ours (one module, fused q/k/v, a static cache
under a causal-mask row), so agreement in float32 on the same random checkpoint says both
compute the model, and that the anchor's decode figures time the same work.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.anchor import AnchorError, decode_one_token, load_anchor, time_anchor
from tests.engine.conftest import stage_driver, whole_stage

PROMPTS = [[5, 17, 9, 250, 3, 77, 41], [8, 8, 120, 64, 1, 2, 3]]
STEPS = 5


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_anchor_logits_match_our_stage(make_model, family):
    model_dir = make_model(family, seed=31)
    cpu = torch.device("cpu")
    anchor = load_anchor(model_dir, len(PROMPTS), 32, torch.float32, cpu)
    driver = stage_driver(whole_stage(model_dir))
    ours = driver.round(dict(enumerate(PROMPTS)))
    with torch.no_grad():
        theirs = anchor(torch.tensor(PROMPTS), torch.arange(len(PROMPTS[0])))[:, -1]
    tokens = [[int(np.argmax(ours[s]))] for s in range(len(PROMPTS))]
    for step in range(STEPS):
        np.testing.assert_allclose(theirs.numpy(), np.stack([ours[0], ours[1]]),
                                   rtol=1e-4, atol=1e-4)
        assert theirs.argmax(-1).tolist() == [t[0] for t in tokens]
        position = torch.tensor([len(PROMPTS[0]) + step])
        with torch.no_grad():
            theirs = anchor(torch.tensor(tokens), position)[:, -1]
            assert decode_one_token(anchor, torch.tensor(tokens), position)[:, 0].tolist() \
                == theirs.argmax(-1).tolist()
        ours = driver.round(dict(enumerate(tokens)))
        tokens = [[int(np.argmax(ours[s]))] for s in range(len(PROMPTS))]


def test_anchor_times_its_eager_step_on_the_cpu(make_model):
    timing = time_anchor(make_model("llama", seed=31), torch.device("cpu"), torch.float32,
                         batch=2, prompt=4, steps=3, repeats=1, compile=False)
    assert timing.ms_per_step > 0 and timing.cold_start_s > 0


def test_anchor_refuses_a_hybrid(make_model):
    with pytest.raises(AnchorError, match="Llama-style dense"):
        load_anchor(make_model("qwen3_5"), 1, 8, torch.float32, torch.device("cpu"))

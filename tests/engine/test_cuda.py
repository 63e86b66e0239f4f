"""The PyTorch backend on CUDA against transformers on CUDA (skipped without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from engine.backends.base import StageSpec, load_stage
from tests.engine.conftest import stage_driver

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_cuda_logits_match_transformers_on_cuda(make_model, family):
    model_dir = make_model(family)
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = ref.to("cuda").eval()
    stage = load_stage(StageSpec(model_dir, (0, 3), "torch-cuda", 2, 128, 64))
    driver = stage_driver(stage)
    ids = np.random.default_rng(0).integers(0, 300, 40).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy()
    for pos, token in enumerate(ids):
        got = driver.round({0: [token]})[0]
        # Both sides run cuBLAS and SDPA kernels of their own choosing on the GPU.
        np.testing.assert_allclose(got, expected[pos], atol=1e-3, rtol=0)


def test_cuda_graph_decode_matches_eager_decode(make_model):
    """Decode rounds replayed as graphs (whole-context masked attention) against eager ones
    (attention over the positions so far): the same tokens, logits within float32 noise."""
    model_dir = make_model("qwen3", num_hidden_layers=3)
    prompts = {s: np.random.default_rng(s).integers(0, 300, 9 + s).tolist() for s in range(3)}

    def run(cuda_graphs: bool):
        stage = load_stage(StageSpec(model_dir, (0, 3), "torch-cuda", 4, 128, 64, cuda_graphs))
        driver = stage_driver(stage)
        tokens = driver.greedy(prompts, 24)
        logits = driver.round({s: [t[-1]] for s, t in tokens.items()})
        return tokens, logits, stage

    graph_tokens, graph_logits, stage = run(True)
    eager_tokens, eager_logits, _ = run(False)
    assert stage.graphs.captured  # the decode rounds did replay graphs
    assert graph_tokens == eager_tokens
    for slot in graph_logits:
        np.testing.assert_allclose(graph_logits[slot], eager_logits[slot], atol=1e-4, rtol=0)

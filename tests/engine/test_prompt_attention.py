"""A prompt chunk's attention as two parts merged (engine.backends.pytorch.prompt_attention).

On any machine, the split and merge (keys before the chunk, the chunk's own square, and
grouped heads) against SDPA under the lower-right causal mask, with each part computed by a
float32 softmax that returns its log-sum-exp. On CUDA (skipped without one) the same with
cuDNN's kernels, and a whole stage's prompt under FLEET_PROMPT_ATTENTION=cudnn against
flash.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.backends.pytorch.prompt_attention import chunk_attention

# (rows in the chunk, keys it sees, heads, kv heads, head dim)
CASES = [(5, 5, 4, 4, 16), (5, 12, 4, 2, 16), (1, 9, 8, 2, 32), (7, 40, 6, 1, 256),
         (64, 64, 4, 1, 64), (33, 100, 4, 2, 128)]


def float_attend(q, k, v, causal):
    """Softmax attention in float32 with top-left causality, and its log-sum-exp."""
    scores = q.float() @ k.float().transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        n, keys = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(n, keys, dtype=torch.bool).triu(1), -torch.inf)
    return (scores.softmax(-1) @ v.float()).to(q.dtype), torch.logsumexp(scores, -1)


def lower_right(q, k, v):
    n, keys = q.shape[2], k.shape[2]
    visible = torch.ones(n, keys, dtype=torch.bool, device=q.device).tril(keys - n)
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=visible,
                                          enable_gqa=True)


def chunk(case, device="cpu", dtype=torch.float32, seed=0):
    n, keys, heads, kv_heads, head_dim = case
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, rows, head_dim, generator=generator).to(device, dtype)
               for h, rows in ((heads, n), (kv_heads, keys), (kv_heads, keys)))
    return q, k, v


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_two_parts_merge_into_lower_right_causal_attention(case):
    q, k, v = chunk(case)
    merged = chunk_attention(q, k, v, float_attend)
    assert merged.shape == q.shape and merged.dtype == q.dtype
    torch.testing.assert_close(merged, lower_right(q, k, v), atol=2e-6, rtol=2e-5)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@cuda
@pytest.mark.parametrize("case", CASES, ids=str)
def test_cudnn_parts_merge_into_lower_right_causal_attention(case):
    q, k, v = chunk(case, "cuda", torch.bfloat16)
    merged = chunk_attention(q, k, v)
    assert merged.dtype == torch.bfloat16
    torch.testing.assert_close(merged.float(), lower_right(q, k, v), atol=2e-2, rtol=2e-2)


@cuda
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_cuda_stage_prompts_alike_through_cudnn_and_flash(make_model, monkeypatch, family):
    from engine.backends.base import StageSpec, load_stage
    from engine.harness.driver import RoundDriver
    from engine.pipeline.runner import LocalRunner

    model_dir = make_model(family, dtype="bfloat16", seed=4)
    prompt = [int(t) for t in torch.randint(1, 200, (300,), generator=torch.Generator()
                                           .manual_seed(1))]
    logits = {}
    for kernel in ("flash", "cudnn"):
        monkeypatch.setenv("FLEET_PROMPT_ATTENTION", kernel)
        stage = load_stage(StageSpec(model_dir, (0, stage_layers(model_dir)), "torch-cuda", 1,
                                     512, 64))
        driver = RoundDriver(LocalRunner(stage))
        for start in range(0, len(prompt), 64):  # chunks after a prefix, the last of 44
            logits[kernel] = driver.round({0: prompt[start:start + 64]})[0]
    cudnn, flash = (torch.as_tensor(logits[k]).float() for k in ("cudnn", "flash"))
    # bfloat16 kernels that sum in other orders: a tenth of the logits' spread at most, where
    # a wrong mask or merge moves them by the whole of it.
    assert (cudnn - flash).abs().max() <= 0.1 * flash.std()


def stage_layers(model_dir) -> int:
    import json

    return json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]

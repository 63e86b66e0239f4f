"""The Triton decode kernel on CUDA (skipped without a GPU): the kernel against a float32
softmax (decode_attention_cases.py), the MTP head's draft steps by it against its gathered
attention (mtp_head_kernel_case.py), and whole stages decoding with it against the same
stages under SDPA's mask (FLEET_DECODE_ATTENTION=sdpa), eager and in captured graphs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.backends.base import StageSpec, load_stage
from engine.backends.pytorch.kv_cache import decode_index, decode_kernel_runs
from tests.engine import mtp_head_kernel_case
from tests.engine.conftest import stage_driver
from tests.engine.decode_attention_cases import CUDA_CASES, check

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("case", CUDA_CASES, ids=str)
def test_the_kernel_is_softmax_attention(case):
    check(case, "cuda")


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_the_mtp_heads_draft_step_by_the_kernel_is_its_gathered_attention(dtype, atol):
    mtp_head_kernel_case.check("cuda", dtype, atol)


def test_a_cuda_decode_index_carries_lengths_not_a_mask(monkeypatch):
    positions = torch.tensor([7, 300], device="cuda")
    monkeypatch.setenv("FLEET_DECODE_ATTENTION", "triton")
    assert decode_kernel_runs(torch.device("cuda"))
    index = decode_index(positions, (2, 4), 320, None)
    assert index.single_mask is None and index.single_lengths.tolist() == [8, 301]
    monkeypatch.setenv("FLEET_DECODE_ATTENTION", "sdpa")
    index = decode_index(positions, (2, 4), 320, None)
    assert index.single_lengths is None and index.single_mask.shape == (2, 1, 1, 320)


def conversation(model_dir, cuda_graphs: bool, feeds: list[dict[int, list[int]]] | None = None):
    """Slots 0, 1 and 3 decode together (not consecutive: eager rounds) and slots 0 and 1
    alone (consecutive: graphs where the stage has them), 48 rounds after their prompts.
    Without `feeds`, greedy, returning the feeds it made; with them, teacher-forced."""
    stage = load_stage(StageSpec(model_dir, (0, stage_layers(model_dir)), "torch-cuda", 4, 512,
                                 64, cuda_graphs))
    driver = stage_driver(stage)
    made = [{s: np.random.default_rng(s).integers(0, 300, 5 + 7 * s).tolist()
             for s in (0, 1, 3)}]
    rows, tokens = [], {}
    for r in range(49):
        logits = driver.round(feeds[r] if feeds else made[-1])
        rows.extend(logits[s] for s in sorted(logits))
        tokens.update({s: int(np.argmax(row)) for s, row in logits.items()})
        made.append({s: [tokens[s]] for s in ((0, 1, 3) if r % 2 else (0, 1))})
    return np.stack(rows), made, stage


def stage_layers(model_dir) -> int:
    from engine.harness.local_pipeline import model_config

    return model_config(model_dir).num_hidden_layers


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize(("family", "dtype", "tolerance"), [
    ("qwen3", "float32", 1e-4),  # head_dim 18, 4 query heads on one key head
    ("qwen3_5", "float32", 1e-4),  # the hybrid's attention layers go through KVCache.attend
    # bfloat16: both round the softmax weights to bfloat16 before multiplying the values,
    # in different orders, and the KV caches drift apart by that rounding over the rounds.
    ("llama", "bfloat16", 0.125),  # GQA 3:1, head_dim 10
    ("mistral", "bfloat16", 0.125),  # a sliding window of 9
    ("qwen3_5", "bfloat16", 0.125),
])
def test_a_stage_decodes_with_the_kernel_as_with_sdpa(make_model, monkeypatch, family, dtype,
                                                       tolerance, cuda_graphs):
    model_dir = make_model(family, dtype=dtype, seed=61)
    monkeypatch.setenv("FLEET_DECODE_ATTENTION", "sdpa")
    want, feeds, _ = conversation(model_dir, cuda_graphs)
    monkeypatch.setenv("FLEET_DECODE_ATTENTION", "triton")
    got, _, stage = conversation(model_dir, cuda_graphs, feeds)
    assert not cuda_graphs or stage.graphs.captured  # the rounds of slots 0 and 1 replayed
    np.testing.assert_allclose(got, want, atol=tolerance, rtol=0)
    # The tokens agree wherever the reference's top two are further apart than the bound.
    top2 = np.sort(want, axis=-1)[:, -2:]
    decided = top2[:, 1] - top2[:, 0] > tolerance
    assert (got.argmax(-1) == want.argmax(-1))[decided].all()

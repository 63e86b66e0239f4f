"""Qwen3.5 hybrid rings with MLX stages: an MLX pipeline gives one MLX process's bits, and
a mixed PyTorch + MLX ring stays within float32 noise of a whole PyTorch process.

Followers are `fleet-engine` processes on loopback; rank 0 runs in the test. The checkpoint's
layers are DeltaNet, attention, DeltaNet, attention, DeltaNet: a cut at 1 follows a DeltaNet
layer (the next stage starts with attention and holds KV only for its own layers), a cut at
2 follows an attention layer (the next stage's first state is a recurrent one).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx.core")

from engine.harness.driver import RoundDriver
from engine.harness.local_pipeline import whole_runner
from tests.pipeline.conftest import greedy_trace, pipeline
from tests.pipeline.test_mixed_rings import FLOAT32, ONE_THREAD, divergence, report

LAYERS = 5
CHUNK = 48  # a 150-token prompt spans four chunks, each starting from the last one's state
STEPS = 16
# Key and value head dims of 16: at 8 a random hybrid is ill-conditioned enough that float32
# noise alone reaches 1e-3 of a logit (tests/engine/test_qwen3_5_mlx_vs_mlx_lm.py says how).
SHAPE = dict(num_hidden_layers=LAYERS, linear_key_head_dim=16, linear_value_head_dim=16)


def prompts(count: int) -> list[list[int]]:
    rng = np.random.default_rng(count)
    return [rng.integers(0, 300, 150 - 11 * i).tolist() for i in range(count)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cut", [1, 2], ids=["after-deltanet", "after-attention"])
def test_mlx_pipeline_logits_equal_one_mlx_process(make_model, tmp_path, cut, dtype):
    model_dir = make_model("qwen3_5", dtype=dtype, **SHAPE)
    whole = whole_runner(model_dir, backend="mlx-cpu", chunk=CHUNK)
    expected = {n: greedy_trace(whole, model_dir, prompts(n), steps=STEPS, chunk=CHUNK)
                for n in (1, 4)}
    with pipeline(model_dir, [(0, cut), (cut, LAYERS)], tmp_path, chunk=CHUNK,
                  backends=["mlx-cpu", "mlx-cpu"]) as runner:
        for n in (1, 4):
            got = greedy_trace(runner, model_dir, prompts(n), steps=STEPS, chunk=CHUNK)
            assert [plan for plan, _ in got] == [plan for plan, _ in expected[n]]
            for (plan, logits), (_, want) in zip(got, expected[n], strict=True):
                assert logits == want, f"round {plan.round_no} differs ({n} streams)"
            assert len(got) >= STEPS + 150 // CHUNK


def teacher_forced(driver: RoundDriver, seqs: list[list[int]], prompt: int) -> np.ndarray:
    """Logits [streams, positions, vocab] from position prompt - 1 on, fed the sequences."""
    streams = range(len(seqs))
    rounds = [driver.round({s: seqs[s][:prompt] for s in streams})]
    for pos in range(prompt, len(seqs[0])):
        rounds.append(driver.round({s: [seqs[s][pos]] for s in streams}))
    driver.close(list(streams))
    return np.stack([np.stack([r[s] for r in rounds]) for s in streams])


@pytest.mark.parametrize(("backends", "cut"), [(("torch-cpu", "mlx-cpu"), 1),
                                               (("mlx-cpu", "torch-cpu"), 2)],
                         ids=["torch>mlx-after-deltanet", "mlx>torch-after-attention"])
def test_mixed_ring_is_deterministic_and_close_to_one_torch_process(make_model, tmp_path,
                                                                    backends, cut):
    model_dir = make_model("qwen3_5", **SHAPE)
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, 300, 72).tolist() for _ in range(2)]
    want = teacher_forced(RoundDriver(whole_runner(model_dir, chunk=CHUNK)), seqs, prompt=24)
    with pipeline(model_dir, [(0, cut), (cut, LAYERS)], tmp_path, chunk=CHUNK,
                  backends=list(backends), extra_env=ONE_THREAD) as runner:
        driver = RoundDriver(runner)
        runs = [teacher_forced(driver, seqs, prompt=24) for _ in range(2)]
    assert runs[0].tobytes() == runs[1].tobytes(), "a placement must give the same bits twice"
    figures = divergence(runs[0], want)
    report(f"qwen3_5 {'>'.join(backends)} cut {cut}", figures)
    kl_mean, kl_max, max_abs, top1 = FLOAT32
    assert figures["kl_mean"] <= kl_mean and figures["kl_max"] <= kl_max
    assert figures["max_abs"] <= max_abs and figures["top1"] >= top1

"""Mixed PyTorch + MLX rings of the Qwen3.5 hybrid, held to a whole-model PyTorch process.

As for the dense families (tests/pipeline/test_mixed_rings.py), a mixed ring promises no
equality with either backend, only closeness: the rows crossing a boundary carry the
residual stream only, and each stage keeps the KV and recurrent state of its own layers.
Teacher-forced (every stream is fed the same tokens whatever it would pick), two streams,
a 32-row opening chunk then one row a round; logits at every position within float32
noise of the reference and the same top-1. Cuts right after a DeltaNet layer and right
after an attention layer.

Bounds, measured on this seed: the two backends differ by a few 1e-6 at most positions
(as float32 summation order does) and by up to ~2e-4 at a rare one: DeltaNet's gated
RMSNorm scales each head's output back to unit size, so where a head's output is small it
multiplies the float32 noise beneath it (torch alone against transformers shows the same
position as its largest difference, 6e-5). Hence a loose bound per position, a tight one
on the median, and the same top-1 everywhere.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.requirements import require

require("mlx.core")

from engine.harness.driver import RoundDriver
from engine.harness.local_pipeline import whole_runner
from tests.pipeline.conftest import pipeline

PROMPT = 32
DECODE = 48
RINGS = {
    "torch>mlx-after-deltanet": ([(0, 1), (1, 5)], ["torch-cpu", "mlx-cpu"]),
    "mlx>torch-after-attention": ([(0, 2), (2, 5)], ["mlx-cpu", "torch-cpu"]),
}


def teacher_forced(driver: RoundDriver) -> dict[int, np.ndarray]:
    """Logits [PROMPT + DECODE - 1 + 1, vocab] per stream, fed fixed random tokens."""
    rng = np.random.default_rng(0)
    tokens = {s: rng.integers(3, 300, PROMPT + DECODE).tolist() for s in range(2)}
    got = driver.round({s: ids[:PROMPT] for s, ids in tokens.items()})
    out = {s: [row] for s, row in got.items()}
    for pos in range(PROMPT, PROMPT + DECODE):
        for s, row in driver.round({s: [ids[pos]] for s, ids in tokens.items()}).items():
            out[s].append(row)
    return {s: np.stack(rows) for s, rows in out.items()}


@pytest.mark.parametrize("ring", list(RINGS))
def test_mixed_ring_follows_the_whole_model(make_model, tmp_path, ring):
    model_dir = make_model("qwen3_5", num_hidden_layers=5, seed=11)
    expected = teacher_forced(RoundDriver(whole_runner(model_dir)))
    stages, backends = RINGS[ring]
    with pipeline(model_dir, stages, tmp_path, backends=backends) as runner:
        got = teacher_forced(RoundDriver(runner))
    for s in expected:
        per_position = np.abs(got[s] - expected[s]).max(-1)
        assert per_position.max() < 1e-3, f"stream {s}: {per_position.max()}"
        assert np.median(per_position) < 2e-5, f"stream {s}: {np.median(per_position)}"
        assert (got[s].argmax(-1) == expected[s].argmax(-1)).all()

"""The exactness contract of a packed PyTorch stage (docs/exactness.md, "Packed on PyTorch").

A torch stage running mlx-lm's 4-bit weights through PyTorch's int4 kernels is not bit-equal
to MLX, nor to its own dense dequantized path (zero = bias + 8 * scale is rounded once, and
the kernel sums in its own order). So, like a mixed ring, it is held to a reference:
mlx-lm's own model of the same quantized checkpoint, teacher-forced (every position sees the
reference sequence), by mean KL and top-1 agreement; and in bfloat16 it must cost no more
than bfloat16 itself does, i.e. stay within a factor of the dense dequantized path's figures
against the same reference. Per placement it is deterministic: two loads, byte-identical.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.requirements import require

mx = require("mlx.core")
from mlx import nn
from mlx_lm.models import qwen3_5 as mlx_lm_qwen3_5
from mlx_lm.utils import load as mlx_lm_load

from engine.backends.base import StageSpec, load_stage
from engine.checkpoint.quantize import quantize_checkpoint
from tests.engine.conftest import stage_driver

PROMPT = 16  # rows of the opening chunk; then one decode row a round
LENGTH = 64
GROUP = 32
# Each family at a shape whose projections pack at group 32 (k and v of qwen3 are 18 rows:
# padded for the kernel); seeds fixed so the figures do not hang on test order.
SHAPES = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, seed=21),
    "qwen3": dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=18, seed=22),
    # Three DeltaNet layers, then attention (mlx-lm reads full_attention_interval, not
    # layer_types); head dims of 16, as 8 is ill-conditioned (test_qwen3_5_mlx_vs_mlx_lm).
    "qwen3_5": dict(intermediate_size=64, full_attention_interval=4, linear_key_head_dim=16,
                    linear_value_head_dim=16, seed=23),
}
# bfloat16 bounds per family: mean KL and least top-1 agreement against mlx-lm, and how much
# worse than the dense dequantized path (the same bfloat16 weights and rounding, without
# the int4 kernel) packed may be. Random tiny models have flat distributions whose top two
# logits often sit within a bfloat16 step, so top-1 moves by whole positions (one is 2 %
# of 49) where KL barely does. The hybrid drifts further from mlx-lm in bfloat16 whichever
# way its weights are held (its recurrent state compounds each step's rounding).
# Measured (4-bit): llama / qwen3 KL 6e-4 to 8e-4, top-1 90-96 %; qwen3_5 KL 6.7e-3
# (dense 4.6e-3), top-1 90 %; packed / dense KL 1.0 to 1.5.
BF16_BOUNDS = {"llama": (5e-3, 0.85), "qwen3": (5e-3, 0.85), "qwen3_5": (2e-2, 0.85)}
BF16_FACTOR = 3.0


def reference_model(model_dir: Path):
    """mlx-lm's model of the quantized checkpoint, its packed layers as mlx-lm builds them."""
    config = json.loads((model_dir / "config.json").read_text())
    if not config["model_type"].startswith("qwen3_5"):  # mlx-lm maps no qwen3_5_text
        return mlx_lm_load(str(model_dir))[0]
    model = mlx_lm_qwen3_5.Model(mlx_lm_qwen3_5.ModelArgs.from_dict(config))
    weights = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        weights.update(mx.load(str(path)))
    weights = model.sanitize(weights)
    quant = config["quantization"]
    nn.quantize(model, group_size=quant["group_size"], bits=quant["bits"],
                class_predicate=lambda path, _module: f"{path}.scales" in weights)
    model.load_weights(list(weights.items()))
    return model


def reference_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    """[positions PROMPT - 1 ..., vocab]: mlx-lm over the whole sequence (teacher-forced)."""
    logits = reference_model(model_dir)(mx.array([ids]))[0].astype(mx.float32)
    return np.array(logits)[PROMPT - 1:]


def stage_logits(model_dir: Path, ids: list[int], quant: str) -> np.ndarray:
    """The torch stage's logits at the same positions: one chunk, then a row a round."""
    layers = json.loads((model_dir / "config.json").read_text())
    n_layers = layers.get("num_hidden_layers") or layers["text_config"]["num_hidden_layers"]
    stage = load_stage(StageSpec(model_dir, (0, n_layers), "torch-cpu", 2, 128, PROMPT,
                                 quant=quant))
    if quant != "dense":
        assert type(stage.model.layers[0].down).__name__ == "PackedWeight"
    driver = stage_driver(stage)
    rows = [driver.round({0: ids[:PROMPT]})[0]]
    rows += [driver.round({0: [t]})[0] for t in ids[PROMPT:]]
    return np.stack(rows)


def figures(got: np.ndarray, want: np.ndarray) -> dict[str, float]:
    p = torch.log_softmax(torch.from_numpy(want).double(), -1)
    q = torch.log_softmax(torch.from_numpy(got).double(), -1)
    kl = (p.exp() * (p - q)).sum(-1)
    return {"kl_mean": kl.mean().item(), "max_abs": float(np.abs(got - want).max()),
            "top1": float((got.argmax(-1) == want.argmax(-1)).mean())}


@pytest.fixture(scope="module")
def checkpoint(make_model, tmp_path_factory):
    def make(family: str, dtype: str, bits: int = 4) -> Path:
        source = make_model(family, dtype=dtype, **SHAPES[family])
        return quantize_checkpoint(source, tmp_path_factory.mktemp(f"{family}-{bits}") / "q",
                                   bits, GROUP)
    return make


@pytest.mark.parametrize("family", list(SHAPES))
def test_packed_bfloat16_is_held_to_mlx_lm_deterministic_and_no_worse_than_dense(checkpoint, family):
    model_dir = checkpoint(family, "bfloat16")
    ids = np.random.default_rng(len(family)).integers(0, 300, LENGTH).tolist()
    want = reference_logits(model_dir, ids)
    packed_logits = stage_logits(model_dir, ids, "auto")  # bfloat16 runs packed
    # Determinism per placement: a second load gives the same bytes.
    assert stage_logits(model_dir, ids, "auto").tobytes() == packed_logits.tobytes()
    dense_logits = stage_logits(model_dir, ids, "dense")
    assert dense_logits.tobytes() != packed_logits.tobytes()  # not the same path
    packed, dense = figures(packed_logits, want), figures(dense_logits, want)
    print(f"\n{family} 4-bit bfloat16 vs mlx-lm: packed KL {packed['kl_mean']:.2e} top-1 "
          f"{100 * packed['top1']:.1f} %; dense KL {dense['kl_mean']:.2e} top-1 "
          f"{100 * dense['top1']:.1f} %")
    kl_bound, top1_bound = BF16_BOUNDS[family]
    assert packed["kl_mean"] <= kl_bound and packed["top1"] >= top1_bound, packed
    assert packed["kl_mean"] <= BF16_FACTOR * dense["kl_mean"], (packed, dense)


@pytest.mark.parametrize("bits", [4, 8])
def test_packed_float32_is_mlx_lm_to_float32_noise(checkpoint, bits):
    """float32 (packed on request: quant_policy keeps it dense on the CPU by default): the
    weights differ from MLX's by one rounding of each zero, so logits of size ~5 agree to
    1e-4 (measured 4e-6 at 4 bits, 1e-5 at 8 where two passes add) and every top-1 does."""
    model_dir = checkpoint("qwen3", "float32", bits)
    ids = np.random.default_rng(bits).integers(0, 300, LENGTH).tolist()
    got = figures(stage_logits(model_dir, ids, "packed"), reference_logits(model_dir, ids))
    assert got["max_abs"] < 1e-4 and got["top1"] == 1.0, got

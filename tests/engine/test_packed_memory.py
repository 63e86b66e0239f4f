"""A stage on a quantized checkpoint holds what placement charges, and packed is smaller.

Placement charges a stage by `supervisor.memory.model_shape_from_config`; here the bytes a
real torch-cpu or mlx-cpu stage holds are counted tensor by tensor and must be exactly that,
packed or dense, with and without the ends. Then the resident memory of a torch-cpu process
serving a 4-bit checkpoint against the same model dense, in separate processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.backends.base import StageSpec, load_stage
from engine.checkpoint.quantize import quantize_checkpoint
from engine.config import ModelConfig
from engine.family import DeltaNetWeights
from engine.row_format import RowFormat
from supervisor.memory import ExecutionShape, model_shape_from_config, stage_memory
from tests.requirements import require

mx = require("mlx.core")

GROUP = 32
# hidden 64 and intermediate 96 pack every projection at group 32; head_dim 18 leaves o_proj
# (input 72) dense, and k / v are 18 wide: padded to 32 rows for PyTorch's int4 kernel.
SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=1, head_dim=18, seed=5)


def charged_bytes(model_dir: Path, backend: str, layers: tuple[int, int]) -> int:
    raw = json.loads((model_dir / "config.json").read_text())
    dtype_bytes = RowFormat.of(ModelConfig.from_dict(raw)).itemsize
    shape = model_shape_from_config(raw, dtype_bytes, (backend,))
    memory = stage_memory(shape, ExecutionShape(64, 2, 16), layers, layers[0] == 0)
    return memory.weights_bytes + memory.rank0_extras_bytes


# Both families, a tied and an untied head, one and two int4 passes, packed and dense.
@pytest.mark.parametrize(("family", "tie", "dtype", "bits"), [
    ("qwen3", False, "bfloat16", 4), ("qwen3", True, "bfloat16", 8),
    ("qwen3_5", True, "bfloat16", 4), ("qwen3", False, "float32", 4)])
def test_a_stage_holds_exactly_what_placement_charges(make_model, tmp_path, family, tie, dtype,
                                                      bits):
    shape = SHAPE if family == "qwen3" else dict(seed=5)
    source = make_model(family, dtype=dtype, tie=tie, **shape)
    model_dir = quantize_checkpoint(source, tmp_path / "q", bits, GROUP)
    n_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    for backend in ("torch-cpu", "mlx-cpu"):
        for layers in [(0, n_layers), (1, n_layers)]:
            stage = load_stage(StageSpec(model_dir, layers, backend, 2, 64, 16))
            assert stage.weights_nbytes == charged_bytes(model_dir, backend, layers), \
                (backend, layers)
    # The torch stage runs bfloat16 packed, float32 dense (quant_policy's measured table).
    stage = load_stage(StageSpec(model_dir, (0, n_layers), "torch-cpu", 2, 64, 16))
    first = stage.model.layers[0]
    mlp_gate = first.gate
    assert (type(mlp_gate).__name__ == "PackedWeight") == (dtype == "bfloat16")
    if family == "qwen3_5":
        assert any(isinstance(layer, DeltaNetWeights) for layer in stage.model.layers)


# A model whose weights dominate the process: qwen3, hidden 1024, intermediate 2816, 8 heads
# of 128 with 2 KV heads, 4 layers, vocabulary 4096, untied: 53 M parameters, 107 MB in
# bfloat16, 30 MB at 4 bits (group 64). Each side loads in a fresh process, so neither sees
# the other's freed memory, and runs one round, so every dense weight is paged in from its
# mmap (measured before that, a dense stage is only the pages it touched).
BIG = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
           num_key_value_heads=2, head_dim=128, num_hidden_layers=4, vocab_size=4096, seed=3)
RSS_SCRIPT = """
import gc, sys, psutil, torch
from pathlib import Path
from engine.backends.base import StageSpec, load_stage
from engine.harness.driver import RoundDriver
from engine.pipeline.runner import LocalRunner
torch.set_num_threads(1)
before = psutil.Process().memory_info().rss
stage = load_stage(StageSpec(Path(sys.argv[1]), (0, 4), "torch-cpu", 1, 16, 16))
RoundDriver(LocalRunner(stage)).round({0: [1, 2, 3]})
gc.collect()
print(psutil.Process().memory_info().rss - before)
"""
# The process runs with glibc's allocator as it comes: packing's temporaries are freed and
# handed back at load (engine/heap.py), so what is measured is what the stage holds. (Before
# that, this test set MALLOC_MMAP_THRESHOLD_ to hide the allocator's high-water mark.)


def resident_growth(model_dir: Path) -> int:
    done = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(model_dir)], check=True,
                          capture_output=True, text=True, timeout=120)
    return int(done.stdout.split()[-1])


def test_a_packed_stage_resides_in_at_most_0_6_of_the_dense_one(make_model, tmp_path):
    dense = make_model("qwen3", dtype="bfloat16", **BIG)
    packed = quantize_checkpoint(dense, tmp_path / "q4", 4, 64)
    dense_rss, packed_rss = resident_growth(dense), resident_growth(packed)
    print(f"\nresident growth: dense {dense_rss / 1e6:.1f} MB, 4-bit packed "
          f"{packed_rss / 1e6:.1f} MB ({packed_rss / dense_rss:.2f}x)")
    assert dense_rss > 100e6  # the weights dominate what was measured
    assert packed_rss <= 0.6 * dense_rss

"""The round and the row bytes written once (engine/backends/base.py), on every backend.

The two backends' `forward` and `rows_from_bytes` used to be written twice and had drifted
apart on edge cases; these are those cases, each run on PyTorch and on MLX.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from engine.backends import base
from engine.backends.base import BackendError, StageSpec, load_stage
from engine.checkpoint.reader import open_checkpoint
from engine.rounds import Op, RoundPlan, StreamEntry
from tests.requirements import require

HAS_MLX = importlib.util.find_spec("mlx") is not None
BACKENDS = ["torch-cpu", pytest.param("mlx-cpu", marks=pytest.mark.skipif(
    not HAS_MLX, reason="MLX is not installed"))]


def stage(model_dir: Path, backend: str, layers: tuple[int, int] | None = None, **load):
    n_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    return load_stage(StageSpec(model_dir, layers or (0, n_layers), backend, 4, 256, 64), **load)


def value_bytes(n_rows: int, hidden: int, seed: int) -> bytearray:
    rng = np.random.default_rng(seed)
    return bytearray(rng.standard_normal((n_rows, hidden), dtype=np.float32).tobytes())


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_from_bytes_refuses_a_wrong_length_by_name(make_model, backend):
    # PyTorch raised its own shape error for a short buffer and took surplus bytes with
    # zero rows silently; MLX named both. Every backend now names both.
    s = stage(make_model("qwen3"), backend, (1, 3))
    data = value_bytes(2, s.hidden_size, seed=1)
    with pytest.raises(BackendError, match=f"2 rows of {s.hidden_size} float32 values need "
                                           f"{len(data)} bytes, got {len(data) - 4}"):
        s.rows_from_bytes(data[:-4], 2)
    with pytest.raises(BackendError, match=f"need 0 bytes, got {len(data)}"):
        s.rows_from_bytes(data, 0)
    assert tuple(s.rows_from_bytes(b"", 0).shape) == (0, s.hidden_size)


@pytest.mark.parametrize("readonly", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_from_bytes_copies_the_receive_buffer(make_model, backend, readonly):
    s = stage(make_model("qwen3"), backend, (1, 3))
    buffer = value_bytes(3, s.hidden_size, seed=2)
    sent = bytes(buffer)
    view = memoryview(sent if readonly else buffer)[s.hidden_size * 4:]  # rows 1 and 2
    rows = s.rows_from_bytes(view, 2)
    buffer[:] = bytes(len(buffer))  # the link reuses its receive buffer for the next round
    assert bytes(s.rows_to_bytes(rows)) == sent[s.hidden_size * 4:]


@pytest.mark.parametrize("backend", BACKENDS)
def test_rounds_without_rows_and_wrong_row_counts(make_model, backend):
    s = stage(make_model("qwen3"), backend)
    assert tuple(s.forward(RoundPlan(1, ()), None, []).shape) == (0, s.hidden_size)
    assert tuple(s.forward(RoundPlan(2, ()), None, None).shape) == (0, s.hidden_size)
    s.forward(RoundPlan(3, (StreamEntry(0, Op.OPEN, 0, 2, 0, 0, 0),)), None, [1, 2])
    rows = s.forward(RoundPlan(4, (StreamEntry(0, Op.CLOSE, 0, 0, 0, 0, 0),)), None, [])
    assert tuple(rows.shape) == (0, s.hidden_size) and not s.slots.slots[0].open
    with pytest.raises(BackendError, match="plan runs 2 rows, this stage was given 1"):
        s.forward(RoundPlan(5, (StreamEntry(1, Op.OPEN, 0, 2, 0, 0, 0),)), None, [1])
    assert not s.slots.slots[1].open  # a refused round leaves the slot table as it was


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_later_stage_counts_the_rows_it_is_given(make_model, backend):
    model_dir = make_model("qwen3")
    first, last = stage(model_dir, backend, (0, 1)), stage(model_dir, backend, (1, 3))
    plan = RoundPlan(1, (StreamEntry(0, Op.OPEN, 0, 3, 0, 0, 0),
                         StreamEntry(1, Op.OPEN, 0, 1, 0, 0, 0)))
    rows = first.forward(plan, None, [4, 5, 6, 7])
    assert tuple(rows.shape) == (4, first.hidden_size)  # a first range sends every row
    with pytest.raises(BackendError, match="plan runs 4 rows, this stage was given 0"):
        last.forward(plan, None, [4, 5, 6, 7])  # token ids are not rows past rank 0
    back = last.forward(plan, last.rows_from_bytes(first.rows_to_bytes(rows), 4), None)
    assert tuple(back.shape) == (2, last.hidden_size)  # the last row of each stream


@pytest.mark.parametrize("backend", ["torch-cuda", "mlx-metal"])
def test_an_unavailable_device_is_named_before_any_file_is_read(tmp_path, backend):
    # PyTorch opened the checkpoint first, so a missing device was reported as a bad
    # checkpoint; both now ask for the device first.
    if backend == "torch-cuda":
        torch = require("torch")
        if torch.cuda.is_available():
            pytest.skip("CUDA is available here: nothing to refuse")
    else:
        mx = require("mlx.core")
        if mx.metal.is_available():
            pytest.skip("Metal is available here: nothing to refuse")
    with pytest.raises(BackendError, match=backend):
        stage_spec = StageSpec(tmp_path / "no-such-model", (0, 1), backend, 1, 8, 8)
        load_stage(stage_spec)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_opened_checkpoint_is_not_opened_again(make_model, monkeypatch, backend):
    model_dir = make_model("qwen3")
    checkpoint = open_checkpoint(model_dir)
    opened: list[Path] = []
    monkeypatch.setattr(base, "open_checkpoint", lambda d: opened.append(d) or checkpoint)
    s = stage(model_dir, backend, checkpoint=checkpoint)
    assert opened == [] and s.is_first and s.is_last
    stage(model_dir, backend)  # the path form still opens it
    assert opened == [model_dir]
    with pytest.raises(ValueError, match="the checkpoint given is"):
        stage(make_model("llama"), backend, checkpoint=checkpoint)


def test_a_dtype_the_wire_cannot_carry_is_refused_before_loading(make_model, tmp_path):
    model_dir = tmp_path / "int8"
    model_dir.mkdir()
    for f in make_model("qwen3").iterdir():
        (model_dir / f.name).symlink_to(f)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").unlink()
    (model_dir / "config.json").write_text(json.dumps({**config, "torch_dtype": "int8",
                                                        "dtype": "int8"}))
    with pytest.raises(BackendError, match="dtype 'int8' is not supported .supported: "
                                           "float32, bfloat16, float16"):
        stage(model_dir, "torch-cpu")

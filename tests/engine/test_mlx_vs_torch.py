"""The MLX backend against the PyTorch backend: logits, mixed pipelines, row bytes, determinism."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.requirements import require

mx = require("mlx.core")

from engine.backends.base import BackendError, StageSpec, load_stage
from engine.backends.mlx import stage as mlx_stage_module
from engine.config import ModelConfig
from engine.family import end_tensor_shapes, layer_tensor_shapes
from engine.rounds import Op, RoundPlan, StreamEntry
from tests.engine.conftest import stage_driver
from tests.engine.logits_at_every_position import one_row_a_stream, prompts

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
DTYPES = ["float32", "bfloat16", "float16"]
WIRE = {"float32": np.uint32, "bfloat16": np.uint16, "float16": np.uint16}  # raw bit patterns


def stage(model_dir: Path, backend: str, layers: tuple[int, int] | None = None):
    n_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    return load_stage(StageSpec(model_dir, layers or (0, n_layers), backend, 4, 256, 64))


@pytest.mark.parametrize(("tie", "shards"), [(False, 3), (True, 1)])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_torch_at_every_position(make_model, family, tie, shards):
    model_dir = make_model(family, tie=tie, shards=shards)
    drivers = [stage_driver(stage(model_dir, "torch-cpu")), stage_driver(stage(model_dir, "mlx-cpu"))]
    batch = prompts(1)

    def same(feeds):
        want, got = (d.round(feeds) for d in drivers)
        for slot in feeds:
            np.testing.assert_allclose(got[slot], want[slot], atol=1e-4, rtol=0)

    for _pos, feeds in one_row_a_stream(batch):  # every position, every stream in each round
        same(feeds)
    for d in drivers:
        d.close(list(range(len(batch))))
    same({0: batch[0][:4], 1: batch[1][:2], 2: batch[2][:9]})  # chunks only
    same({0: [batch[0][4]], 1: batch[1][2:13], 2: [batch[2][9]]})  # decode rows around a chunk


def run_pipeline(first, last, plan: RoundPlan, ids: list[int]) -> np.ndarray:
    """Two stages over the ring, rows crossing as bytes both ways; rank 0 makes the logits."""
    rows = first.forward(plan, None, ids)
    sent = first.rows_to_bytes(rows)
    back = last.forward(plan, last.rows_from_bytes(sent, plan.total_rows), None)
    returned = first.rows_from_bytes(last.rows_to_bytes(back), len(plan.returned_rows()))
    return first.logits(returned)


@pytest.mark.parametrize("backends", [("torch-cpu", "mlx-cpu"), ("mlx-cpu", "torch-cpu")])
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_mixed_pipeline_matches_one_torch_process(make_model, family, backends):
    model_dir = make_model(family, shards=3)
    whole = stage(model_dir, "torch-cpu")
    first, last = stage(model_dir, backends[0], (0, 1)), stage(model_dir, backends[1], (1, 3))
    ids = prompts(4)[1]
    plans = [RoundPlan(1, (StreamEntry(0, Op.OPEN, 0, 17, 0, 0, 0),)),
             *(RoundPlan(2 + p, (StreamEntry(0, Op.CONTINUE, p, 1, 1 if p > 17 else 17, 0, 0),))
               for p in range(17, len(ids)))]
    for plan in plans:
        e = plan.entries[0]
        chunk = ids[e.first:e.end]
        want = whole.logits(whole.forward(plan, None, chunk))
        np.testing.assert_allclose(run_pipeline(first, last, plan, chunk), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("layers", [(0, 1), (1, 3), (2, 3)])
def test_a_range_reads_only_its_tensors(make_model, monkeypatch, layers):
    model_dir = make_model("qwen2", shards=3)
    config = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    read: list[str] = []
    real = mlx_stage_module.load_range_tensors

    def spy(checkpoint, shapes, dtype, quant=None):
        read.extend(shapes)
        return real(checkpoint, shapes, dtype, quant)

    monkeypatch.setattr(mlx_stage_module, "load_range_tensors", spy)
    loaded = stage(model_dir, "mlx-cpu", layers)
    want = [n for layer in range(*layers) for n in layer_tensor_shapes(config, layer)]
    if layers[0] == 0:
        want += list(end_tensor_shapes(config))
    assert sorted(read) == sorted(want)
    assert (loaded.is_first, loaded.is_last) == (layers[0] == 0, layers[1] == 3)
    assert loaded.state_nbytes == 2 * (layers[1] - layers[0]) * 4 * 256 * config.kv_width * 4


def random_bits(dtype: str, n_rows: int, hidden: int, seed: int) -> bytes:
    """Any bit pattern but NaN (whose payload backends may canonicalise differently)."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, np.iinfo(WIRE[dtype]).max, (n_rows, hidden), dtype=WIRE[dtype],
                        endpoint=True)
    view = {"float32": np.float32, "float16": np.float16}.get(dtype)
    values = bits.view(view) if view else (bits.astype(np.uint32) << 16).view(np.float32)
    bits[np.isnan(values)] = 0
    return bits.tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_round_trip_bit_exactly_within_and_across_backends(make_model, dtype):
    model_dir = make_model("qwen3", dtype=dtype)
    mine, theirs = stage(model_dir, "mlx-cpu"), stage(model_dir, "torch-cpu")
    data = random_bits(dtype, 5, mine.hidden_size, seed=3)
    assert bytes(mine.rows_to_bytes(mine.rows_from_bytes(data, 5))) == data
    # torch's bytes -> MLX rows -> bytes, and back into torch.
    torch_bytes = bytes(theirs.rows_to_bytes(theirs.rows_from_bytes(data, 5)))
    through_mlx = bytes(mine.rows_to_bytes(mine.rows_from_bytes(torch_bytes, 5)))
    assert through_mlx == torch_bytes == data
    assert bytes(theirs.rows_to_bytes(theirs.rows_from_bytes(through_mlx, 5))) == data
    # Rows the model computed, not only rows it was handed (a first range sends every row).
    plan = RoundPlan(1, (StreamEntry(0, Op.OPEN, 0, 3, 0, 0, 0),))
    rows = stage(model_dir, "mlx-cpu", (0, 2)).forward(plan, None, [5, 6, 7])
    assert rows.dtype == getattr(mx, dtype)
    computed = bytes(mine.rows_to_bytes(rows))
    assert len(computed) == 3 * mine.hidden_size * np.dtype(WIRE[dtype]).itemsize
    assert bytes(theirs.rows_to_bytes(theirs.rows_from_bytes(computed, 3))) == computed


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_runs_give_identical_bytes(make_model, dtype):
    model_dir = make_model("llama", dtype=dtype)
    batch = prompts(6)

    def run() -> list[bytes]:
        s = stage(model_dir, "mlx-cpu")
        driver = stage_driver(s)
        out = []
        logits = driver.round(dict(enumerate(batch)))
        for _ in range(6):
            feeds = {slot: [int(np.argmax(row))] for slot, row in logits.items()}
            logits = driver.round(feeds)
            out.extend(logits[slot].tobytes() for slot in sorted(logits))
        plan = RoundPlan(99, (StreamEntry(3, Op.OPEN, 0, 4, 0, 0, 0),))
        out.append(bytes(s.rows_to_bytes(s.forward(plan, None, [1, 2, 3, 4]))))
        return out

    assert run() == run()


def mlx_device_available(kind: str) -> bool:
    module = getattr(mx, kind, None)
    return module is not None and module.is_available()


@pytest.mark.parametrize("backend", [
    pytest.param(b, marks=pytest.mark.skipif(mlx_device_available(b.removeprefix("mlx-")),
                                             reason=f"{b} is available here: nothing to refuse"))
    for b in ("mlx-metal", "mlx-cuda")])
def test_an_unavailable_device_is_named(make_model, backend):
    with pytest.raises(BackendError, match=backend):
        stage(make_model("qwen3"), backend)

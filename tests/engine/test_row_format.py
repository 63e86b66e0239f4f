"""The one row-format object: bytes on the wire, and the framework types found by name."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from engine.backend_names import Dtype
from engine.config import ConfigError, ModelConfig
from engine.row_format import RowFormat

SHAPE = dict(model_type="qwen3", hidden_size=48, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, vocab_size=300)


@pytest.mark.parametrize(("name", "itemsize"), [("float32", 4), ("bfloat16", 2),
                                                ("float16", 2)])
def test_a_models_rows(name, itemsize):
    rows = RowFormat.of(ModelConfig.from_dict(dict(SHAPE, torch_dtype=name)))
    assert (rows.dtype.label, rows.name, rows.hidden, rows.planes) == (name, name, 48, 1)
    assert rows.nbytes(5) == 5 * 48 * itemsize
    assert rows.raw_numpy == np.dtype(f"<u{itemsize}") and np.dtype(rows.raw_numpy).itemsize == itemsize


def test_a_dtype_the_wire_lacks_is_refused_by_name():
    with pytest.raises(ConfigError, match="config.json: dtype 'float64' is not supported "
                                          r"\(supported: float32, bfloat16, float16\)"):
        RowFormat.of(ModelConfig.from_dict(dict(SHAPE, torch_dtype="float64")))


@pytest.mark.parametrize("dtype", list(Dtype))
def test_every_wire_dtype_names_a_framework_type_of_its_width(dtype):
    # The backends find their types by the wire's label instead of keeping tables.
    assert getattr(torch, dtype.label).itemsize == dtype.itemsize
    if importlib.util.find_spec("mlx") is not None:
        import mlx.core as mx

        assert getattr(mx, dtype.label).size == dtype.itemsize

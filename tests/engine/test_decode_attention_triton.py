"""The Triton decode kernel on a CPU, through Triton's interpreter, against a float32
softmax (the cases: decode_attention_cases.py), and who chooses it: CUDA only, unless
FLEET_DECODE_ATTENTION=sdpa. The same cases run on a GPU in test_kernels_cuda.py."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.backends.pytorch.kv_cache import RoundIndex, decode_index, decode_kernel_runs
from tests.engine.conftest import layout_of

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (the test extra has it)")
ROOT = Path(__file__).resolve().parents[2]


@needs_triton
def test_the_kernel_under_the_interpreter_is_softmax_attention():
    # The interpreter is chosen when triton is imported, so it runs in a process of its own.
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-m", "tests.engine.decode_attention_cases"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]


@needs_triton
def test_splits_depend_on_the_bound_of_keys_only():
    from engine.backends.pytorch.decode_attention_triton import BLOCK_KEYS, MAX_SPLITS, split_keys

    cpu = torch.device("cpu")
    for rows in (1, 8, 32):
        for keys in (1, 63, 256, 8192, 30208):
            splits, per_split = split_keys(rows, 8, keys, cpu)
            assert 1 <= splits <= MAX_SPLITS and per_split % BLOCK_KEYS == 0
            assert splits * per_split >= keys > (splits - 1) * per_split  # no chunk left empty


def test_a_cpu_keeps_sdpa_under_its_mask(monkeypatch):
    monkeypatch.setenv("FLEET_DECODE_ATTENTION", "triton")
    cpu = torch.device("cpu")
    assert not decode_kernel_runs(cpu)
    index = RoundIndex.build(layout_of([(3, 9), (0, 4)], []), cpu, None)
    assert index.single_lengths is None and index.single_mask.shape == (2, 1, 1, 10)
    graph_index = decode_index(torch.tensor([5, 2]), (1, 3), 256, None)
    assert graph_index.single_lengths is None and graph_index.single_mask.shape[-1] == 256


def test_an_unknown_choice_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("FLEET_DECODE_ATTENTION", "flash")
    with pytest.raises(ValueError, match="FLEET_DECODE_ATTENTION='flash': expected one of"):
        decode_kernel_runs(torch.device("cpu"))

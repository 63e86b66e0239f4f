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


def compiled_for_sm90(fn, signature: dict[str, str], constants: dict[str, object], **options):
    """`fn` compiled ahead of time for an H100/H200 (sm_90) down to a cubin, by the
    ptxas that ships in Triton's wheel: no GPU needed, and what the interpreter cannot
    check (types that GPU code generation refuses, shared memory, registers) is checked."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = dict(signature, **dict.fromkeys(constants, "constexpr"))
    source = ASTSource(fn=fn, signature=signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="a GPU runs the kernels themselves (test_kernels_cuda.py)")
@pytest.mark.parametrize(("dtype", "group", "head_dim", "window"), [
    ("bf16", 4, 128, False),  # an 8B's heads
    ("fp32", 8, 18, True),  # float32 products, a padded head dim, a sliding window
    ("bf16", 6, 256, True),  # the Qwen3.5 27B's attention heads
])
def test_the_kernels_compile_for_an_h200(dtype, group, head_dim, window):
    import triton

    from engine.backends.pytorch import decode_attention_triton as kernel

    block_d = max(16, triton.next_power_of_2(head_dim))
    signature = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}",
                 "table_ptr": "*i64", "slots_ptr": "*i64", "lengths_ptr": "*i32",
                 "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32"}
    signature |= dict.fromkeys(["stride_q_row", "stride_q_head", "stride_table",
                                "stride_k_page", "stride_k_head", "stride_k_pos",
                                "stride_v_page", "stride_v_head", "stride_v_pos"], "i32")
    signature |= {"scale_log2": "fp32", "window": "i32", "keys_per_split": "i32"}
    compiled_for_sm90(kernel._partial, signature, dict(
        PAGE=64, GROUP=group, HEAD_DIM=head_dim, HAS_WINDOW=window, BLOCK_G=16,
        BLOCK_N=kernel.BLOCK_KEYS if block_d <= 128 else kernel.BLOCK_KEYS // 2,
        BLOCK_D=block_d, PRECISION="ieee" if dtype == "fp32" else "tf32", WIDEN=False),
        num_warps=4, num_stages=2)
    compiled_for_sm90(kernel._combine, {
        "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "out_ptr": f"*{dtype}",
        "stride_o_row": "i32", "stride_o_head": "i32", "splits": "i32"},
        dict(HEAD_DIM=head_dim, BLOCK_S=64, BLOCK_D=block_d), num_warps=4)

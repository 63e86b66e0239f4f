"""Our Triton packed matmul compiles for Hopper (sm_90) without a GPU, for the launches `plan`
picks, the one-row kernel's pipelined and tensor-descriptor ways, and the two ways for a few
rows that the tuning sweep times against the dot kernel: triton's NVIDIA backend and the ptxas in its wheel turn the kernels into a cubin on
any Linux machine, so a kernel the interpreter runs but the compiler refuses (a tl.dot
over fewer than 16 inputs, a layout it cannot lower) fails here, in CI.

It runs in a child process: the interpreter tests set TRITON_INTERPRET=1 for this one.
"""

from __future__ import annotations

import subprocess
import sys

from tests.requirements import require

CHILD = r"""
import os
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.backends.pytorch import packed_matmul_triton as k

target = GPUTarget("cuda", 90, 32)
shared = {"w_ptr": "*i32", "s_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*fp32", "N": "i32",
          "steps": "i32", "stride_wn": "i32", "stride_sn": "i32"}
cases = [(1, 4096, 4096, 64, 4), (1, 17408, 5120, 64, 4), (1, 72, 256, 32, 8),
         (1, 200, 512, 32, 2), (8, 1024, 4096, 64, 4), (64, 4096, 14336, 128, 4),
         (3, 16, 64, 32, 4), (16, 200, 512, 32, 8), (2, 72, 256, 128, 2)]
launches = [(k.plan(rows, out_features, in_features, group, bits), rows, group, bits)
            for rows, out_features, in_features, group, bits in cases]
# The one-row kernel's other ways: steps loaded ahead, and tiles by tensor descriptor; a few
# rows by the planes kernel's rows form, and by the dot kernel a plane at a time.
launches += [(k.Launch(1, 4, 1024, 1, 1, 3), 1, 64, 4),
             (k.Launch(1, 16, 1024, 1, 4, 3, True), 1, 64, 4),
             (k.Launch(1, 2, 1024, 2, 2, 2), 8, 64, 4), (k.Launch(1, 4, 512, 1, 1, 1), 3, 32, 8),
             (k.Launch(16, 64, 256, 2, 4, 3, by_plane=True), 8, 64, 4),
             (k.Launch(16, 32, 128, 1, 4, 2, by_plane=True), 2, 128, 8)]
for launch, rows, group, bits in launches:
    common = dict(BITS=bits, GROUP=group, BLOCK_N=launch.block_n, PARTIAL=launch.splits > 1)
    if launch.block_m == 1 and rows > 1:
        kernel, constants = k._gemv_rows_kernel, dict(
            common, ROWS=triton.next_power_of_2(rows), BLOCK_W=launch.block_k * bits // 32,
            STAGES=launch.num_stages)
        signature = dict(shared, x_ptr="*i64", M="i32", words_split="i32", stride_xq="i32")
    elif launch.block_m == 1:
        block_w = launch.block_k * bits // 32
        kernel, constants = k._gemv_planes_kernel, dict(
            common, BLOCK_W=block_w, TMA=launch.tma, STAGES=launch.num_stages)
        signature = dict(shared, x_ptr="*i64", words_split="i32")
        if launch.tma:
            groups = launch.block_k // group
            signature.update(w_ptr=f"tensordesc<i32[{launch.block_n}, {block_w}]>",
                             s_ptr=f"tensordesc<bf16[{launch.block_n}, {groups}]>",
                             b_ptr=f"tensordesc<bf16[{launch.block_n}, {groups}]>")
    else:
        kernel, constants = k._dot_kernel, dict(
            common, BLOCK_M=launch.block_m, BLOCK_K=launch.block_k, DOT_PRECISION="tf32",
            BY_PLANE=launch.by_plane)
        signature = dict(shared, x_ptr="*bf16", M="i32", k_split="i32", stride_xm="i32")
    signature.update({name: "constexpr" for name in constants})
    triton.compile(ASTSource(kernel, signature, constants), target=target,
                   options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages))
signature = {"w_ptr": "*i32", "s_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16",
             "N": "i32", "K": "i32", "stride_wn": "i32", "stride_sn": "i32", "BITS": "constexpr",
             "GROUP": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
triton.compile(ASTSource(k._dequantize_kernel, signature,
                         dict(BITS=4, GROUP=64, BLOCK_N=32, BLOCK_K=256)), target=target)
signature = {"partial_ptr": "*fp32", "out_ptr": "*bf16", "size": "i32", "SPLITS": "constexpr",
             "BLOCK": "constexpr"}
triton.compile(ASTSource(k._sum_splits_kernel, signature, dict(SPLITS=4, BLOCK=1024)),
               target=target)
print("compiled")
"""


def test_the_kernels_compile_for_sm_90_as_planned():
    require("triton")
    child = subprocess.run([sys.executable, "-c", CHILD], check=False, capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == 0 and "compiled" in child.stdout, child.stderr[-4000:]

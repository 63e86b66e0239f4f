"""What the one-row packed kernel costs an SM, read from its compiled code without a GPU.

    python bench/packed_kernel_resources.py [--arch 90]

Triton's NVIDIA backend compiles on any Linux machine, and the cuobjdump in its wheel reads
the cubin's registers and shared memory. For each way of the planes kernel (steps loaded one
at a time, steps loaded ahead through the loop's pipeline, tiles by tensor descriptor) this
prints the registers a thread holds, the shared memory a program holds, the warps an SM can
keep resident on each, and the asynchronous copies in the PTX (none: every load waits in
registers; cp.async or TMA: a step's tiles are in flight while an earlier step is summed).
The bytes a kernel keeps in flight, and so the bandwidth it can reach, follow from those.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.pop("TRITON_INTERPRET", None)  # compiled, not interpreted

from bench.common import table

REGISTERS_PER_SM, WARPS_PER_SM, PROGRAMS_PER_SM = 65536, 64, 32
SHARED_PER_SM = 228 * 1024  # Hopper's, for programs (less 1 KiB each for the system)


def resources(cubin: bytes) -> dict[str, int]:
    """REG and SHARED of the cubin's one kernel, as cuobjdump reports them."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        report = subprocess.run([str(tool), "--dump-resource-usage", f.name], check=True,
                                capture_output=True, text=True).stdout
    fields = {}
    for line in report.splitlines():
        for item in line.split():
            name, _, value = item.partition(":")
            if name in ("REG", "SHARED") and value.isdigit():
                fields[name] = int(value)
    return fields


def resident_warps(registers: int, shared: int, warps: int) -> int:
    """Warps an SM keeps at once: registers (allocated 8 a thread at a time), shared memory
    and the program count all bound it."""
    per_warp = -(-registers // 8) * 8 * 32
    programs = min(PROGRAMS_PER_SM, REGISTERS_PER_SM // (per_warp * warps),
                   SHARED_PER_SM // (shared + 1024) if shared else PROGRAMS_PER_SM)
    return min(WARPS_PER_SM, programs * warps)


def compile_planes(launch, bits: int, group: int, arch: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.backends.pytorch import packed_matmul_triton as kernels

    block_w = launch.block_k * bits // 32
    signature = {"x_ptr": "*i64", "w_ptr": "*i32", "s_ptr": "*bf16", "b_ptr": "*bf16",
                 "out_ptr": "*bf16", "N": "i32", "words_split": "i32", "steps": "i32",
                 "stride_wn": "i32", "stride_sn": "i32"}
    if launch.tma:
        groups = launch.block_k // group
        signature.update(w_ptr=f"tensordesc<i32[{launch.block_n}, {block_w}]>",
                         s_ptr=f"tensordesc<bf16[{launch.block_n}, {groups}]>",
                         b_ptr=f"tensordesc<bf16[{launch.block_n}, {groups}]>")
    constants = dict(BITS=bits, GROUP=group, BLOCK_N=launch.block_n, BLOCK_W=block_w,
                     PARTIAL=False, TMA=launch.tma, STAGES=launch.num_stages)
    signature.update({name: "constexpr" for name in constants})
    return triton.compile(ASTSource(kernels._gemv_planes_kernel, signature, constants),
                          target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=launch.num_warps,
                                       num_stages=launch.num_stages))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="the SM version compiled for")
    args = parser.parse_args(argv)
    from engine.backends.pytorch.packed_matmul_triton import Launch, plan

    bits, group = 4, 64
    launches = [("the plan's, 4096 x 4096", plan(1, 4096, 4096, group, bits))]
    for warps, block_n in ((1, 4), (4, 16)):  # 1024 inputs (128 words) a step
        for stages in (1, 2, 3, 4):
            for tma in (False, True):
                launches.append((f"{'descriptor' if tma else 'pointer'} loads",
                                 Launch(1, block_n, 1024, 1, warps, stages, tma=tma)))
    rows = []
    for label, launch in launches:
        compiled = compile_planes(launch, bits, group, args.arch)
        used = resources(compiled.asm["cubin"])
        ptx = compiled.asm["ptx"]
        copies = ptx.count("cp.async.bulk.tensor") or ptx.count("cp.async.ca") + ptx.count(
            "cp.async.cg")
        warps = resident_warps(used["REG"], compiled.metadata.shared, launch.num_warps)
        rows.append([label, launch.block_n, launch.block_k, launch.num_warps,
                     launch.num_stages, used["REG"], compiled.metadata.shared, warps,
                     copies])
    table(f"The planes kernel compiled for sm_{args.arch}, {bits}-bit group {group}: per "
          "thread registers, per program shared bytes, warps an SM keeps, async copies in "
          "the PTX", ["way", "outputs", "inputs a step", "warps", "stages", "registers",
                      "shared bytes", "resident warps a SM", "async copies"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

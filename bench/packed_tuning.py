"""Tile sizes for the packed Triton matmul, measured: every candidate launch of the GEMV
(one row) and dot (a few rows) kernels on each linear shape of the 8B and the 27B hybrid,
against the dense bfloat16 matmul and the packed floor, in one run.

    python bench/packed_tuning.py [--rows 1,8,32] [--shapes 8b,27b] [--jobs 12]

Each shape's weights are held in enough copies (random words, scales and biases as mlx-lm
stores them) that a pass over them overflows L2, as a stage's layers do, and every way runs
them all in one CUDA graph replay: the time is per copy. Candidates compile first in `--jobs`
processes at once (Triton caches what they build), then one process times them in turn.
The tables print the best launches per shape and row count, and the plan's own choice
(packed_matmul_triton.plan) beside them, so the plan's constants can be checked against
measurement on the GPU at hand.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from bench.common import captured, copy_bandwidth_gbs, median_s, table

BITS, GROUP = 4, 64
L2_OVERFLOW_BYTES = 256 << 20
# [out, in] of each distinct linear as a torch stage runs it, its projections stacked
# (engine/backends/pytorch/stacked.py): the 8B's q/k/v, o, gate/up and down; the 27B
# hybrid's (hidden 5120, intermediate 17408) gate/up and down, attention q+gate/k/v and o
# (a DeltaNet layer's out too), and a DeltaNet layer's qkv/z/b/a.
SHAPES = {"8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
          "27b": [(34816, 5120), (5120, 17408), (14336, 5120), (5120, 6144), (16480, 5120)]}


def candidates(rows: int, out_features: int, in_features: int, tma: bool = False) -> list:
    from engine.backends.pytorch.packed_matmul_triton import Launch

    def splits_of(block_k: int) -> list[int]:
        blocks = in_features // block_k if in_features % block_k == 0 else 0
        return [s for s in range(1, 33) if blocks and blocks % s == 0]

    found = []
    if rows == 1:  # the planes kernel: 32 * warps threads along the words, v words each
        for warps, v, block_n, stages in itertools.product((1, 2, 4), (1, 2, 4), (4, 8, 16),
                                                           (1, 2, 3, 4)):
            block_k = 32 * warps * v * 32 // BITS
            found += [Launch(1, block_n, block_k, splits, warps, stages)
                      for splits in splits_of(block_k)
                      if stages == 1 or in_features // block_k // splits >= stages]
        # Tiles by tensor descriptor (a descriptor's tile is at most 256 words wide). Some
        # of these launches faulted on an H100 (misaligned address, 2026-12-07), which
        # ends the sweep: asked for by --tma only.
        for warps, v, block_n, stages in itertools.product((1, 2, 4), (2, 4), (4, 16, 32),
                                                           (1, 2, 3, 4) if tma else ()):
            block_k = 32 * warps * v * 32 // BITS
            if warps * v <= 8:
                found += [Launch(1, block_n, block_k, splits, warps, stages, tma=True)
                          for splits in splits_of(block_k)
                          if stages == 1 or in_features // block_k // splits >= stages]
        return found
    block_m = max(16, 1 << (rows - 1).bit_length())
    # Around what a first sweep found best on an H200 (4 warps, 64 outputs, 128 inputs).
    grid = (itertools.product((32, 64, 128), (64, 128, 256), (4,), (2, 3)) if rows <= 16
            else itertools.product((64, 128), (64, 128), (4,), (3,)))
    for block_n, block_k, warps, stages in grid:
        found += [Launch(block_m, block_n, block_k, splits, warps, stages)
                  for splits in splits_of(block_k) if splits <= 8]
    if rows > 16:
        return found
    # The dot kernel a plane at a time (a plane's tl.dot takes 16 words or more).
    for block_n, block_k, stages in itertools.product((32, 64, 128), (128, 256, 512), (2, 3)):
        found += [Launch(block_m, block_n, block_k, splits, 4, stages, by_plane=True)
                  for splits in splits_of(block_k) if splits in (1, 2, 4, 8)]
    # The planes kernel's rows form: fewer outputs a thread, as the rows take registers.
    for warps, v, block_n, stages in itertools.product((1, 2, 4), (2, 4), (1, 2, 4), (1, 2)):
        block_k = 32 * warps * v * 32 // BITS
        found += [Launch(1, block_n, block_k, splits, warps, stages)
                  for splits in splits_of(block_k) if splits in (1, 2, 4, 8)
                  and (stages == 1 or in_features // block_k // splits >= stages)]
    return found


def random_packed(out_features: int, in_features: int, copies: int, device: str) -> list:
    gen = torch.Generator(device=device).manual_seed(out_features + in_features)
    made = []
    for _ in range(copies):
        words = torch.randint(-2**31, 2**31 - 1, (out_features, in_features * BITS // 32),
                              generator=gen, device=device, dtype=torch.int32)
        groups = (out_features, in_features // GROUP)
        scales = (torch.rand(groups, generator=gen, device=device) * 3e-3 + 1e-3)
        biases = -(torch.rand(groups, generator=gen, device=device) * 3e-2)
        made.append((words, scales.to(torch.bfloat16), biases.to(torch.bfloat16)))
    return made


def packed_bytes(out_features: int, in_features: int) -> int:
    return out_features * in_features * BITS // 8 + 2 * 2 * out_features * in_features // GROUP


def warm(work: list) -> int:
    """Compile candidates on their real shapes (one copy: the specialisation the timing run
    gets); `work`: (rows, out, in, tiles) each."""
    from engine.backends.pytorch.packed_matmul_triton import packed_matmul

    done = 0
    for rows, out_features, in_features, tiles in work:
        (w,) = random_packed(out_features, in_features, 1, "cuda")
        x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
        try:
            packed_matmul(x, *w, BITS, GROUP, launch=tiles)
            # Here, not at some later call: a launch that faults the device is named.
            torch.cuda.synchronize()
            done += 1
        except torch.AcceleratorError:  # the device's context is lost: so is the sweep
            print(f"# faulted the device: {tiles} on {out_features}x{in_features}", flush=True)
            raise
        except Exception as exc:  # noqa: BLE001 - out of registers or shared memory
            why = str(exc).strip().partition("\n")[0][:200]
            print(f"# not a candidate: {tiles} on {out_features}x{in_features}: "
                  f"{type(exc).__name__}: {why}", flush=True)
    return done


def describe(tiles) -> str:
    return (f"m{tiles.block_m} n{tiles.block_n} k{tiles.block_k} s{tiles.splits} "
            f"w{tiles.num_warps} st{tiles.num_stages}" + " tma" * tiles.tma
            + " planes" * tiles.by_plane)


def per_copy_us(action, copies: int) -> float:
    replay = captured(action)
    return median_s(replay, repeats=5, warmup=1, sync=torch.cuda.synchronize) * 1e6 / copies


def time_shape(x: torch.Tensor, weights: list, tiles_list: list) -> tuple:
    """Per copy: dense, the plan's launch, dequantize + cuBLAS, and each candidate's
    (us, tiles, max error over the largest output)."""
    from engine.backends.pytorch import packed_matmul_triton as kernels

    copies = len(weights)
    dense = [kernels.dequantize(*w, BITS, GROUP, torch.bfloat16) for w in weights]
    dense_us = per_copy_us(lambda: [F.linear(x, d) for d in dense], copies)
    want = F.linear(x.double(), kernels.dequantize(*weights[0], BITS, GROUP,
                                                   torch.float32).double())
    plan_us = per_copy_us(lambda: [kernels.packed_matmul(x, *w, BITS, GROUP) for w in weights],
                          copies)
    cublas_us = per_copy_us(lambda: [F.linear(x, kernels.dequantize(*w, BITS, GROUP,
                                                                    torch.bfloat16))
                                     for w in weights], copies)
    timed = []
    for tiles in tiles_list:
        try:
            got = kernels.packed_matmul(x, *weights[0], BITS, GROUP, launch=tiles)
            us = per_copy_us(lambda t=tiles: [kernels.packed_matmul(x, *w, BITS, GROUP, launch=t)
                                              for w in weights], copies)
        except Exception as exc:  # noqa: BLE001 - did not compile: not a candidate
            print(f"# not timed: {tiles}: {type(exc).__name__}", flush=True)
            continue
        error = float((got.double() - want).abs().max() / want.abs().max())
        timed.append((us, tiles, error))
    return dense_us, plan_us, cublas_us, timed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32,64")
    parser.add_argument("--shapes", default="8b,27b")
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--best", type=int, default=5, help="launches shown per shape")
    parser.add_argument("--tma", action="store_true",
                        help="the one-row kernel's tensor-descriptor launches too")
    args = parser.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")]
    shapes = [s for name in args.shapes.split(",") for s in SHAPES[name]]
    shapes = list(dict.fromkeys(shapes))
    jobs = [(rows, out, inp, candidates(rows, out, inp, args.tma)) for rows in rows_list
            for out, inp in shapes]
    # Each worker compiles whole kernels (a launch's constants but its split count, over
    # every shape), so no two workers build the same one.
    by_kernel: dict[tuple, list] = {}
    for rows, out_features, in_features, tiles_list in jobs:
        for tiles in tiles_list:
            key = (tiles.block_m, tiles.block_n, tiles.block_k, tiles.num_warps,
                   tiles.num_stages, tiles.tma, tiles.by_plane, tiles.splits > 1, rows)
            by_kernel.setdefault(key, []).append((rows, out_features, in_features, tiles))
    kernel_lists = list(by_kernel.values())
    work = [[item for kernel in kernel_lists[k::args.jobs] for item in kernel]
            for k in range(args.jobs)]
    print(f"# compiling {sum(len(j[3]) for j in jobs)} launches in {args.jobs} processes",
          flush=True)
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        compiled = sum(pool.map(warm, work))
    print(f"# {compiled} compiled", flush=True)

    copy_gbs = copy_bandwidth_gbs("cuda")
    summary = []
    with torch.inference_mode():
        for rows, out_features, in_features, tiles_list in jobs:
            nbytes = packed_bytes(out_features, in_features)
            copies = max(2, -(-L2_OVERFLOW_BYTES // nbytes))
            weights = random_packed(out_features, in_features, copies, "cuda")
            x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
            dense_us, plan_us, cublas_us, timed = time_shape(x, weights, tiles_list)
            floor_us = nbytes / (copy_gbs * 1e9) * 1e6
            timed.sort(key=lambda t: t[0])
            shape = f"{out_features}x{in_features}"
            for us, tiles, error in timed[:args.best]:
                summary.append([rows, shape, dense_us, plan_us, cublas_us, us,
                                f"{100 * floor_us / us:.0f} %", dense_us / us,
                                describe(tiles), f"{error:.1e}"])
            print(f"# {rows} rows {shape}: {len(timed)} timed, best "
                  f"{timed[0][0] if timed else float('nan'):.1f} us, dense {dense_us:.1f}, "
                  f"plan {plan_us:.1f}, dequantize + cuBLAS {cublas_us:.1f}, "
                  f"floor {floor_us:.1f}; "
                  + "; ".join(f"{us:.1f} {describe(t)}" for us, t, _ in timed[:3]), flush=True)
            del weights
            torch.cuda.empty_cache()
    table(f"packed {BITS}-bit group {GROUP} launches, best {args.best} per shape (us per "
          f"linear, one CUDA graph over copies past L2); floor: packed bytes over the copy "
          f"bandwidth {copy_gbs:.0f} GB/s",
          ["rows", "out x in", "dense us", "plan us", "dequantize + cuBLAS us", "launch us",
           "of floor", "dense / launch", "launch", "max error / max"], summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

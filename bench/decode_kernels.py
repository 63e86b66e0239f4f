"""Decode attention on CUDA, side by side in one run, for an 8B's shape (32 query heads,
8 key heads of 128, bfloat16) over 32 layers' worth of KV: one query row a stream, every
stream at the same conversation length.

(a) `KVCache.attend` under FLEET_DECODE_ATTENTION=sdpa (SDPA's memory-efficient kernel
    over each slot's pages gathered in order up to the key bucket, under a
    [n, 1, 1, bucket] mask), eager and in a captured CUDA graph;
(b) `KVCache.attend` with the Triton split-K kernel (`decode_attention_triton`, reading
    through the page table), eager and in a captured CUDA graph;
(c) plain SDPA (enable_gqa, no mask) over contiguous per-stream KV of exactly the live
    length: the reference a copy-free kernel should reach;
(d) the floor: the live KV bytes a step reads over this GPU's device-to-device copy
    bandwidth, measured in the same run.

The cache is laid out as a stage's (pages of [kv_heads, 64 positions, head_dim], every
slot's context 32768 by default, its pages taken a page a slot in turn, as conversations
that grow side by side take them), and a step runs 32 layers. 32 layers of 32 slots at 32768 positions
would be 137 GB, so only as many layers as --cache-gb holds are allocated and a step
cycles through them (the "layers held" column): a step still reads 32 layers' bytes, from
enough distinct memory that the L2 cache cannot serve it, except for 96-token rows,
whose whole step can sit in L2 (times under the floor are possible there).
Usage: python bench/decode_kernels.py --streams 1,8,32 --lengths 96,8000,30000
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import captured, copy_bandwidth_gbs, table
from engine.backends.pytorch.kv_cache import KVCache, decode_index, key_bucket
from engine.kv_pages import PAGE_POSITIONS

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 32, 8, 128, 32
DTYPE = torch.bfloat16
GB = 1e9


def time_ms(step: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """Median of CUDA-event times of `step` after `warmup` untimed runs."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def with_choice(choice: str, build: Callable[[], object]) -> object:
    """`build` with FLEET_DECODE_ATTENTION=`choice` (read when an index is built)."""
    before = os.environ.get("FLEET_DECODE_ATTENTION")
    os.environ["FLEET_DECODE_ATTENTION"] = choice
    try:
        return build()
    finally:
        if before is None:
            del os.environ["FLEET_DECODE_ATTENTION"]
        else:
            os.environ["FLEET_DECODE_ATTENTION"] = before


def cell(ms: float, floor_ms: float) -> str:
    return f"{ms:.3g} ({ms / floor_ms:.2g}x)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--lengths", default="96,8000,30000")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--cache-gb", type=float, default=40.0,
                        help="memory for the strided cache (K and V); layers held = this / a layer")
    parser.add_argument("--contiguous-gb", type=float, default=24.0,
                        help="memory for (c)'s contiguous copies of the live KV")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/decode_kernels.py needs a CUDA device")
    torch.backends.cuda.enable_cudnn_sdp(False)  # as a CUDA stage runs (stage.py says why)
    bandwidth = copy_bandwidth_gbs("cuda", repeats=20) * 1e9  # bytes/s
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = []
    with torch.inference_mode():
        for n in map(int, args.streams.split(",")):
            layer_bytes = 2 * n * KV_HEADS * args.context * HEAD_DIM * DTYPE.itemsize
            held = max(1, min(LAYERS, int(args.cache_gb * GB // layer_bytes)))
            cache = KVCache(held, n, KV_HEADS, args.context, HEAD_DIM, DTYPE,
                            torch.device("cuda"))
            take_pages_in_turn(cache, n)
            cache.k.normal_()
            cache.v.normal_()
            for length in lengths:
                try:
                    rows.append(run_case(cache, n, length, held, bandwidth, args))
                except torch.OutOfMemoryError:  # a long case on a smaller GPU: say so, go on
                    print(f"# {n} streams x {length} tokens: past this GPU's memory, skipped",
                          flush=True)
                    torch.cuda.empty_cache()
            del cache
            torch.cuda.empty_cache()
    table(f"decode attention, 8B shape ({HEADS} heads, {KV_HEADS} kv heads of {HEAD_DIM}, "
          f"bf16), {LAYERS} layers a step, context {args.context}; "
          f"copy bandwidth {bandwidth / GB:.0f} GB/s; ms a step (x the floor)",
          ["streams", "length", "layers held", "live KV GB", "floor ms", "(a) sdpa+mask",
           "(a) in graph", "(b) triton", "(b) in graph", "(c) sdpa contiguous",
           "(b) / (c)", "largest |b - c|"], rows)
    print("\nOne layer's cache (or --cache-gb's worth of layers) is allocated and each step "
          f"runs {LAYERS} layers through it; the floor counts {LAYERS} layers of live K and V.")
    return 0


def take_pages_in_turn(cache: KVCache, n: int) -> None:
    """Every slot's whole context in pages, slot s's j-th page being page j x n + s: no two
    of a slot's pages next to each other, the layout least kind to a reader of pages (the
    allocator keeps a slot's pages consecutive where it can; a crowded pool may not)."""
    columns = cache.positions // PAGE_POSITIONS
    layout = torch.arange(columns * n, device=cache.table.device).view(columns, n).T
    for slot in range(n):
        cache.pages.held[slot] = layout[slot].tolist()
    cache.pages.free -= set(layout.flatten().tolist())
    cache.table[:n] = layout


def run_case(cache: KVCache, n: int, length: int, held: int, bandwidth: float,
             args: argparse.Namespace) -> list[object]:
    length = min(length, cache.positions)
    bucket = key_bucket(length, cache.positions)
    positions = torch.full((n,), length - 1, dtype=torch.int64, device="cuda")
    q = torch.randn(n, HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    run = (0, n)
    sdpa_index = with_choice("sdpa", lambda: decode_index(positions, run, bucket, None))
    triton_index = with_choice("triton", lambda: decode_index(positions, run, bucket, None))
    assert sdpa_index.single_mask is not None and triton_index.single_lengths is not None

    def step(index) -> Callable[[], None]:
        def layers() -> None:
            for layer in range(LAYERS):
                cache.attend(layer % held, index, q)
        return layers

    live_layer = 2 * n * KV_HEADS * length * HEAD_DIM * DTYPE.itemsize
    held_contiguous = max(1, min(LAYERS, int(args.contiguous_gb * GB // live_layer)))
    slots = torch.arange(n, device="cuda")
    kc, vc = zip(*(cache.gather(j % held, slots, length) for j in range(held_contiguous)),
                 strict=True)
    kc, vc = [k.contiguous() for k in kc], [v.contiguous() for v in vc]

    def contiguous(layer: int) -> torch.Tensor:
        j = layer % held_contiguous
        return F.scaled_dot_product_attention(q[:, :, None, :], kc[j], vc[j],
                                              enable_gqa=True)[:, :, 0, :]

    def sdpa_contiguous() -> None:
        for layer in range(LAYERS):
            contiguous(layer)

    repeats = args.repeats
    today = time_ms(step(sdpa_index), repeats)
    today_graph = time_ms(captured(step(sdpa_index)), repeats)
    kernel = time_ms(step(triton_index), repeats)
    kernel_graph = time_ms(captured(step(triton_index)), repeats)
    plain = time_ms(sdpa_contiguous, repeats)
    difference = (cache.attend(0, triton_index, q).float()
                  - contiguous(0).float()).abs().max().item()
    floor_ms = LAYERS * live_layer / bandwidth * 1e3
    return [n, length, held, f"{LAYERS * live_layer / GB:.3g}", f"{floor_ms:.3g}",
            cell(today, floor_ms), cell(today_graph, floor_ms), cell(kernel, floor_ms),
            cell(kernel_graph, floor_ms), cell(plain, floor_ms), f"{kernel / plain:.2g}",
            f"{difference:.2g}"]


if __name__ == "__main__":
    raise SystemExit(main())

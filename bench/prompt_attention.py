"""A prompt chunk's attention on CUDA: SDPA's flash kernel under `causal_lower_right` (what a
stage runs with FLEET_PROMPT_ATTENTION=flash) against cuDNN's kernels as two parts merged
(`engine.backends.pytorch.prompt_attention`, FLEET_PROMPT_ATTENTION=cudnn), side by side.

For each chunk (rows, keys it sees) and head shape: the median time of each, their ratio,
the TFLOP/s each reaches (causal FLOPs: the keys before the chunk in full, its own square
half), the first call at a key count not seen before (cuDNN builds an execution plan per
shape, which a serving stage pays at every new prefix length), and the largest difference
from a float32 softmax.
Shapes: `8b` is Llama-3.1-8B's attention (32 query heads, 8 key heads of 128), `hybrid` the
Qwen3.5 27B's (24 and 4 of 256).
Usage: python bench/prompt_attention.py [--shapes 8b,hybrid] [--chunks 2048x2048,2048x8192]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from bench.common import median_s, table
from engine.backends.pytorch.prompt_attention import chunk_attention

SHAPES = {"8b": (32, 8, 128), "hybrid": (24, 4, 256)}
CHUNKS = "512x8192,2048x2048,2048x4096,2048x8192,8192x8192,2048x30000"


def flash(q, k, v):
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def float_reference(q, k, v):
    n, keys = q.shape[2], k.shape[2]
    visible = torch.ones(n, keys, dtype=torch.bool, device=q.device).tril(keys - n)
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=visible,
                                          enable_gqa=True)


def first_call_s(attend, q, k, v) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    attend(q, k, v)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(attend, q, k, v, reference, repeats: int) -> tuple[float, float, str]:
    """Median seconds, the first call's seconds, and the largest error (or "-")."""
    cold = first_call_s(attend, q, k, v)
    warm = median_s(lambda: attend(q, k, v), repeats=repeats, sync=torch.cuda.synchronize)
    error = ("-" if reference is None else
             f"{(attend(q, k, v).float() - reference).abs().max().item():.3g}")
    return warm, cold, error


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="8b,hybrid")
    parser.add_argument("--chunks", default=CHUNKS, help="rows x keys, comma-separated")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/prompt_attention.py compares CUDA kernels: no CUDA device here")
    rows = []
    for shape in args.shapes.split(","):
        heads, kv_heads, head_dim = SHAPES[shape]
        for chunk in args.chunks.split(","):
            n, keys = (int(x) for x in chunk.split("x"))
            q = torch.randn(1, heads, n, head_dim, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(1, kv_heads, keys, head_dim, device="cuda",
                                dtype=torch.bfloat16) for _ in range(2))
            flops = 4 * heads * head_dim * (n * (keys - n) + n * n / 2)
            reference = float_reference(q, k, v) if n * keys <= 2048 * 8192 else None
            (flash_s, flash_cold, flash_err), (cudnn_s, cudnn_cold, cudnn_err) = (
                measure(attend, q, k, v, reference, args.repeats)
                for attend in (flash, chunk_attention))
            rows.append([shape, n, keys, flash_s * 1e3, cudnn_s * 1e3, flash_s / cudnn_s,
                         flops / flash_s / 1e12, flops / cudnn_s / 1e12,
                         flash_cold * 1e3, cudnn_cold * 1e3, flash_err, cudnn_err])
    table(f"a prompt chunk's attention, bf16, {torch.cuda.get_device_name()}",
          ["shape", "rows", "keys", "flash ms", "cudnn ms", "flash / cudnn", "flash TFLOP/s",
           "cudnn TFLOP/s", "flash first call ms", "cudnn first call ms", "flash max err",
           "cudnn max err"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Decode attention on a CPU: a half-precision KV cache attended natively against converted
to float32 first (what engine/backends/pytorch/kv_cache.py's `attention` does on a CPU).

Times `scaled_dot_product_attention` of decode rows (one query each, grouped heads, a mask
as the engine passes one) over a slot's keys, both ways side by side in one run, and prints
the ratio and the largest difference of the outputs.
Usage: python bench/cpu_attention.py [--keys 96,8000] [--rows 1,8] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.common import median_s
from engine.backends.pytorch.kv_cache import attention


def native(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", default="96,8000")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--heads", type=int, default=8)  # the demo preset's shape
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"| keys | rows | native {args.dtype} ms | via float32 ms | via float32 / native "
          "| largest difference |\n|---|---|---|---|---|---|")
    for keys in map(int, args.keys.split(",")):
        for rows in map(int, args.rows.split(",")):
            q = torch.randn(rows, args.heads, 1, args.head_dim, dtype=dtype)
            k = torch.randn(rows, args.kv_heads, keys, args.head_dim, dtype=dtype)
            v = torch.randn(rows, args.kv_heads, keys, args.head_dim, dtype=dtype)
            mask = torch.ones(rows, 1, 1, keys, dtype=torch.bool)
            slow = median_s(lambda: native(q, k, v, mask), repeats=args.repeats) * 1e3  # noqa: B023
            fast = median_s(lambda: attention(q, k, v, mask), repeats=args.repeats) * 1e3  # noqa: B023
            diff = (native(q, k, v, mask).float() - attention(q, k, v, mask).float()).abs().max()
            print(f"| {keys} | {rows} | {slow:.3f} | {fast:.3f} | {fast / slow:.2f} | "
                  f"{diff.item():.2g} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

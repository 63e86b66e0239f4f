"""Decode attention with grouped heads: SDPA asked for them (`enable_gqa`) against the query
heads that share a key head passed as that head's rows (what
engine/backends/pytorch/kv_cache.py does for one-row entries on CUDA).

Both forms attend decode rows (one query each) over a slot's keys under a mask, as the engine
passes one, side by side in one run; prints each one's time, the ratio, the largest
difference of the outputs, and on CUDA which SDPA kernels take each form.
Shapes: `hybrid` is the Qwen3.5 27B's attention (24 query heads, 4 key heads of 256), `8b`
Llama-3.1-8B's (32 and 8 of 128), `demo` the demo preset's (8 and 2 of 32).
Usage: python bench/decode_attention.py [--device cuda] [--shapes hybrid,8b] [--keys 8000]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.common import median_s, table
from engine.backends.pytorch.kv_cache import heads_as_rows

SHAPES = {"hybrid": (24, 4, 256), "8b": (32, 8, 128), "demo": (8, 2, 32)}


def grouped_by_sdpa(q, k, v, mask):
    """q [n, heads, head_dim]: SDPA's own grouped heads, one query row a slot."""
    return F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask,
                                          enable_gqa=True)[:, :, 0, :]


def kernels_taking(q, k, v, mask) -> str:
    """Which CUDA SDPA kernels accept q [n, heads, rows, head_dim] over k, v (grouped heads
    where heads > kv_heads)."""
    from torch.backends.cuda import (
        SDPAParams,
        can_use_cudnn_attention,
        can_use_efficient_attention,
        can_use_flash_attention,
    )

    params = SDPAParams(q, k, v, mask, 0.0, False, True)
    checks = {"flash": can_use_flash_attention, "efficient": can_use_efficient_attention,
              "cudnn": can_use_cudnn_attention}
    return ",".join(name for name, can in checks.items() if can(params)) or "math only"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shapes", default="hybrid,8b")
    parser.add_argument("--keys", default="8000")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # as a CUDA stage runs (stage.py says why)
    rows_out = []
    for shape in args.shapes.split(","):
        heads, kv_heads, head_dim = SHAPES[shape]
        for keys in map(int, args.keys.split(",")):
            for rows in map(int, args.rows.split(",")):
                q = torch.randn(rows, heads, head_dim, dtype=dtype, device=device)
                k = torch.randn(rows, kv_heads, keys, head_dim, dtype=dtype, device=device)
                v = torch.randn(rows, kv_heads, keys, head_dim, dtype=dtype, device=device)
                mask = torch.ones(rows, 1, 1, keys, dtype=torch.bool, device=device)
                mask[:, :, :, keys - 64:] = False  # a bucket's tail past the live length
                grouped = median_s(lambda: grouped_by_sdpa(q, k, v, mask),  # noqa: B023
                                   repeats=args.repeats, sync=sync)
                as_rows = median_s(lambda: heads_as_rows(q, k, v, mask),  # noqa: B023
                                   repeats=args.repeats, sync=sync)
                diff = (grouped_by_sdpa(q, k, v, mask).float()
                        - heads_as_rows(q, k, v, mask).float()).abs().max().item()
                taken = "-", "-"
                if device.type == "cuda":
                    as_heads_rows = q.reshape(rows, kv_heads, heads // kv_heads, head_dim)
                    taken = (kernels_taking(q[:, :, None, :], k, v, mask),
                             kernels_taking(as_heads_rows, k, v, mask))
                rows_out.append([shape, keys, rows, grouped * 1e3, as_rows * 1e3,
                                 as_rows / grouped, f"{diff:.2g}", *taken])
    table(f"decode attention on {args.device}, {args.dtype}, median of {args.repeats}",
          ["shape", "keys", "rows", "grouped by SDPA ms", "heads as rows ms",
           "rows / grouped", "largest difference", "kernels for grouped",
           "kernels for rows"], rows_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

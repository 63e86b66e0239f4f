"""Where a torch stage's decode round spends its GPU time, kernel by kernel, dense against
packed (`python bench/stage_profile.py [--rows 1] [--layers 32]`, CUDA only): the random 8B
layer range bench/quantized.py --triton writes, one round profiled after warm-up."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from bench.common import cuda_profile
from engine.backends.pytorch import packed_linear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--no-graphs", action="store_true", help="launch eagerly")
    parser.add_argument("--keys", type=int, default=512, help="positions each row attends to")
    parser.add_argument("--ways", default="dense,triton,int4",
                        help="of dense, triton, int4 (the packed kernels)")
    args = parser.parse_args()
    from agent.stage_timer import decode_layout, random_row_bytes
    from bench.quantized_triton import range_checkpoint, stage_checkpoints
    from engine.backends.base import StageSpec, load_stage
    from engine.checkpoint.quant_config import QuantParams

    dirs = stage_checkpoints("8b", args.layers, QuantParams(group_size=64, bits=4))
    context = max(2048, 1 << args.keys.bit_length())
    for way in args.ways.split(","):
        kind = "dense" if way == "dense" else "packed"
        os.environ[packed_linear.KERNEL_ENV] = way if way != "dense" else "triton"
        stage = load_stage(StageSpec(dirs[kind], (1, 1 + args.layers), "torch-cuda", max(8, args.rows),
                                     context, 2048, cuda_graphs=not args.no_graphs,
                                     quant="dense" if kind == "dense" else "auto"),
                           checkpoint=range_checkpoint(dirs[kind]))
        layout = decode_layout(args.keys, args.rows)
        x = stage.rows_from_bytes(random_row_bytes(args.rows, stage.config.hidden_size,
                                                   stage.row_format.name), args.rows)
        def three_rounds(stage=stage, x=x, layout=layout) -> None:
            for _ in range(3):
                stage.run_layers_again(x, layout)

        three_rounds()  # graphs captured, kernels compiled
        averages = cuda_profile(three_rounds)
        print(f"\n### {way}, {args.rows} row(s) over {args.keys} keys, {args.layers} layers, "
              "3 rounds, "
              f"{'eager' if args.no_graphs else 'CUDA graphs'}", flush=True)
        print(averages.table(sort_by="cuda_time_total", row_limit=args.top), flush=True)
        del stage
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

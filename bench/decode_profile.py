"""Where one decode round of long conversations spends its time, kernel by kernel: the
stage `bench/decode.py` times, its conversations prompted untimed, then a few greedy rounds
under torch.profiler (CUDA only).

    python bench/decode_profile.py --preset 8b --streams 8 --prompt 8000 --context 32768
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np

from bench.common import checkpoint, cuda_profile
from bench.decode import Decoding, open_conversations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="8b")
    parser.add_argument("--model", default=None)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=8000)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--prompt-chunk", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    decoding = Decoding(checkpoint(args.model, args.preset), "torch-cuda", args.streams,
                        args.context, args.prompt_chunk)
    logits = open_conversations({None: decoding}, args.streams, args.prompt,
                                args.prompt_chunk)[None]

    def rounds(n: int) -> None:
        nonlocal logits
        for _ in range(n):
            logits = decoding.driver.round({s: [int(np.argmax(r))] for s, r in logits.items()})

    rounds(3)  # graphs captured, kernels compiled
    averages = cuda_profile(lambda: rounds(args.rounds))
    print(f"### {args.rounds} rounds of {args.streams} streams at {args.prompt} tokens, "
          f"context {args.context}", flush=True)
    print(averages.table(sort_by="cuda_time_total", row_limit=args.top), flush=True)
    print(averages.table(sort_by="cpu_time_total", row_limit=args.top), flush=True)


if __name__ == "__main__":
    main()

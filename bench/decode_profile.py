"""Where one decode round of long conversations spends its time, kernel by kernel: the
stage `bench/decode.py` times, its conversations prompted untimed, then a few greedy rounds
under torch.profiler (CUDA only). `--prompt-only`: one stream's prompt instead, in rounds of
`--prompt-chunk` rows, after one untimed prompt of the same length (what `bench/decode.py
--prompt-rate` times).

    python bench/decode_profile.py --preset 8b --streams 8 --prompt 8000 --context 32768
    python bench/decode_profile.py --preset 8b --prompt-only --prompt 8192
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from bench.common import checkpoint, cuda_profile
from bench.decode import Decoding, open_conversations, prompts


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
    parser.add_argument("--prompt-only", action="store_true")
    args = parser.parse_args()
    if args.prompt_only:
        return profile_prompt(args)
    decoding = Decoding(checkpoint(args.model, args.preset), "torch-cuda", args.streams,
                        args.context, args.prompt_chunk)
    tokens = open_conversations({None: decoding}, args.streams, args.prompt,
                                args.prompt_chunk)[None]

    def rounds(n: int) -> None:
        nonlocal tokens
        for _ in range(n):
            tokens = decoding.next_tokens({s: [t] for s, t in tokens.items()})

    rounds(3)  # graphs captured, kernels compiled
    averages = cuda_profile(lambda: rounds(args.rounds))
    print(f"### {args.rounds} rounds of {args.streams} streams at {args.prompt} tokens, "
          f"context {args.context}", flush=True)
    print(averages.table(sort_by="cuda_time_total", row_limit=args.top), flush=True)
    print(averages.table(sort_by="cpu_time_total", row_limit=args.top), flush=True)


def profile_prompt(args: argparse.Namespace) -> None:
    decoding = Decoding(checkpoint(args.model, args.preset), "torch-cuda", 1, args.prompt + 8,
                        args.prompt_chunk)
    driver = decoding.driver
    ids = prompts(1, args.prompt, driver.stage.config.vocab_size)[0]

    def prompt_once() -> None:
        for start in range(0, args.prompt, args.prompt_chunk):
            driver.round({0: ids[start:start + args.prompt_chunk]})
        driver.close([0])

    prompt_once()  # kernels chosen and compiled
    averages = cuda_profile(prompt_once)
    print(f"### one {args.prompt}-token prompt in rounds of {args.prompt_chunk} rows", flush=True)
    print(averages.table(sort_by="cuda_time_total", row_limit=args.top), flush=True)


if __name__ == "__main__":
    main()

"""What a verify round costs against a plain decode round, on one stage, at real shapes.

    python bench/verify_rounds.py --device cuda                     # the 8B, dense, bf16
    python bench/verify_rounds.py --device cuda --hybrid --layers 8 # the 27B's layer shape
    python bench/verify_rounds.py --preset demo                     # CPU: the command works

A speculative round (docs/drafting.md) runs each stream's newest token and k drafts as one
entry of k + 1 rows, and the head scores all of them; on memory-bound hardware those rows
should cost little more than one. For each stream count and k it prints ms a round (the
stage's layers, the head over every returned row, the logits to the host, as the lane
host's rounds go) and the ratio to a plain round of one row a stream, whose decode is
replayed as CUDA graphs where the device has them; `--no-graphs` times both eagerly. The
break-even acceptance: a verify round of ratio r pays once it hands out more than r tokens
(1 + accepted drafts) a round. Conversations are `--prompt` tokens long, in a context of
`--context` positions.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import checkpoint, n_layers, table
from engine.backends.base import StageSpec, load_stage
from engine.harness.driver import RoundDriver
from engine.pipeline.runner import LocalRunner
from engine.rounds import MAX_DRAFT_TOKENS


def round_ms(driver: RoundDriver, streams: int, rows: int, rounds: int, prompt: int,
             vocab: int, sync) -> float:
    """ms a round of `rows` rows a stream (1: decode rows; more: verify entries, all kept),
    for `streams` streams `prompt` tokens into their conversations."""
    rng = np.random.default_rng(rows)
    slots = list(range(streams))
    for first in range(0, prompt, 512):
        driver.round({s: rng.integers(3, vocab, min(512, prompt - first)).tolist()
                      for s in slots})
    feeds = {s: rng.integers(3, vocab, rows).tolist() for s in slots}
    for _ in range(3):  # captures, compiles, warm-up
        driver.round(feeds)
    sync()
    start = time.perf_counter()
    for _ in range(rounds):
        driver.round(feeds)
    sync()
    elapsed = time.perf_counter() - start
    driver.close(slots)
    return elapsed / rounds * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--preset", default="8b", help="a dense preset (engine's PRESETS)")
    parser.add_argument("--hybrid", action="store_true", help="the 27B hybrid's layer shape")
    parser.add_argument("--layers", type=int, default=8, help="the hybrid's layers")
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--drafts", default="1,2,3,5,7", help="k: drafts a verify round")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--no-graphs", action="store_true")
    args = parser.parse_args()
    drafts = [int(k) for k in args.drafts.split(",")]
    if max(drafts) > MAX_DRAFT_TOKENS:
        parser.error(f"a verify round carries at most {MAX_DRAFT_TOKENS} drafts")
    if args.hybrid:
        from bench.qwen3_5_decode import hybrid_checkpoint  # torch at import: CUDA's bench
        model_dir = hybrid_checkpoint(args.layers)
    else:
        model_dir = checkpoint(None, args.preset)
    streams = [int(s) for s in args.streams.split(",")]
    backend = "torch-cuda" if args.device == "cuda" else "torch-cpu"
    stage = load_stage(StageSpec(model_dir, (0, n_layers(model_dir)), backend, max(streams),
                                 args.context, 512, cuda_graphs=not args.no_graphs,
                                 drafting=True))  # a hybrid keeps each verify row's state
    driver = RoundDriver(LocalRunner(stage))
    vocab = stage.config.vocab_size
    if args.device == "cuda":
        import torch
        sync = torch.cuda.synchronize
    else:
        def sync() -> None:
            """The CPU's rounds are done when they return."""
    rows = []
    for n in streams:
        plain = round_ms(driver, n, 1, args.rounds, args.prompt, vocab, sync)
        rows.append([n, 0, f"{plain:.2f}", "1.00"])
        print(rows[-1], flush=True)
        for k in drafts:
            ms = round_ms(driver, n, k + 1, args.rounds, args.prompt, vocab, sync)
            rows.append([n, k, f"{ms:.2f}", f"{ms / plain:.2f}"])
            print(rows[-1], flush=True)
    if getattr(stage, "graphs", None) is not None:
        print(f"graphs captured: {len(stage.graphs.captured)} "
              f"{sorted(stage.graphs.captured)}", flush=True)
    shape = f"hybrid, 27B layer shape, {args.layers} layers" if args.hybrid else args.preset
    table(f"Verify rounds against a decode round ({shape}, {backend}, "
          f"{'eager' if args.no_graphs else 'decode as CUDA graphs where there are'}, "
          f"{args.prompt}-token conversations)",
          ["streams", "drafts k", "ms a round", "against a plain round (break-even tokens)"],
          rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

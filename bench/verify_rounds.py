"""What a verify round costs against a plain decode round, on one stage, at real shapes.

    python bench/verify_rounds.py --device cuda                     # the 8B, dense, bf16
    python bench/verify_rounds.py --device cuda --hybrid --layers 8 # the 27B's layer shape
    python bench/verify_rounds.py --preset demo                     # CPU: the command works
    python bench/verify_rounds.py --device cuda --hybrid --mtp --drafts 1,2,3 --streams 1,4
    python bench/verify_rounds.py --mtp --small --drafts 1,2,3 --streams 1,4  # CPU

A speculative round (docs/drafting.md) runs each stream's newest token and k drafts as one
entry of k + 1 rows, and the head scores all of them; on memory-bound hardware those rows
should cost little more than one. For each stream count and k it prints ms a round (the
stage's layers, the head over every returned row, the logits to the host, as the lane
host's rounds go) and the ratio to a plain round of one row a stream, whose decode is
replayed as CUDA graphs where the device has them; `--no-graphs` times both eagerly. The
break-even acceptance (each time is the median round's): a verify round of ratio r pays once it hands out more than r tokens
(1 + accepted drafts) a round. Conversations are `--prompt` tokens long, in a context of
`--context` positions.

With `--mtp` (a hybrid with the checkpoint's MTP head, engine.draft_head) it also times
what drafting with the head costs rank 0 each round: for every stream, the k + 1 rows a
fully kept verify round hands the head, then its k drafts (k - 1 more head steps), as
the drafter runs them (engine.lanes.model_drafting: every stream's rows as one batch, then
step j of every stream as one batch), on the head's cache `--prompt` entries deep; and
the same asks one stream at a time, alternating with it, for what batching saves. An MTP
round is the head plus the verify round, against the same plain round. The head's input
rows are the stage's own final norm of random rows: its cost does not depend on their
values. `--small` is a small hybrid (hidden 256) for a CPU run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import checkpoint, n_layers, table
from engine.backends.base import StageSpec, load_stage
from engine.draft_head import DraftAsk
from engine.harness.driver import RoundDriver
from engine.pipeline.runner import LocalRunner
from engine.rounds import MAX_DRAFT_TOKENS

SMALL_HYBRID = dict(family="qwen3_5", hidden_size=256, intermediate_size=768,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=4096,
                    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
                    linear_value_head_dim=32, full_attention_interval=4, dtype="float32")


def mtp_checkpoint(args) -> Path:
    """A hybrid with a whole MTP head: the 27B's layer shape, or `--small`'s; made once at
    `--out` (default under build/)."""
    from engine.checkpoint.maker import CheckpointSpec, make_checkpoint

    if args.small:
        shape, name = SMALL_HYBRID, f"bench-qwen3_5-small-mtp-{args.layers}"
    else:
        from bench.qwen3_5_decode import SHAPE as shape  # torch at import: CUDA's bench
        name = f"bench-qwen3_5-27b-like-mtp-{args.layers}"
    out = args.out or Path(__file__).resolve().parent.parent / "build" / name
    if not (out / "config.json").exists():
        print(f"# making {out}", flush=True)
        shards = max(1, min(args.layers, os.cpu_count() or 1))  # one a core, written at once
        make_checkpoint(out, CheckpointSpec(**shape, num_hidden_layers=args.layers, mtp=True,
                                            shards=shards), overwrite=True)
    return out


def head_ms(stage, streams: int, k: int, rounds: int, deep: int, vocab: int,
            sync) -> tuple[float, float]:
    """ms rank 0's MTP head takes a round to draft k tokens for each of `streams` streams,
    fed the k + 1 rows of a fully kept verify round, its cache `deep` entries deep: as the
    drafter runs it (every stream's asks at once, draft steps batched), and one stream at
    a time (what batching saves), the two alternating round by round."""
    rng = np.random.default_rng(k)
    import torch

    hidden = stage.draft_rows(torch.randn(k + 1, stage.hidden_size, dtype=stage.dtype,
                                          device=stage.device))
    tokens = rng.integers(3, vocab, k + 1).tolist()

    asks = [DraftAsk(slot, deep, hidden, tuple(range(k + 1)), tuple(tokens), deep, k)
            for slot in range(streams)]

    def together() -> None:
        stage.draft(asks)

    def one_by_one() -> None:
        for ask in asks:
            stage.draft([ask])

    for _ in range(3):
        together()
        one_by_one()
    times: dict[str, list[float]] = {"together": [], "alone": []}
    for _ in range(rounds):
        times["together"].append(median_round_ms(together, 1, sync))
        times["alone"].append(median_round_ms(one_by_one, 1, sync))
    return float(np.median(times["together"])), float(np.median(times["alone"]))


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
    ms = median_round_ms(lambda: driver.round(feeds), rounds, sync)
    driver.close(slots)
    return ms


def median_round_ms(one_round, rounds: int, sync) -> float:
    """The median of `rounds` rounds' ms, each synchronised: a shared CPU's other work
    lands on a few rounds, which a mean would charge to every one."""
    times = []
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        one_round()
        sync()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


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
    parser.add_argument("--mtp", action="store_true",
                        help="a hybrid with an MTP head: also time drafting with it")
    parser.add_argument("--small", action="store_true", help="with --mtp: a small hybrid")
    parser.add_argument("--out", type=Path, help="with --mtp: where its checkpoint is made")
    args = parser.parse_args()
    drafts = [int(k) for k in args.drafts.split(",")]
    if max(drafts) > MAX_DRAFT_TOKENS:
        parser.error(f"a verify round carries at most {MAX_DRAFT_TOKENS} drafts")
    if args.mtp:
        model_dir = mtp_checkpoint(args)
    elif args.hybrid:
        from bench.qwen3_5_decode import hybrid_checkpoint  # torch at import: CUDA's bench
        model_dir = hybrid_checkpoint(args.layers)
    else:
        model_dir = checkpoint(None, args.preset)
    streams = [int(s) for s in args.streams.split(",")]
    backend = "torch-cuda" if args.device == "cuda" else "torch-cpu"
    stage = load_stage(StageSpec(model_dir, (0, n_layers(model_dir)), backend, max(streams),
                                 args.context, 512, cuda_graphs=not args.no_graphs,
                                 drafting=True,  # a hybrid keeps each verify row's state
                                 draft_head=args.mtp))
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
        rows.append([n, 0, f"{plain:.2f}", "1.00", *([""] * 4 if args.mtp else [])])
        print(rows[-1], flush=True)
        for k in drafts:
            ms = round_ms(driver, n, k + 1, args.rounds, args.prompt, vocab, sync)
            row = [n, k, f"{ms:.2f}", f"{ms / plain:.2f}"]
            if args.mtp:
                head, alone = head_ms(stage, n, k, args.rounds, args.prompt, vocab, sync)
                row += [f"{head:.2f}", f"{alone:.2f}", f"{ms + head:.2f}",
                        f"{(ms + head) / plain:.2f}"]
            rows.append(row)
            print(rows[-1], flush=True)
    if getattr(stage, "graphs", None) is not None:
        print(f"graphs captured: {len(stage.graphs.captured)} "
              f"{sorted(stage.graphs.captured)}", flush=True)
    shape = f"hybrid, 27B layer shape, {args.layers} layers" if args.hybrid else args.preset
    if args.mtp:
        shape = (f"hybrid with an MTP head, {'small' if args.small else '27B layer shape'}, "
                 f"{args.layers} layers")
    table(f"Verify rounds against a decode round ({shape}, {backend}, "
          f"{'eager' if args.no_graphs else 'decode as CUDA graphs where there are'}, "
          f"{args.prompt}-token conversations)",
          ["streams", "drafts k", "ms a round", "against a plain round (break-even tokens)",
           *(["MTP head ms (k drafts a stream)", "the head, one stream at a time",
              "MTP round ms",
              "MTP round against a plain round (break-even tokens)"] if args.mtp else [])],
          rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a verify round costs against a plain decode round, on one stage, at real shapes.

    python bench/verify_rounds.py --device cuda                     # the 8B, dense, bf16
    python bench/verify_rounds.py --device cuda --hybrid --layers 8 # the 27B's layer shape
    python bench/verify_rounds.py --preset demo                     # CPU: the command works
    python bench/verify_rounds.py --device cuda --hybrid --mtp --drafts 1,2,3 --streams 1,4
    python bench/verify_rounds.py --mtp --small --drafts 1,2,3 --streams 1,4  # CPU

A speculative round (docs/drafting.md) runs each stream's newest token and k drafts as one
entry of k + 1 rows, and the head scores all of them; on memory-bound hardware those rows
should cost little more than one. For each stream count and k it prints ms a round (the
stage's layers, the head over every returned row, each row drawn greedily on the head's
device with only its token id to the host, as the lane host's rounds go) and the ratio to
a plain round of one row a stream, whose decode is replayed as CUDA graphs where the
device has them; `--no-graphs` times both eagerly. The break-even acceptance (each time is
the median round's): a verify round of ratio r pays once it hands out more than r tokens
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

`--mtp` also prints what reading a prompt costs with the head, a second table: one stream
reads a `--prompt`-token prompt (and one of a single chunk of the stage's 512 rows, where
`--prompt` is shorter) chunk by chunk, as a plain ring reads it and as `drafter: mtp` does,
alternating, `--rounds` times each. For each chunk: the plain round (the chunk's last row
back and scored); the final norm over every row (`draft_rows`, what returning every row
adds on rank 0; the round with `keep_hidden` runs it); the head fed the chunk's rows as
engine.lanes.model_drafting asks it (`stage.draft`, no drafts: its layer over the chunk, no
vocabulary head); the MTP chunk (its round returning every row, normed, and the feed), each
in ms and against the plain chunk; and the bytes the last hop sends rank 0 each way, which
one process cannot time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from functools import partial
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


@dataclass(frozen=True)
class ChunkMs:
    """One prompt chunk of one stream, `rows` rows from `position`: the medians, ms, of its
    round as a plain ring runs it (the chunk's last row back and scored), of the same round
    returning every row, normed for the head (`SamplingBatch.keep_hidden`), of that final
    norm alone (the stage's `draft_rows`), and of the head fed the chunk's rows (no drafts,
    so no vocabulary head), as the lane host's rounds run them. Both rounds run on the
    stage with the head, whose last stage returns every row: the plain round's last row is
    taken on rank 0 instead (the same one-row gather)."""

    rows: int
    position: int
    plain: float
    every_row: float
    norm: float
    feed: float


def prompt_chunks_ms(driver: RoundDriver, prompt: int, reps: int, vocab: int,
                     sync) -> list[ChunkMs]:
    """Each chunk's costs (ChunkMs) for one stream reading a `prompt`-token prompt in the
    stage's chunks: the prompt read as a plain ring reads it, then as `drafter: mtp` reads
    it (each chunk's round returns every row, then the head is fed them before the next
    chunk, as engine.lanes.model_drafting asks), alternating, `reps` times each."""
    import torch

    stage, slot = driver.stage, 0
    ids = np.random.default_rng(prompt).integers(3, vocab, prompt + 1).tolist()
    spans = [(first, min(first + stage.spec.chunk, prompt))
             for first in range(0, prompt, stage.spec.chunk)]
    # The norm's input: a round's rows, whose values its cost does not depend on.
    raw = {stop - first: torch.randn(stop - first, stage.hidden_size, dtype=stage.dtype,
                                     device=stage.device) for first, stop in spans}
    times: dict[str, list[list[float]]] = {k: [[] for _ in spans]
                                           for k in ("plain", "every_row", "norm", "feed")}

    def read(keep_hidden: bool) -> None:
        for i, (first, stop) in enumerate(spans):
            (_, sampled), ms = timed(partial(driver.sampled_round, {slot: ids[first:stop]},
                                             draw=stop == prompt, keep_hidden=keep_hidden),
                                     sync)
            if not keep_hidden:
                times["plain"][i].append(ms)
                continue
            times["every_row"][i].append(ms)
            # Each row beside the prompt's next token (the prompt's last row beside the
            # first token drawn, fed with the next round's drafts: the same rows).
            ask = DraftAsk(slot, first, sampled.hidden, tuple(range(stop - first)),
                           tuple(ids[first + 1:stop + 1]), first, 0)
            times["feed"][i].append(timed(partial(stage.draft, [ask]), sync)[1])
            times["norm"][i].append(timed(partial(stage.draft_rows, raw[stop - first]),
                                          sync)[1])
        driver.close([slot])

    for rep in range(reps + 1):  # the first of each untimed: compiles, warm-up
        if rep == 1:
            times = {k: [[] for _ in spans] for k in times}
        read(False)
        read(True)
    return [ChunkMs(stop - first, first,
                    *(float(np.median(times[k][i])) for k in ("plain", "every_row", "norm",
                                                              "feed")))
            for i, (first, stop) in enumerate(spans)]


def prompt_rows(stage, prompt: int, chunks: list[ChunkMs]) -> list[list[object]]:
    """The prompt-chunk table's rows for one prompt: a row a chunk, then the whole prompt
    where it has several."""
    def row(label: str, rows: int, position: object, c: ChunkMs, scored: int) -> list[object]:
        mtp = c.every_row + c.feed
        return [label, rows, position, f"{c.plain:.2f}", f"{c.norm:.2f}",
                f"{c.norm / c.plain:.3g}", f"{c.feed:.2f}", f"{c.feed / c.plain:.3g}",
                f"{mtp:.2f}", f"{mtp / c.plain:.3g}",
                (f"{stage.row_format.nbytes(scored) / 1e3:.1f} KB -> "
                 f"{stage.row_format.nbytes(rows) / 1e6:.2f} MB")]

    out = [row(str(prompt), c.rows, c.position, c, 1) for c in chunks]
    if len(chunks) > 1:
        total = ChunkMs(prompt, 0, *(sum(getattr(c, k) for c in chunks)
                                     for k in ("plain", "every_row", "norm", "feed")))
        out.append(row(f"{prompt} (whole prompt)", prompt, "all", total, len(chunks)))
    return out


def timed(action, sync) -> tuple[object, float]:
    """`action`'s result and its ms, synchronised before and after."""
    sync()
    start = time.perf_counter()
    out = action()
    sync()
    return out, (time.perf_counter() - start) * 1e3


def round_ms(driver: RoundDriver, streams: int, rows: int, rounds: int, prompt: int,
             vocab: int, sync, profile: bool = False) -> float:
    """ms a round of `rows` rows a stream (1: decode rows; more: verify entries, all kept),
    for `streams` streams `prompt` tokens into their conversations."""
    rng = np.random.default_rng(rows)
    slots = list(range(streams))
    for first in range(0, prompt, 512):
        driver.round({s: rng.integers(3, vocab, min(512, prompt - first)).tolist()
                      for s in slots})
    feeds = {s: rng.integers(3, vocab, rows).tolist() for s in slots}
    # Every returned row drawn on the head's device, as the lane host judges drafts: only
    # token ids reach the host, not a vocabulary of logits a row.
    one_round = partial(driver.sampled_round, feeds, every_row=True)
    for _ in range(3):  # captures, compiles, warm-up
        one_round()
    ms = median_round_ms(one_round, rounds, sync)
    if profile:
        print_profile(one_round, f"{streams} streams, {rows} rows each", sync)
    driver.close(slots)
    return ms


def print_profile(one_round, what: str, sync, rounds: int = 3) -> None:
    """`rounds` rounds under torch's profiler: the kernels and host ops that cost most."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(rounds):
            one_round()
        sync()
    sort = "cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(f"### profile, {what}, {rounds} rounds, by {sort}", flush=True)
    print(prof.key_averages().table(sort_by=sort, row_limit=14, max_name_column_width=60),
          flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10,
                                    max_name_column_width=60), flush=True)


def median_round_ms(one_round, rounds: int, sync) -> float:
    """The median of `rounds` rounds' ms, each synchronised: a shared CPU's other work
    lands on a few rounds, which a mean would charge to every one."""
    return float(np.median([timed(one_round, sync)[1] for _ in range(rounds)]))


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
    parser.add_argument("--profile", default="",
                        help="streams:drafts pairs (8:3,8:5) whose rounds are also profiled")
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
            ms = round_ms(driver, n, k + 1, args.rounds, args.prompt, vocab, sync,
                          profile=f"{n}:{k}" in args.profile.split(","))
            row = [n, k, f"{ms:.2f}", f"{ms / plain:.2f}"]
            if args.mtp:
                head, alone = head_ms(stage, n, k, args.rounds, args.prompt, vocab, sync)
                row += [f"{head:.2f}", f"{alone:.2f}", f"{ms + head:.2f}",
                        f"{(ms + head) / plain:.2f}"]
            rows.append(row)
            print(rows[-1], flush=True)
    chunk_rows: list[list[object]] = []
    if args.mtp:  # a prompt of one chunk of the stage's most rows too
        for prompt in sorted({args.prompt, max(args.prompt, stage.spec.chunk)}):
            chunk_rows += prompt_rows(stage, prompt, prompt_chunks_ms(driver, prompt,
                                                                      args.rounds, vocab, sync))
            print(*chunk_rows[-1:], flush=True)
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
    if args.mtp:
        table(f"A prompt chunk with and without the MTP head's feed ({shape}, {backend}, "
              f"one stream, chunks of {stage.spec.chunk} rows)",
              ["prompt tokens", "chunk rows", "at position", "plain chunk ms",
               "every row's final norm ms", "norm against plain", "head feed ms",
               "feed against plain", "MTP chunk ms (every row back, normed, and fed)",
               "MTP chunk against plain", "rows back to rank 0 (plain -> MTP)"],
              chunk_rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

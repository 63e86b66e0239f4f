"""Overlapped rounds (RFC 6.3, v2 prompt chunks and v3 decode groups) against one round at a
time (v1) and against one stage, served as users are served: through rank 0's lane host.

    python bench/overlap.py                                   # torch-cpu + torch-cpu, 1 thread each
    python bench/overlap.py --backends torch-cpu,mlx-cpu      # a mixed ring
    python bench/overlap.py --threads 8                       # 16 cores: stages of 8 threads
    python bench/overlap.py --backends torch-cpu,mlx-cpu --layers 7,1  # unequal stages

Overlap needs stages on separate hardware, so every stage gets its own `--threads` CPU
threads and the whole model gets one stage's worth: two stages of one thread against one
stage of one thread on a 2-core machine. Prints, from one run:
- time to first token of a prompt of `--chunks` chunks: whole, split one round at a time
  (v1), split overlapped (v2), and v2's speed-up over whole against the ideal 2n/(n+1);
- the same for a prompt of one chunk (nothing to overlap: the cost of the split itself);
- aggregate decode tokens/s of `--streams` streams: whole, v1, and v3 (decode groups);
- v2 against v1 and against the ideal for the stages' own measured times per chunk, which
  need not be equal (a mixed ring's MLX stage is slower here): with t_i the median work of
  stage i on a `--chunk`-row round in the v1 run (its debug phase timings: rank 0's plan,
  compute, to_host and head, a follower's compute and to_host), v1 = n sum(t) and the
  ideal v2 = sum(t) + (n - 1) max(t) for n chunks; for equal stages the ideal v1 / v2 is
  the RFC's 2n/(n+1).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, n_layers, table
from engine.checkpoint.maker import PRESETS, make_checkpoint
from engine.harness.launch import even_stages, log_records
from engine.harness.local_pipeline import local_pipeline, whole_runner
from engine.lanes.host import Done, Failed, GenerationRequest, LaneHost, Token
from engine.lanes.text import TextCodec
from engine.pipeline.runner import RoundRunner
from engine.sampling import SamplingParams

# Big enough that a stage's matmuls, not Python, are most of a round on one CPU thread.
CPU_SHAPE = replace(PRESETS["demo"], hidden_size=1024, intermediate_size=2816,
                    num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                    head_dim=64, vocab_size=4096, dtype="float32")


def served(runner: RoundRunner, depth: int, model_dir: Path, prompts: list[list[int]],
           max_tokens: int, chunk: int) -> tuple[float, float]:
    """(seconds to the first stream's first token, seconds until every stream is done),
    with `depth` rounds in flight."""
    runner.depth = depth
    host = LaneHost(runner, TextCodec(model_dir), chunk=chunk, max_waiting=len(prompts))

    async def go() -> tuple[float, float]:
        task = asyncio.create_task(host.run())
        start = time.perf_counter()
        streams = [host.submit(GenerationRequest(tuple(p), max_tokens=max_tokens,
                                                 sampling=SamplingParams(temperature=0.0)))
                   for p in prompts]
        first = None
        for stream in streams:
            while not isinstance(event := await stream.events.get(), Done):
                if isinstance(event, Failed):
                    raise RuntimeError(event.reason)  # noqa: TRY004 - a failed stream, not a type
                if isinstance(event, Token) and first is None:
                    first = time.perf_counter() - start
        done = time.perf_counter() - start
        deadline = time.monotonic() + 60  # the round that closes the last slots
        while host.slots_in_use() and time.monotonic() < deadline and not task.done():
            await asyncio.sleep(0.001)
        task.cancel()
        return first or done, done

    try:
        return asyncio.run(go())
    finally:
        host.close()


def measure(runner: RoundRunner, depth: int, model_dir: Path, args) -> dict[str, float]:
    rng = np.random.default_rng(0)
    long_prompt = [rng.integers(0, 1000, args.chunk * args.chunks).tolist()]
    one_chunk = [rng.integers(0, 1000, args.chunk).tolist()]
    streams = [rng.integers(0, 1000, 16).tolist() for _ in range(args.streams)]

    def median(action) -> float:
        action()  # warm-up
        return statistics.median(action() for _ in range(args.repeats))

    return {
        "ttft_long": median(lambda: served(runner, depth, model_dir, long_prompt, 1,
                                           args.chunk)[0]),
        "ttft_one": median(lambda: served(runner, depth, model_dir, one_chunk, 1,
                                          args.chunk)[0]),
        "decode_tps": args.streams * args.tokens / median(
            lambda: served(runner, depth, model_dir, streams, args.tokens, args.chunk)[1]),
    }


# A stage's own work on a round, from its debug phase timings (the rest is waiting for rows,
# sending them, and, on rank 0, the lane host between rounds).
RANK0_WORK = ("plan", "compute", "to_host", "head")
FOLLOWER_WORK = ("compute", "to_host")


def stage_chunk_ms(rank0_timings: list[dict], run_dir: Path, n_stages: int,
                   chunk: int) -> list[float]:
    """Each stage's median own time (ms) on the rounds of exactly `chunk` rows so far."""
    def median_work(records: list[dict], work: tuple[str, ...]) -> float:
        rounds = [r for r in records if r.get("rows") == chunk]
        if not rounds:
            raise RuntimeError(f"no {chunk}-row round in the phase timings")
        return statistics.median(sum(r.get(k, 0.0) for k in work) for r in rounds)

    out = [median_work(rank0_timings, RANK0_WORK)]
    for rank in range(1, n_stages):
        records = [e for e in log_records(run_dir / f"rank{rank}.log")
                   if e.get("event") == "round timing"]
        out.append(median_work(records, FOLLOWER_WORK))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="a checkpoint (default: a 1024-wide one)")
    parser.add_argument("--backends", default="torch-cpu,torch-cpu", help="one per stage")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of each stage")
    parser.add_argument("--layers", default="",
                        help="layers of each stage, e.g. 7,1 (default: an even split)")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=8, help="chunks of the long prompt")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="tokens each stream generates")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model_dir = args.model or ROOT / "build" / "bench-overlap"
    if not (model_dir / "config.json").exists():
        print(f"# making the benchmark checkpoint in {model_dir}", flush=True)
        make_checkpoint(model_dir, CPU_SHAPE, overwrite=True)
    backends = args.backends.split(",")
    stages = even_stages(n_layers(model_dir), len(backends))
    if args.layers:  # unequal stages: a slow backend's stage can be given fewer layers
        counts = [int(c) for c in args.layers.split(",")]
        if len(counts) != len(backends) or sum(counts) != n_layers(model_dir) or min(counts) < 1:
            parser.error(f"--layers must give each of the {len(backends)} stages at least one "
                         f"layer, {n_layers(model_dir)} in all")
        ends = np.cumsum(counts).tolist()
        stages = list(zip([0, *ends[:-1]], ends, strict=True))
    n = len(stages)
    if args.chunk * args.chunks + args.tokens > args.context:
        parser.error("--context must hold the long prompt and the reply")
    shape = dict(parallel=args.streams, context=args.context, chunk=args.chunk)
    # Debug level: every stage logs its round phases, for the stages' own times.
    stage_env = {"FLEET_CPU_THREADS": str(args.threads), "FLEET_LOG_LEVEL": "debug"}
    if backends[0].startswith("torch-"):
        import torch

        torch.set_num_threads(args.threads)  # rank 0 runs in this process
    whole = measure(whole_runner(model_dir, backend=backends[0], **shape), 1, model_dir, args)
    print(f"# whole on {backends[0]}: {whole}", flush=True)
    with (tempfile.TemporaryDirectory() as run_dir,
          local_pipeline(model_dir, stages, Path(run_dir), backends=backends,
                         extra_env=stage_env, **shape) as runner):
        runner.timings.clear()
        v1 = measure(runner, 1, model_dir, args)
        print(f"# v1: {v1}", flush=True)
        stage_ms = stage_chunk_ms(list(runner.timings), Path(run_dir), n, args.chunk)
        print(f"# v1, each stage's own ms per {args.chunk}-row round: {stage_ms}", flush=True)
        overlapped = measure(runner, n, model_dir, args)
        print(f"# v2/v3: {overlapped}", flush=True)
    chunks = args.chunks
    ideal = n * chunks / (chunks + n - 1)  # n equal stages, `chunks` chunks: RFC 2n/(n+1) at n=2
    placement = ", ".join(f"{a}:{b}@{be}" for (a, b), be in zip(stages, backends, strict=True))
    rows = [
        [f"TTFT s, {chunks} chunks of {args.chunk}", whole["ttft_long"], v1["ttft_long"],
         overlapped["ttft_long"], whole["ttft_long"] / overlapped["ttft_long"], ideal,
         whole["ttft_long"] / overlapped["ttft_long"] / ideal],
        [f"TTFT s, 1 chunk of {args.chunk}", whole["ttft_one"], v1["ttft_one"],
         overlapped["ttft_one"], whole["ttft_one"] / overlapped["ttft_one"], 1.0,
         whole["ttft_one"] / overlapped["ttft_one"]],
        [f"decode tokens/s, {args.streams} streams x {args.tokens}", whole["decode_tps"],
         v1["decode_tps"], overlapped["decode_tps"],
         overlapped["decode_tps"] / whole["decode_tps"], float(n),
         overlapped["decode_tps"] / v1["decode_tps"]],
    ]
    table(f"overlapped rounds, {model_dir.name}, {placement}, {args.threads} thread(s) a stage, "
          f"context {args.context}",
          ["measure", "whole", "split v1", "split v2/v3", "whole / v2 (speed-up)", "ideal",
           "of ideal (decode row: v3 / v1)"], rows)
    chunk_s = [t / 1000 for t in stage_ms]
    ideal_v1 = chunks * sum(chunk_s)
    ideal_v2 = sum(chunk_s) + (chunks - 1) * max(chunk_s)
    v1_over_v2 = v1["ttft_long"] / overlapped["ttft_long"]
    table(f"v2 against v1 and the stages' own times, {chunks} chunks of {args.chunk} "
          f"(ideal: v1 = n sum(t), v2 = sum(t) + (n - 1) max(t))",
          ["stage s per chunk (t)", "v1 s", "ideal v1 s", "v2 s", "ideal v2 s", "v1 / v2",
           "ideal v1 / v2", "of ideal"],
          [[" / ".join(f"{t:.3g}" for t in chunk_s), v1["ttft_long"], ideal_v1,
            overlapped["ttft_long"], ideal_v2, v1_over_v2, ideal_v1 / ideal_v2,
            v1_over_v2 / (ideal_v1 / ideal_v2)]])
    return 0


if __name__ == "__main__":
    sys.exit(main())

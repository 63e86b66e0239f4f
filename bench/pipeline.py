"""Split against whole on one machine, and the stage link against a raw loopback socket.

    python bench/pipeline.py --preset demo --stages 2                        # CPU
    python bench/pipeline.py --preset 8b --backends torch-cuda,torch-cuda --devices 0,0
    python bench/pipeline.py --preset 8b --backends torch-cuda,torch-cuda --devices 0,1
    python bench/pipeline.py --preset demo --backends torch-cpu,mlx-cpu     # a mixed ring

Prints, from one run: decode ms per step at 1 and 8 streams and prompt time, whole vs
split, as ratios (a mixed ring against each of its backends alone); the cost of each boundary at decode (split minus whole, over the number
of hops a round makes, the return to rank 0 included); the link against a raw socket
moving the same bytes on loopback, two processes (bench/link_hop.py: hop and stream); and
issue 16's figures: the decode hop per boundary from the phases, and with one chunk
(--chunk equal to --prompt) the prompt's split / whole against its allowance.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import checkpoint, median_s, n_layers, table
from bench.link_hop import frames_for, link_vs_raw
from engine.harness.driver import RoundDriver
from engine.harness.launch import even_stages, log_records
from engine.harness.local_pipeline import local_pipeline, whole_runner


def measure(runner, streams: list[int], steps: int, prompt: int, chunk: int,
            repeats: int) -> dict:
    """Decode ms per step for each stream count, and prompt ms for one stream in chunks."""
    driver = RoundDriver(runner)
    rng = np.random.default_rng(0)
    out = {}
    for n in streams:
        prompts = {s: rng.integers(0, 256, 16).tolist() for s in range(n)}

        def decode(prompts=prompts) -> None:
            driver.greedy(prompts, steps)
            driver.close(list(prompts))

        def open_only(prompts=prompts) -> None:
            driver.greedy(prompts, 0)
            driver.close(list(prompts))

        out[f"decode{n}"] = (median_s(decode, repeats=repeats)
                             - median_s(open_only, repeats=repeats)) * 1000 / steps
    long_prompt = rng.integers(0, 256, prompt).tolist()

    def prefill() -> None:
        for start in range(0, prompt, chunk):
            driver.round({0: long_prompt[start:start + chunk]})
        driver.close([0])

    out["prompt"] = median_s(prefill, repeats=repeats) * 1000
    return out


def phase_medians(timings: list[dict], rows: int = 1) -> dict[str, float]:
    """Median of each phase over rounds of `rows` rows (1: one stream decoding)."""
    decode = [t for t in timings if t.get("rows") == rows]
    names = [k for k in (decode[0] if decode else {}) if k not in ("rows", "round", "event",
                                                                    "level", "timestamp",
                                                                    "rank", "replica")]
    return {k: statistics.median(t[k] for t in decode) for k in names}


# A stage's own work: on a GPU "compute" only launches the kernels and "to_host" waits for
# them to finish (and copies the rows out), so both are the stage's compute. "queued" is rank
# 0 between launching a round and landing it (later rounds' work, when rounds overlap).
RANK0_OWN = ("plan", "compute", "to_host", "queued", "head")
FOLLOWER_OWN = ("compute", "to_host")


def hop_per_boundary_us(phases: list[dict[str, float]]) -> float:
    """A boundary's cost at decode, wire and landing: rank 0's time outside its own work
    (its rows' send and its wait for the ring), less every follower's own work, over the
    hops a round makes (the return included)."""
    transit = sum(v for k, v in phases[0].items() if k not in RANK0_OWN)
    followers = sum(p.get(k, 0.0) for p in phases[1:] for k in FOLLOWER_OWN)
    return (transit - followers) * 1000 / len(phases)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--backends", default="torch-cpu,torch-cpu",
                        help="one per stage; rank 0 first")
    parser.add_argument("--devices", help="CUDA device per stage, e.g. 0,1 (two GPUs) or 0,0")
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model_dir = checkpoint(args.model, args.preset)
    backends = args.backends.split(",")
    layers = n_layers(model_dir)
    stages = even_stages(layers, len(backends))
    streams = [int(s) for s in args.streams.split(",")]
    # The driver opens every stream's 16-token prompt in one round.
    shape = dict(parallel=max(streams), context=args.prompt + args.steps + 64,
                 chunk=max(args.chunk, 16 * max(streams)))
    rank_env = {}
    if args.devices:
        for rank, device in enumerate(args.devices.split(",")):
            if rank:
                rank_env[rank] = {"CUDA_VISIBLE_DEVICES": device}

    threads = max(1, (os.cpu_count() or 1) // len(stages))
    if any(b.startswith("torch-") for b in backends):
        import torch

        # Like for like: the whole model gets the CPU threads each stage gets (launch's
        # split), so the comparison isolates the ring, not a thread count.
        torch.set_num_threads(threads)
    wholes = {}
    for backend in dict.fromkeys(backends):  # each backend alone, in placement order
        wholes[backend] = measure(whole_runner(model_dir, backend=backend, **shape), streams,
                                  args.steps, args.prompt, args.chunk, args.repeats)
        print(f"# whole on {backend}: {wholes[backend]}", flush=True)
    with tempfile.TemporaryDirectory() as run_dir:
        with local_pipeline(model_dir, stages, Path(run_dir), backends=backends,
                            rank_env=rank_env, extra_env={"FLEET_LOG_LEVEL": "debug"},
                            **shape) as runner:
            split = measure(runner, streams, args.steps, args.prompt, args.chunk,
                            args.repeats)
            row_format = runner.stage.row_format
            rank0_timings = list(runner.timings)
        phases, prompt_phases = [phase_medians(rank0_timings)], []
        if args.chunk == args.prompt:  # one chunk: where the split's prompt time goes
            prompt_phases = [phase_medians(rank0_timings, args.chunk)]
        for rank in range(1, len(stages)):
            events = [e for e in log_records(Path(run_dir) / f"rank{rank}.log")
                      if e.get("event") == "round timing"]
            phases.append(phase_medians(events))
            if prompt_phases:
                prompt_phases.append(phase_medians(events, args.chunk))
    print(f"# split {stages} on {backends}: {split}", flush=True)
    hops = len(stages)  # rank 0 -> 1 -> ... -> last -> rank 0
    rows = []
    for backend, whole in wholes.items():
        for n in streams:
            key = f"decode{n}"
            rows.append([f"decode ms/step, {n} stream(s)", backend, whole[key], split[key],
                         split[key] / whole[key], (split[key] - whole[key]) * 1000 / hops])
        rows.append([f"prompt ms, {args.prompt} tokens", backend, whole["prompt"],
                     split["prompt"], split["prompt"] / whole["prompt"], "-"])
    for title, of in (("a one-stream decode round", phases),
                      (f"a {args.chunk}-row prompt round", prompt_phases)):
        if of:
            table(f"where {title}'s time goes, per stage (median ms)", ["rank", "phases"],
                  [[rank, ", ".join(f"{k} {v:.3f}" for k, v in p.items())]
                   for rank, p in enumerate(of)])
    placement = ", ".join(f"{a}:{b}@{be}" for (a, b), be in zip(stages, backends, strict=True))
    table(f"split vs whole, {model_dir.name}, {placement}",
          ["measure", "whole on", "whole", "split", "split / whole", "µs per boundary"], rows)

    link = {}
    link_rows = []
    for rows_per_frame in dict.fromkeys((1, 8, args.chunk)):
        size = row_format.nbytes(rows_per_frame)
        link[rows_per_frame] = r = link_vs_raw(size, frames_for(size))
        link_rows.append([rows_per_frame, size, r["link_hop_us"], r["raw_hop_us"],
                          r["raw_hop_us"] / r["link_hop_us"], r["link_gbs"], r["raw_gbs"],
                          r["link_gbs"] / r["raw_gbs"]])
    table("stage link vs raw loopback socket, the two ends in two processes (same bytes)",
          ["rows a frame", "bytes", "link hop µs", "raw hop µs", "raw / link (hop)",
           "link GB/s", "raw GB/s", "link / raw (stream)"], link_rows)
    issue16 = [["decode hop per boundary, µs (goal ≤ 60 on CPU loopback, ≤ 100 on one GPU)",
                hop_per_boundary_us(phases)],
               ["link / raw, one-row frames: hop (goal ≥ 0.8)",
                link[1]["raw_hop_us"] / link[1]["link_hop_us"]],
               ["link / raw, one-row frames: stream", link[1]["link_gbs"] / link[1]["raw_gbs"]],
               [f"link / raw, {args.chunk}-row frames: stream",
                link[args.chunk]["link_gbs"] / link[args.chunk]["raw_gbs"]]]
    if args.chunk == args.prompt:  # one chunk: the prompt penalty against its allowance
        # The chunk's rows cross each boundary but the last; one row per stream comes back.
        wire_ms = ((len(stages) - 1) * row_format.nbytes(args.chunk) / link[args.chunk]["link_gbs"]
                   / 1e6 + link[1]["link_hop_us"] / 1000)
        for backend, whole in wholes.items():
            issue16 += [[f"prompt split / whole, one {args.chunk}-row chunk, whole on {backend}",
                         split["prompt"] / whole["prompt"]],
                        [f"  allowed: 1.06 + the wire at the link's speed ({wire_ms:.3f} ms)",
                         1.06 + wire_ms / whole["prompt"]]]
    table("issue 16: the hop and the prompt penalty", ["measure", "value"], issue16)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Decode and prompt speed of the Qwen3.5 hybrid on one CUDA device, at a 27B-like shape.

A random bfloat16 checkpoint with hidden 5120 and the 27B's head shapes, but only the
first `--layers` layers (the repeating pattern is three DeltaNet layers then one attention
layer), so it fits a small disk; figures are per round and per layer. Rounds go through
the stage as a server's would (layers, head, logits to the host), decode replayed as CUDA
graphs and eagerly, with each kernel set for the gated delta rule asked for (ours, and
fla-core's where installed). The anchors, in the same run: the weight bytes read once per
step at the device's nominal memory bandwidth, and transformers' `generate` on the same
checkpoint (`--no-transformers` skips it).

`--split` instead runs the same rounds whole and in two stages on this one GPU (the cut
after a DeltaNet layer): a chunked prompt and greedy decode rounds for 1 and 4 streams,
every round's logits compared byte for byte, each process's GPU memory, and decode ms a
round whole against split (the hop's cost; overlap needs two devices).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import ROOT, add_unstacked, projections_apart
from engine.backends.base import StageSpec, load_stage
from engine.backends.pytorch.delta_kernels import fla_unavailable
from engine.checkpoint.maker import CheckpointSpec, make_checkpoint
from engine.checkpoint.reader import open_checkpoint
from engine.harness.driver import RoundDriver
from engine.pipeline.runner import LocalRunner

SHAPE = dict(family="qwen3_5", hidden_size=5120, intermediate_size=17408,
             num_attention_heads=24, num_key_value_heads=4, head_dim=256, vocab_size=248320,
             linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
             linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
             dtype="bfloat16", rope_theta=10_000_000.0, max_position_embeddings=32768)
H200_BYTES_PER_S = 4.8e12  # nominal HBM3e bandwidth


def hybrid_checkpoint(layers: int, out: Path | None = None) -> Path:
    """The 27B-like checkpoint of `layers` layers, made once under build/ (or at `out`)."""
    out = out or ROOT / "build" / f"bench-qwen3_5-27b-like-{layers}"
    if not (out / "config.json").exists():
        print(f"# making {out}", flush=True)
        start = time.perf_counter()
        # One shard a core at most, written at once.
        make_checkpoint(out, CheckpointSpec(**SHAPE, num_hidden_layers=layers,
                                            shards=max(1, min(layers, os.cpu_count() or 1))),
                        overwrite=True)
        print(f"# made in {time.perf_counter() - start:.0f} s", flush=True)
    return out


def weight_bytes(model_dir: Path) -> int:
    """Bytes a decode step reads: every weight but the embedding table (rows are gathered)."""
    checkpoint = open_checkpoint(model_dir)
    return sum(int(np.prod(checkpoint.tensor_shape(n))) * 2 for n in checkpoint.tensor_names()
               if not n.endswith("embed_tokens.weight"))


def decode_ms(driver: RoundDriver, streams: int, steps: int, vocab: int,
              conversation: int = 64, chunk: int = 512) -> float:
    """Decode ms a round for `streams` streams, each `conversation` tokens long already (its
    prompt, taken in rounds of at most `chunk` rows over all streams, as a server's are)."""
    rng = np.random.default_rng(streams)
    prompts = {s: rng.integers(3, vocab, conversation).tolist() for s in range(streams)}
    rows = max(1, chunk // streams)
    for first in range(0, conversation, rows):
        driver.round({s: p[first:first + rows] for s, p in prompts.items()})
    feeds = {s: [int(rng.integers(3, vocab))] for s in range(streams)}
    for _ in range(3):  # captures, warm-up
        driver.round(feeds)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        driver.round(feeds)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    driver.close(list(prompts))
    return elapsed / steps * 1e3


def prompt_tokens_per_s(driver: RoundDriver, tokens: int, chunk: int, vocab: int) -> float:
    ids = np.random.default_rng(0).integers(3, vocab, tokens).tolist()
    driver.round({0: ids[:chunk]})  # warm-up
    driver.close([0])
    torch.cuda.synchronize()
    start = time.perf_counter()
    for first in range(0, tokens, chunk):
        driver.round({0: ids[first:first + chunk]})
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    driver.close([0])
    return tokens / elapsed


def transformers_decode_ms(model_dir: Path, streams: int, steps: int, vocab: int) -> float:
    """transformers' `generate`, greedy, from 64-token prompts: decode ms a step, the time
    of `steps` + 1 new tokens less the time of 1 (the prompt and the first token)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model = model.to("cuda").eval()
    ids = torch.tensor(np.random.default_rng(streams).integers(3, vocab, (streams, 64)),
                       device="cuda")

    def timed(new: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(4)  # warm-up
    first, whole = timed(1), timed(steps + 1)
    return (whole - first) / steps * 1e3


def profile_eager_decode(driver: RoundDriver, vocab: int) -> None:
    """Where an eager decode round's time goes: the ten costliest ops by their own CPU time."""
    from torch.profiler import ProfilerActivity, profile

    feeds = {s: [int(t)] for s, t in enumerate(np.random.default_rng(1).integers(3, vocab, 8))}
    driver.round({s: [t[0]] * 8 for s, t in feeds.items()})
    driver.round(feeds)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            driver.round(feeds)
        torch.cuda.synchronize()
    driver.close(list(feeds))
    print("# eager decode rounds, 8 streams, 3 rounds: the ten costliest ops by self CPU time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))


def gpu_memory_mib() -> dict[int, int]:
    """Each process's memory on the GPU (pid -> MiB), as nvidia-smi reports it."""
    import subprocess

    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         check=True).stdout
    return {int(pid): int(mib) for pid, mib in
            (line.split(",") for line in out.strip().splitlines() if line)}


def split_rounds(driver: RoundDriver, streams: int, vocab: int) -> tuple[list[bytes], float]:
    """A 300-token prompt a stream in chunks of 128, then 16 greedy rounds: every round's
    logits' bytes, and decode ms a round over the last 12."""
    rng = np.random.default_rng(streams)
    prompts = {s: rng.integers(3, vocab, 300).tolist() for s in range(streams)}
    seen: list[bytes] = []
    last = {}
    for first in range(0, 300, 128):
        last = driver.round({s: p[first:first + 128] for s, p in prompts.items()})
        seen.extend(last[s].tobytes() for s in sorted(last))
    times = []
    for _ in range(16):
        feeds = {s: [int(np.argmax(row))] for s, row in last.items()}
        start = time.perf_counter()
        last = driver.round(feeds)
        times.append(time.perf_counter() - start)
        seen.extend(last[s].tobytes() for s in sorted(last))
    driver.close(list(prompts))
    return seen, float(np.median(times[4:])) * 1e3


def split_against_whole(out: Path, layers: int, context: int, vocab: int) -> None:
    import tempfile

    from engine.harness.local_pipeline import local_pipeline, whole_runner

    cut = 1  # right after the first DeltaNet layer: the recurrent state crosses nothing
    # A round carries up to 4 x 128 prompt rows: the stages take them in one batch.
    whole = whole_runner(out, backend="torch-cuda", parallel=4, context=context, chunk=512)
    driver = RoundDriver(whole)
    expected = {n: split_rounds(driver, n, vocab) for n in (1, 4)}
    whole_mib = gpu_memory_mib().get(os.getpid(), 0)
    del driver, whole
    torch.cuda.empty_cache()
    print(f"# whole: {whole_mib} MiB on the GPU (this process)", flush=True)
    print("| streams | rounds compared | byte-identical | decode ms whole | split | "
          "µs per boundary (2 hops) |")
    print("|---|---|---|---|---|---|")
    with (tempfile.TemporaryDirectory() as run_dir,
          local_pipeline(out, [(0, cut), (cut, layers)], Path(run_dir),
                         backends=["torch-cuda"] * 2, parallel=4, context=context,
                         chunk=512) as runner):
        driver = RoundDriver(runner)
        for n in (1, 4):
            got, ms = split_rounds(driver, n, vocab)
            want, whole_ms = expected[n]
            same = sum(a == b for a, b in zip(got, want, strict=True))
            print(f"| {n} | {len(want)} | {same}/{len(want)} | {whole_ms:.2f} | {ms:.2f} | "
                  f"{(ms - whole_ms) * 500:.0f} |", flush=True)
        memory = gpu_memory_mib()
    print(f"# split {0}:{cut} and {cut}:{layers}: rank 0 {memory.get(os.getpid(), 0)} MiB, "
          f"rank 1 {sum(v for k, v in memory.items() if k != os.getpid())} MiB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--context", type=int, default=4096,
                        help="positions per slot, as FLEET_CONTEXT configures a stage")
    parser.add_argument("--kernels", default="torch,fla",
                        help="gated delta rule kernels to compare (FLEET_DELTA_KERNEL values)")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="profile eager decode rounds (where their fixed cost goes)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--split", action="store_true",
                        help="whole against two stages on this GPU: bytes, memory, the hop")
    parser.add_argument("--conversation", type=int, default=64,
                        help="tokens each stream has already seen when decode is timed")
    parser.add_argument("--make-only", action="store_true",
                        help="write the checkpoint (if it is not there) and stop")
    add_unstacked(parser)
    args = parser.parse_args()
    if args.unstacked:
        projections_apart()
    out = hybrid_checkpoint(args.layers, args.out)
    if args.make_only:
        return
    size = weight_bytes(out)
    print(f"# {args.layers} layers, {size / 2**30:.2f} GiB of bf16 weights read a step; floor "
          f"{size / H200_BYTES_PER_S * 1e3:.3f} ms a step at {H200_BYTES_PER_S / 1e12} TB/s")
    if args.split:
        split_against_whole(out, args.layers, args.context, SHAPE["vocab_size"])
        return
    print(f"# context {args.context} positions a slot, 8 slots; decode timed after "
          f"{args.conversation}-token conversations")
    print("| kernels | decode | streams | ms a round | ms a layer a round (ends included) |")
    print("|---|---|---|---|---|")
    for kernels in args.kernels.split(","):
        if kernels == "fla" and (why := fla_unavailable(torch.device("cuda"))):
            print(f"# fla: skipped: {why}")
            continue
        for graphs in (True, False):
            stage = load_stage(StageSpec(out, (0, args.layers), "torch-cuda", 8, args.context,
                                         512, graphs, delta_kernel=kernels))
            driver = RoundDriver(LocalRunner(stage))
            for streams in (1, 8):
                ms = decode_ms(driver, streams, args.steps, SHAPE["vocab_size"], args.conversation)
                label = "CUDA graphs" if graphs else "eager"
                print(f"| {kernels} | {label} | {streams} | {ms:.2f} | {ms / args.layers:.3f} |",
                      flush=True)
            if graphs:
                rate = prompt_tokens_per_s(driver, 2048, 512, SHAPE["vocab_size"])
                print(f"# {kernels}: prompt: 2048 tokens in chunks of 512: {rate:,.0f} tokens/s",
                      flush=True)
            elif args.profile:
                profile_eager_decode(driver, SHAPE["vocab_size"])
            del driver, stage
            torch.cuda.empty_cache()
    if not args.no_transformers:
        for streams in (1, 8):
            ms = transformers_decode_ms(out, streams, args.steps, SHAPE["vocab_size"])
            print(f"| transformers generate | eager | {streams} | {ms:.2f} | "
                  f"{ms / args.layers:.3f} |", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

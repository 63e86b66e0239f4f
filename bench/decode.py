"""Decode speed of our engine against the reference implementation, side by side in one run.

    python bench/decode.py --preset demo --backend torch-cpu --batches 1,8
    python bench/decode.py --preset 8b --backend torch-cuda --batches 1,8     # on a GPU
    python bench/decode.py --preset demo --backend mlx-cpu                   # vs mlx-lm

PyTorch backends are compared with transformers' `generate`, MLX backends with mlx-lm's
`generate_step`, on the same checkpoint, device and dtype. Our decode rounds are timed
directly after an untimed prompt round (greedy, the logits brought to the host each step,
as serving does); the references' time per step is the difference between generating
N + 1 tokens and 1 token, divided by N, so prompt processing cancels out. On CUDA it also prints ms per token against the
floor set by weight bytes / memory bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import checkpoint, median_s, table
from engine.harness.driver import RoundDriver
from engine.harness.local_pipeline import whole_runner


def prompts(batch: int, length: int, vocab: int) -> dict[int, list[int]]:
    rng = np.random.default_rng(0)
    return {s: rng.integers(0, min(vocab, 256), length).tolist() for s in range(batch)}


def ours_ms_per_step(model_dir: Path, backend: str, batch: int, steps: int, prompt: int,
                     repeats: int, cuda_graphs: bool = True) -> float:
    """Decode rounds timed directly: the prompt round runs first, untimed."""
    runner = whole_runner(model_dir, backend=backend, parallel=batch,
                          context=prompt + steps + 8, chunk=prompt * batch,
                          cuda_graphs=cuda_graphs)
    driver = RoundDriver(runner)
    vocab = runner.stage.config.vocab_size
    per_step = []
    for _ in range(repeats + 1):  # the first pass warms up
        logits = driver.round(prompts(batch, prompt, vocab))
        start = time.perf_counter()
        for _ in range(steps):
            logits = driver.round({s: [int(np.argmax(row))] for s, row in logits.items()})
        per_step.append((time.perf_counter() - start) * 1000 / steps)
        driver.close(list(range(batch)))
    return statistics.median(per_step[1:])


def transformers_ms_per_step(model_dir: Path, device: str, batch: int, steps: int, prompt: int,
                             repeats: int) -> float:
    import torch
    import transformers

    dtype = json.loads((model_dir / "config.json").read_text()).get("dtype", "float32")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    ids = torch.tensor(list(prompts(batch, prompt, model.config.vocab_size).values()),
                       device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def generate(n: int) -> None:
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0)

    whole = median_s(lambda: generate(steps + 1), repeats=repeats, sync=sync)
    first = median_s(lambda: generate(1), repeats=repeats, sync=sync)
    return (whole - first) * 1000 / steps


def mlx_lm_ms_per_step(model_dir: Path, steps: int, prompt: int, repeats: int) -> float:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _tokenizer = load(str(model_dir))
    ids = mx.array(prompts(1, prompt, 256)[0])

    def generate(n: int) -> None:
        for i, (token, _logprobs) in enumerate(generate_step(ids, model, max_tokens=n)):
            mx.eval(token)
            if i + 1 == n:
                break

    whole = median_s(lambda: generate(steps + 1), repeats=repeats)
    first = median_s(lambda: generate(1), repeats=repeats)
    return (whole - first) * 1000 / steps


def weight_bytes_per_step(model_dir: Path) -> int:
    """Bytes a decode step must read: every weight but the embedding table (one row is read)."""
    from engine.checkpoint.reader import open_checkpoint

    ckpt = open_checkpoint(model_dir)
    total = 0
    for name in ckpt.tensor_names():
        if name == "model.embed_tokens.weight" and "lm_head.weight" in ckpt.weight_map:
            continue
        shape = ckpt.tensor_shape(name)
        itemsize = {"F32": 4, "BF16": 2, "F16": 2, "U32": 4}.get(ckpt.tensor_dtype(name), 2)
        total += int(np.prod(shape)) * itemsize
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--preset", default="demo", help="tiny, demo or 8b (when no --model)")
    parser.add_argument("--backend", default="torch-cpu")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0,
                        help="memory bandwidth for the floor (H200 HBM3e: 4800 GB/s)")
    parser.add_argument("--no-reference", action="store_true")
    args = parser.parse_args()
    model_dir = checkpoint(args.model, args.preset)
    device = args.backend.split("-", 1)[1]
    reference = "mlx-lm" if args.backend.startswith("mlx") else "transformers"
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        ours = ours_ms_per_step(model_dir, args.backend, batch, args.steps, args.prompt,
                                args.repeats)
        row = [args.backend, batch, ours, batch * 1000 / ours]
        if args.no_reference or (reference == "mlx-lm" and batch != 1):
            row += ["-", "-", "-"]
        else:
            ref = (mlx_lm_ms_per_step(model_dir, args.steps, args.prompt, args.repeats)
                   if reference == "mlx-lm" else
                   transformers_ms_per_step(model_dir, device, batch, args.steps, args.prompt,
                                            args.repeats))
            row += [ref, batch * 1000 / ref, ref / ours]
        rows.append(row)
        print(f"# batch {batch}: {row}", flush=True)
    table(f"decode, {model_dir.name}, {args.steps} steps after a {args.prompt}-token prompt",
          ["backend", "batch", "ours ms/step", "ours tok/s", f"{reference} ms/step",
           f"{reference} tok/s", f"speed-up vs {reference}"], rows)
    if device == "cuda":
        eager = ours_ms_per_step(model_dir, args.backend, 1, args.steps, args.prompt,
                                 args.repeats, cuda_graphs=False)
        floor_ms = weight_bytes_per_step(model_dir) / (args.bandwidth_gbs * 1e9) * 1000
        table("decode against the memory-bandwidth floor (batch 1)",
              ["weight bytes / bandwidth, ms", "ours ms/token (CUDA graphs)",
               "ours ms/token (eager)", "fraction of the floor (graphs)",
               "fraction of the floor (eager)"],
              [[floor_ms, rows[0][2], eager, floor_ms / rows[0][2], floor_ms / eager]])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Decode speed of our MLX stage against mlx-lm's own model, step by step in one run.

    python bench/mlx_vs_mlx_lm.py                       # demo and wide shapes, float32 and bfloat16
    python bench/mlx_vs_mlx_lm.py --shapes demo --dtypes bfloat16 --steps 64 --repeats 5

One stream, one conversation of `--prompt` tokens then `--steps` greedy decode steps
(100 tokens in all by default), on the CPU. Ours runs the whole model as one stage through
`load_stage` and a `RoundDriver` (the lane host's own round builder), so each step pays
what serving pays: the round's index arrays, the layers, the head and the logits brought to
the host. mlx-lm's step is its model called on one token with its own KV cache and the
last row's logits brought to the host the same way. Both sides pick the next token with
numpy's argmax from their own logits, and their steps alternate (ours, then mlx-lm's) so a
busy machine's slow spells fall on both alike. The ratio is ours / mlx-lm: below 1 is
faster than mlx-lm.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, table
from engine.backends.base import StageSpec, load_stage
from engine.checkpoint.maker import PRESETS, CheckpointSpec, make_checkpoint
from engine.harness.driver import RoundDriver
from engine.pipeline.runner import LocalRunner

SHAPES: dict[str, CheckpointSpec] = {
    "demo": PRESETS["demo"],
    # Four times the demo's width: matmuls start to outweigh per-step host work.
    "wide": dataclasses.replace(PRESETS["demo"], hidden_size=1024, intermediate_size=2816,
                                num_attention_heads=16, num_key_value_heads=4, head_dim=64),
}


def checkpoint_for(shape: str, dtype: str) -> Path:
    out = ROOT / "build" / f"bench-mlx-{shape}-{dtype}"
    if not (out / "config.json").exists():
        make_checkpoint(out, dataclasses.replace(SHAPES[shape], dtype=dtype), overwrite=True)
    return out


class Ours:
    def __init__(self, model_dir: Path, layers: int, context: int) -> None:
        spec = StageSpec(model_dir, (0, layers), "mlx-cpu", 1, context, context)
        self.driver = RoundDriver(LocalRunner(load_stage(spec)))

    def prompt(self, ids: list[int]) -> int:
        return int(np.argmax(self.driver.round({0: ids})[0]))

    def step(self, token: int) -> int:
        return int(np.argmax(self.driver.round({0: [token]})[0]))

    def close(self) -> None:
        self.driver.close([0])


class MlxLm:
    def __init__(self, model_dir: Path) -> None:
        from mlx_lm import load

        self.model, _tokenizer = load(str(model_dir))
        self.cache: list = []

    def feed(self, ids: list[int]) -> int:
        """`ids` after what the cache holds: the greedy next token."""
        import mlx.core as mx

        logits = self.model(mx.array([ids], dtype=mx.int32), cache=self.cache)[0, -1]
        return int(np.argmax(np.array(logits.astype(mx.float32), copy=True)))  # on the host

    def reset(self) -> None:
        """A fresh KV cache: a new conversation."""
        from mlx_lm.models.cache import make_prompt_cache

        self.cache = make_prompt_cache(self.model)

    def prompt(self, ids: list[int]) -> int:
        self.reset()
        return self.feed(ids)

    def step(self, token: int) -> int:
        return self.feed([token])

    def close(self) -> None:
        self.cache = []


def lockstep_pass(ours: Ours, theirs: MlxLm, ids: list[int], steps: int) -> tuple[float, float]:
    """Median ms/step of each side over one conversation, their steps alternating (a median,
    not a mean: on a shared machine a few steps land on another process's burst)."""
    tokens = [ours.prompt(ids), theirs.prompt(ids)]
    spent: list[list[float]] = [[], []]
    for _ in range(steps):
        for side, decoder in enumerate((ours, theirs)):
            start = time.perf_counter()
            tokens[side] = decoder.step(tokens[side])
            spent[side].append(time.perf_counter() - start)
    ours.close()
    theirs.close()
    return statistics.median(spent[0]) * 1000, statistics.median(spent[1]) * 1000


def measure(shape: str, dtype: str, prompt: int, steps: int, repeats: int
            ) -> tuple[float, float, float]:
    """Median ms/step of ours and mlx-lm's, and the median of the per-pass ratios."""
    import mlx.core as mx

    model_dir = checkpoint_for(shape, dtype)
    mx.set_default_device(mx.cpu)
    ours = Ours(model_dir, SHAPES[shape].num_hidden_layers, prompt + steps + 8)
    theirs = MlxLm(model_dir)
    ids = np.random.default_rng(0).integers(0, 256, prompt).tolist()
    lockstep_pass(ours, theirs, ids, steps)  # warm-up
    passes = [lockstep_pass(ours, theirs, ids, steps) for _ in range(repeats)]
    return (statistics.median(p[0] for p in passes), statistics.median(p[1] for p in passes),
            statistics.median(p[0] / p[1] for p in passes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="demo,wide", help=f"of {sorted(SHAPES)}")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompt", type=int, default=20, help="prompt tokens")
    parser.add_argument("--steps", type=int, default=80, help="decoded tokens timed")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            ours_ms, theirs_ms, ratio = measure(shape, dtype, args.prompt, args.steps,
                                                args.repeats)
            rows.append([shape, dtype, ours_ms, theirs_ms, round(ratio, 2)])
    table(f"MLX decode on the CPU, 1 stream, {args.prompt} + {args.steps} tokens "
          f"(load average {os.getloadavg()[0]:.2f})",
          ["shape", "dtype", "ours ms/token", "mlx-lm ms/token", "ours / mlx-lm"], rows)


if __name__ == "__main__":
    main()

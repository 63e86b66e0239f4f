"""A torch-cpu stage's resident memory, 4-bit packed against dense, each in a fresh process
(issue 28: resident memory at the packed size).

    python bench/resident_memory.py                        # the issue's case (~1 GB of files)
    python bench/resident_memory.py --layers 4 --hidden 512 --vocab 32768    # a quick one

Makes a llama checkpoint (engine.checkpoint.maker; by default 16 layers, hidden 1536,
intermediate 2816, a tied 131,072-token vocabulary, bfloat16: 794 MiB) and its mlx-lm 4-bit
group-64 quantization (engine.checkpoint.quantize), then loads each as one whole-model
torch-cpu stage in its own process (so neither sees the other's freed memory), runs one
round of three prompt tokens (every dense weight is mmapped and only resident once a round
has read it) and reports the process's resident set after importing, after loading and
after the round, its peak, and the weights the stage holds (`Stage.weights_nbytes`). One
thread a process: the measure is memory, and the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import table

MIB = 1 << 20
# Run in a fresh interpreter: what one stage's process holds, step by step.
CHILD = """
import gc, json, resource, sys
import psutil
process = psutil.Process()
started = process.memory_info().rss
import torch
torch.set_num_threads(1)
from pathlib import Path
from engine.backends.base import StageSpec, load_stage
from engine.harness.driver import RoundDriver
from engine.pipeline.runner import LocalRunner
imported = process.memory_info().rss
model_dir, layers, parallel, context, chunk = sys.argv[1], *map(int, sys.argv[2:6])
stage = load_stage(StageSpec(Path(model_dir), (0, layers), "torch-cpu", parallel, context, chunk))
gc.collect()
loaded = process.memory_info().rss
RoundDriver(LocalRunner(stage)).round({0: [1, 2, 3]})
gc.collect()
print(json.dumps({"started": started, "imported": imported, "loaded": loaded,
                  "round": process.memory_info().rss, "weights": stage.weights_nbytes,
                  # ru_maxrss: KiB on Linux, bytes on macOS
                  "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                  * (1 if sys.platform == "darwin" else 1024),
                  "dynamo": "torch._dynamo" in sys.modules}))
"""


def make_pair(out: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """The dense bfloat16 checkpoint and its quantization, made under `out`."""
    from engine.checkpoint.maker import CheckpointSpec, make_checkpoint
    from engine.checkpoint.quantize import quantize_checkpoint

    spec = CheckpointSpec(family="llama", hidden_size=args.hidden,
                          intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                          vocab_size=args.vocab, dtype="bfloat16",
                          tie_word_embeddings=not args.untied, seed=1)
    dense = make_checkpoint(out / "dense", spec, overwrite=True)
    return dense, quantize_checkpoint(dense, out / f"q{args.bits}", args.bits, args.group)


def measure(model_dir: Path, args: argparse.Namespace) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(model_dir), str(args.layers),
                           str(args.parallel), str(args.context), str(args.chunk)],
                          cwd=ROOT, capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    return json.loads(done.stdout.splitlines()[-1])


def on_disk(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--untied", action="store_true", help="a head of its own")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--keep", type=Path, default=None,
                        help="make (or reuse) the checkpoints here instead of a temporary dir")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="resident-") as scratch:
        out = args.keep or Path(scratch)
        dense, packed = (out / "dense", out / f"q{args.bits}")
        if not (dense / "config.json").exists() or not (packed / "config.json").exists():
            print(f"# making the checkpoints in {out}", flush=True)
            dense, packed = make_pair(out, args)
        results = {"dense bfloat16": (on_disk(dense), measure(dense, args)),
                   f"{args.bits}-bit g{args.group} packed": (on_disk(packed),
                                                             measure(packed, args))}

    rows = []
    for name, (disk, r) in results.items():
        growth = r["round"] - r["imported"]
        rows.append([name, f"{disk / MIB:,.0f}", f"{r['weights'] / MIB:,.0f}",
                     f"{r['imported'] / MIB:,.0f}", f"{r['loaded'] / MIB:,.0f}",
                     f"{r['round'] / MIB:,.0f}", f"{growth / MIB:,.0f}",
                     f"{growth / r['weights']:.2f}", f"{r['peak'] / MIB:,.0f}"])
    shape = (f"llama, {args.layers} layers, hidden {args.hidden}, intermediate "
             f"{args.intermediate}, vocabulary {args.vocab:,}"
             f"{' untied' if args.untied else ' tied'}; one torch-cpu stage a process, 1 thread")
    table(f"Resident memory, MiB ({shape})",
          ["checkpoint", "on disk", "weights held", "resident after import", "after load",
           "after one round", "growth (round - import)", "growth / weights", "peak"], rows)
    (_, d), (_, p) = results.values()
    print(f"\npacked / dense: resident {p['round'] / d['round']:.2f}x, "
          f"growth {(p['round'] - p['imported']) / (d['round'] - d['imported']):.2f}x "
          f"(goal: resident <= 0.6x); torch._dynamo imported: dense {d['dynamo']}, "
          f"packed {p['dynamo']}")


if __name__ == "__main__":
    main()

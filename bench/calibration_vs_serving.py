"""Calibration's per-type figures against the same model's serving rounds, in one process.

    OMP_NUM_THREADS=1 python bench/calibration_vs_serving.py --preset small-hybrid \
        --backend mlx-cpu --checkpoints DIR

Any backend, dense or hybrid (bench/calibration.py is the dense torch-cpu one). Times, in
turn, round after round (each timed run right after an untimed one of the same point, as
the agent's calibration does, so load on a shared machine lands on all alike):

- calibration's timers (agent/stage_timer.py: the real stage class over a synthetic range
  of random weights, 2 layers all of one type, and rank 0's head), as `make_round("decode",
  context, 1)` and `make_round("head", ...)`: ms per layer of each type, and the head's;
- the checkpoint's own stages over the same decode layout (`run_layers_again`): each type's
  first run of layers in the model, and the mixed range [1, n), so a per-type figure is
  checked against real weights and the per-type sum against a mixed range;
- the whole model on one stage driven as serving drives it (engine/harness/driver.py's
  RoundDriver over a LocalRunner, `greedy_round`, as bench/decode.py's `Decoding`): one
  stream's decode rounds after a prompt of `--prompt-tokens` in chunks of `--chunk`, the
  conversation restarted before it outgrows `--context`, with `--kept` slots past
  `--parallel` as a fleet's prompt cache keeps.

Prints each figure (median ms) and the prediction for the whole model (the per-type
figures times the model's layers of each type, plus the head) against its serving rounds'
median and mean. The load average is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, table


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small-hybrid")
    p.add_argument("--model", type=Path, default=None, help="a checkpoint instead of the preset")
    p.add_argument("--checkpoints", type=Path, default=ROOT / "build")
    p.add_argument("--backend", default="mlx-cpu")
    p.add_argument("--context", type=int, default=320)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--kept", type=int, default=64, help="prompt-cache slots past --parallel")
    p.add_argument("--repeats", type=int, default=25)
    args = p.parse_args()

    from agent.stage_timer import StageTimer, decode_layout, random_row_bytes
    from bench.placement import checkpoint
    from engine.backends.base import StageSpec, load_stage
    from engine.config import ModelConfig
    from engine.harness.driver import RoundDriver
    from engine.pipeline.runner import LocalRunner

    if args.backend.startswith("torch-"):
        import torch

        if os.environ.get("OMP_NUM_THREADS"):
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    model = args.model or checkpoint(args.preset, args.checkpoints)
    raw = json.loads((model / "config.json").read_text())
    config = ModelConfig.from_dict(raw)
    types = config.layer_types
    n = config.num_hidden_layers
    slots = args.parallel + args.kept
    print(f"# load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
          flush=True)

    points: dict[str, tuple[object, int]] = {}  # name -> (one run, layers it runs)
    layout = decode_layout(args.context, 1)
    with tempfile.TemporaryDirectory(prefix="calibration-") as workdir:
        for layer_type in dict.fromkeys(types):
            timer = StageTimer(raw, args.backend, 2, args.parallel, args.context, args.chunk,
                               Path(workdir) / layer_type, layer_type=layer_type)
            points[f"calibration {layer_type}"] = (timer.make_round("decode", args.context, 1), 2)
        head = StageTimer(raw, args.backend, 2, args.parallel, args.context, args.chunk,
                          Path(workdir) / "head", layer_type=types[0], head=True)
        points["calibration head"] = (head.make_round("head", args.context, 1), 1)

    def bare(start: int, end: int):
        stage = load_stage(StageSpec(model, (start, end), args.backend, slots, args.context,
                                     args.chunk))
        x = stage.rows_from_bytes(random_row_bytes(1, config.hidden_size,
                                                   stage.row_format.name), 1)
        return lambda: stage.run_layers_again(x, layout)

    for layer_type in dict.fromkeys(types):
        start = next(i for i in range(1, n - 1) if types[i] == layer_type) \
            if layer_type in types[1:n - 1] else None
        if start is None:
            continue
        end = start
        while end < n - 1 and types[end] == layer_type:
            end += 1
        points[f"checkpoint {start}:{end} {layer_type}"] = (bare(start, end), end - start)
    points[f"checkpoint 1:{n} mixed"] = (bare(1, n), n - 1)

    whole = load_stage(StageSpec(model, (0, n), args.backend, slots, args.context, args.chunk))
    driver = RoundDriver(LocalRunner(whole))
    state: dict[str, dict[int, int] | None] = {"next": None}
    rng = random.Random(0)

    def serving_round() -> None:
        if state["next"] is None or whole.slots.slots[0].offset >= args.context - 2:
            if state["next"] is not None:
                driver.close([0])
            ids = [rng.randrange(config.vocab_size) for _ in range(args.prompt_tokens)]
            for at in range(0, args.prompt_tokens, args.chunk):
                state["next"] = driver.greedy_round({0: ids[at:at + args.chunk]})
        state["next"] = driver.greedy_round({0: [state["next"][0]]})

    points[f"serving 0:{n}, 1 stream"] = (serving_round, 1)

    samples: dict[str, list[float]] = {name: [] for name in points}
    for run, _ in points.values():
        for _ in range(3):
            run()
    for _ in range(args.repeats):
        for name, (run, layers) in points.items():
            run()
            started = time.perf_counter()
            run()
            samples[name].append((time.perf_counter() - started) * 1000 / layers)
    median = {name: statistics.median(s) for name, s in samples.items()}
    table(f"ms per layer (a head's, a serving round's: whole), median of {args.repeats} "
          f"({args.backend}, context {args.context}, 1 row)",
          ["point", "median", "mean", "fastest"],
          [[name, median[name], statistics.mean(s), min(s)] for name, s in samples.items()])
    counts = Counter(types)
    predicted = sum(counts[t] * median[f"calibration {t}"] for t in counts) + \
        median["calibration head"]
    served = samples[f"serving 0:{n}, 1 stream"]
    print(f"\npredicted 0:{n} from calibration's figures: {predicted:.1f} ms a token; served "
          f"{statistics.median(served):.1f} median ({(predicted / statistics.median(served) - 1) * 100:+.1f} %), "
          f"{statistics.mean(served):.1f} mean ({(predicted / statistics.mean(served) - 1) * 100:+.1f} %)")
    print(f"# load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The calibration's timer against the engine's own layers, side by side in one process.

    python bench/calibration.py                    # the `small` checkpoint, default threads
    python bench/calibration.py --threads 1

Loads the checkpoint as a torch-cpu engine stage does and builds the calibration's
timer (agent/stage_timer.py: the same stage class over a synthetic range of random weights)
at two layer counts: 2, the count the agent calibrates with, and the model's own. Then times one decode round of `rows` rows
over `--context` keys of each, in turn (each timed run right after an untimed one of the
same round, as the calibration does), so load on a shared machine lands on all of them
alike. Prints the median and fastest ms per layer of each and the timer's over the
engine's: a ratio near 1 says the timer runs what the engine runs; the gap between the
2-layer and the whole-model timer is the per-round fixed cost spread over 2 layers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import table
from bench.placement import checkpoint


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--rows", default="1,2", help="decode rows of a round, comma-separated")
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: its default)")
    args = p.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from agent.calibrate import CalibrationRequest, make_timer
    from agent.stage_timer import decode_layout, random_row_bytes
    from engine.config import FULL_ATTENTION
    from engine.harness.local_pipeline import whole_runner

    model = checkpoint(args.preset)
    raw = json.loads((model / "config.json").read_text())
    parallel = max(int(r) for r in args.rows.split(","))
    engine = whole_runner(model, parallel=parallel, context=args.context).stage
    n = engine.config.num_hidden_layers
    with tempfile.TemporaryDirectory() as workdir:
        timers = {k: make_timer(CalibrationRequest(config=raw, contexts=(args.context,),
                                                   batch_rows=parallel, chunk_rows=64,
                                                   layers=k), FULL_ATTENTION,
                                Path(workdir) / str(k))
                  for k in (2, n)}
    print(f"# threads {torch.get_num_threads()}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    out = []
    for rows in (int(r) for r in args.rows.split(",")):
        layout = decode_layout(args.context, rows)
        x = engine.rows_from_bytes(random_row_bytes(rows, engine.hidden_size,
                                                    engine.row_format.name), rows)

        def engine_round(layout=layout, x=x) -> None:
            engine.run_layers_again(x, layout)

        rounds = {f"engine {n} layers": (engine_round, n),
                  **{f"timer {k} layers": (t.make_round("decode", args.context, rows), k)
                     for k, t in timers.items()}}
        ms: dict[str, list[float]] = {name: [] for name in rounds}
        for _ in range(args.repeats):
            for name, (run, layers) in rounds.items():
                run()
                t0 = time.perf_counter()
                run()
                ms[name].append((time.perf_counter() - t0) * 1000 / layers)
        base = statistics.median(ms[f"engine {n} layers"])
        for name, seen in ms.items():
            out.append([rows, name, f"{statistics.median(seen):.2f}", f"{min(seen):.2f}",
                        f"{statistics.median(seen) / base:.2f}"])
    print(f"# load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    table(f"ms per layer of a decode round over {args.context} keys ({args.preset}, torch-cpu, "
          f"{torch.get_num_threads()} threads)",
          ["rows", "what", "median", "fastest", "median / engine's"], out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

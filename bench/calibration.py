"""The calibration's timer against the engine's own layers, side by side in one process.

    python bench/calibration.py                    # the `small` checkpoint, default threads
    python bench/calibration.py --threads 1

Loads the checkpoint as a torch-cpu engine stage does and builds the calibration's
synthetic timer (agent/calibrate.py's TorchTimer) at two layer counts: 2, the count the
agent calibrates with, and the model's own. Then times one decode round of `rows` rows
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
    from agent.calibrate import CalibrationRequest, TorchTimer, _round_layout
    from engine.backends.pytorch.kv_cache import RoundIndex
    from engine.harness.local_pipeline import whole_runner

    model = checkpoint(args.preset)
    request = CalibrationRequest(config=json.loads((model / "config.json").read_text()),
                                 contexts=(args.context,), batch_rows=2, chunk_rows=64)
    config = request.model_config()
    engine = whole_runner(model, parallel=max(int(r) for r in args.rows.split(",")),
                          context=args.context).stage.model
    n = config.num_hidden_layers
    timers = {2: TorchTimer(config, "torch-cpu", 2, 2, args.context),
              n: TorchTimer(config, "torch-cpu", n, 2, args.context)}
    print(f"# threads {torch.get_num_threads()}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    out = []
    for rows in (int(r) for r in args.rows.split(",")):
        index = RoundIndex.build(_round_layout("decode", args.context, rows),
                                 torch.device("cpu"), config.sliding_window)
        x = torch.randn(rows, config.hidden_size) * 0.5

        def engine_round(index=index, x=x) -> None:
            with torch.inference_mode():
                engine.run_layers(x, index)

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

"""Time to first token through the front door against straight to rank 0, in one fleet.

    OMP_NUM_THREADS=1 python bench/first_token_path.py --checkpoints DIR [--pin] \
        [--tokens 48]

A supervisor and two agents (`LocalFleet`), the generated `--preset` model on node-a alone
(torch-cpu), no calibration. Streamed completions of `--prompt-tokens` random ids (each its
own, so none finds the prompt cache), alternating: through the front door, and to rank 0's
URL with the replica's secret, as the front door sends them. Prints each path's times and
medians, and rank 0's own mean from admission to the first token
(`ringfleet_time_to_first_token_seconds`). `--pin` keeps node-a's agent and engine on the
first CPU, as `bench/placement.py --pin` does. The load average is printed at both ends.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, table
from bench.placement import FLEET, checkpoint, halves, load_average, prompt_ids
from supervisor.local import LocalFleet

METRIC = "ringfleet_time_to_first_token_seconds"


def first_token_ms(url: str, headers: dict[str, str], prompt: list[int], tokens: int) -> float:
    """One streamed completion: ms until its first event with a token; read to its end."""
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": tokens,
                       "stream": True, "ignore_eos": True}).encode()
    request = urllib.request.Request(url + "/completions", data=body, headers={
        "Content-Type": "application/json", **headers})
    started = time.perf_counter()
    first = None
    with urllib.request.urlopen(request, timeout=300) as reply:
        for line in reply:
            if first is None and line.startswith(b"data: {"):
                first = (time.perf_counter() - started) * 1000
    if first is None:
        raise RuntimeError("the stream carried no token")
    return first


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--checkpoints", type=Path, default=ROOT / "build")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--context", type=int, default=320)
    p.add_argument("--tokens", type=int, default=1, help="generated per request")
    p.add_argument("--requests", type=int, default=8, help="per path")
    p.add_argument("--pin", action="store_true", help="node-a on the first half of the CPUs")
    args = p.parse_args()
    print(f"# load average at the start: {load_average()}", flush=True)
    model = checkpoint(args.preset, args.checkpoints)
    config = json.loads((model / "config.json").read_text())
    vocab = config["vocab_size"]
    with (tempfile.TemporaryDirectory(prefix="bench-first-token-") as root,
          LocalFleet(Path(root), supervisor_flags=("--tick-s", "0.2",
                                                   "--calibration-budget-s", "0"),
                     node_cpus=halves(("node-a", "node-b")) if args.pin else None) as fleet):
        path = fleet.root / "fleet.yaml"
        path.write_text(FLEET.format(
            address=fleet.address, state_dir=fleet.state_dir, checkpoint=model,
            context=args.context, chunk=args.chunk, prompt_tokens=args.prompt_tokens,
            backend_b="torch-cpu", backends="torch-cpu",
            placement="    placement:\n      - {node: node-a, layers: "
                      f'"0:{config["num_hidden_layers"]}"}}\n'))
        fleet.fleetctl("apply", str(path), "--wait-s", "600")
        replica = fleet.wait_replica("bench", timeout_s=300)
        secret = (fleet.state_dir / "keys" / f"{replica['id']}.api").read_text().strip()
        rank0 = replica["url"].rstrip("/")
        paths = {"front door": (fleet.front_door_url, {}),
                 "rank 0": (rank0 + "/v1", {"Authorization": f"Bearer {secret}"})}
        sent, cold = 0, {}
        for name, (url, headers) in paths.items():  # the first rounds pay for initialisation
            sent += 1
            cold[name] = first_token_ms(url, headers, prompt_ids(vocab, args.prompt_tokens,
                                                                 sent), 4)
        seen: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.requests):
            for name, (url, headers) in paths.items():
                sent += 1
                seen[name].append(first_token_ms(url, headers, prompt_ids(
                    vocab, args.prompt_tokens, sent), args.tokens))
        metrics = urllib.request.urlopen(urllib.request.Request(
            rank0 + "/metrics", headers=paths["rank 0"][1]), timeout=30).read().decode()
    samples = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
               if line.startswith(METRIC + "_")}
    table(f"Time to first token, ms, a prompt of {args.prompt_tokens} tokens, {args.tokens} "
          f"generated ({args.preset}, torch-cpu, pinned: {'yes' if args.pin else 'no'})",
          ["path", "median", "each request"],
          [[name, f"{statistics.median(ms):.0f}", ", ".join(f"{x:.0f}" for x in ms)]
           for name, ms in seen.items()])
    print("# the first request through each path, cold, in that order (not in the table): "
          + ", ".join(f"{name} {ms:.0f} ms" for name, ms in cold.items()))
    print(f"# rank 0, admission to first token: mean "
          f"{samples[METRIC + '_sum'] / samples[METRIC + '_count'] * 1000:.0f} ms over "
          f"{samples[METRIC + '_count']:.0f} requests (the first, cold ones included)")
    print(f"# load average at the end: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

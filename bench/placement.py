"""How far the placement's prediction is from what a fleet measures, across placements.

    python bench/placement.py --node-b torch-cpu                          # `small`, torch x2
    python bench/placement.py --model build/smollm2-135m-instruct --node-b torch-cpu
    python bench/placement.py --preset small-hybrid --node-b mlx-cpu --prompt-tokens 256 \
        --chunk 64 --context 320                                          # MLX's chunks are slow

The first placement, `plan`, is the supervisor's own choice (no placement in fleet.yaml):
its measured row is what the plan's cut gives, beside the cuts the others force.

Starts a local fleet as real processes (a supervisor and two agents on loopback, node-a on
torch-cpu and node-b on mlx-cpu or torch-cpu (`--node-b`), each calibrated and their link
probed as in any fleet), then for each placement applies a fleet.yaml with that explicit
placement (context, chunk and prompt_tokens as given, parallel 2), waits for it to serve,
and sends through the front door, as streamed completions each of its own prompt of
`--prompt-tokens` random ids (so no prompt is found in the prompt cache, and decode rounds
attend over about the keys the calibration times): `--requests` single requests, their
time to first token taken by the client, then as many pairs of concurrent ones. From rank
0's decode rounds (`fleetctl status --json`, read after each phase): the singles' 1-row
rounds against the predicted decode ms/token of one stream, and every decode round of the
pairs (2 rows, or 1 where a split ring keeps a round of each stream in flight) against the
prediction at 2 streams; the median time to first token against the predicted one of a
`prompt_tokens` prompt (supervisor/speed.py over supervisor/ring_cost.py). Prints the
prediction's error, (predicted - measured) / measured, per figure, the mean absolute
error, and which placement measured fastest beside the plan's.

`--search` times the placement search itself instead, no fleet: `place` for a
Qwen3.5-27B-shaped model (64 layers, every 4th full attention, bfloat16) on 4 and 6 nodes,
both objectives, 3, 16 and 40 prompt chunks, nodes of unequal and of equal speed, with
room to spare (any cut fits, the widest search) and tight (about what the model needs):
the median ms of `--repeats` calls each (each a search: the answers `place` keeps are
dropped first), with the ring the search chose and its predicted ms. The supervisor runs this search
inside its control step, so it is a pause of the loop.

`--threads` (default 1) is each process's OpenMP threads (OMP_NUM_THREADS, which the agents
pass to their calibrations and engines): two agents on one small machine each running all
its cores spin against each other and against whatever else runs there, and a layer then
costs 2-3x what it does on one thread, by an amount that moves with the load, so the
calibration taken at one moment says little of the rounds run at another. 0: the
frameworks' defaults. The load average is printed at the start and the end.

`--pin` gives each node's agent (and so its calibration and engines) half of the CPUs, as
two machines would have their own: without it, a split ring's two stages and rank 0's
host work share every core, and two streams' rounds that a real fleet overlaps take turns.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, table
from engine.checkpoint.maker import PRESETS, CheckpointSpec, make_checkpoint
from supervisor.lifecycle import FAILED, STOPPED
from supervisor.local import LocalFleet

# Big enough that a layer's compute, not the per-round overhead, is most of a round on CPU.
SMALL = CheckpointSpec(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                       vocab_size=2048, dtype="float32", shards=2)
# The same size as a Qwen3.5 hybrid: 6 Gated DeltaNet layers and 2 attention layers.
SMALL_HYBRID = CheckpointSpec(family="qwen3_5", hidden_size=1024, intermediate_size=2816,
                              num_hidden_layers=8, num_attention_heads=8,
                              num_key_value_heads=2, head_dim=128, vocab_size=2048,
                              linear_num_key_heads=4, linear_num_value_heads=8,
                              linear_key_head_dim=64, linear_value_head_dim=64,
                              dtype="float32", shards=2)
GENERATED = {"small": SMALL, "small-hybrid": SMALL_HYBRID}
NODES = {"a": "node-a", "b": "node-b"}
# Placements as "a:0-4,b:4-8": node-a holds 0:4 (rank 0), node-b 4:8; {n} is the last layer.
DEFAULT_PLACEMENTS = ("plan", "a:0-{n}", "b:0-{n}", "a:0-{h},b:{h}-{n}", "b:0-{h},a:{h}-{n}",
                      "a:0-{q},b:{q}-{n}")
FLEET = """version: 1
supervisor: {{address: "{address}", state_dir: "{state_dir}"}}
nodes:
  - {{name: node-a, labels: {{backend: torch-cpu}}}}
  - {{name: node-b, labels: {{backend: {backend_b}}}}}
models:
  - id: bench
    checkpoint: {checkpoint}
    backends: [{backends}]
    context: {context}
    parallel: 2
    chunk: {chunk}
    prompt_tokens: {prompt_tokens}
{placement}"""


def checkpoint(preset: str, directory: Path) -> Path:
    out = directory / f"bench-{preset}"
    if not (out / "config.json").exists():
        print(f"# making the {preset!r} checkpoint in {out}", flush=True)
        make_checkpoint(out, GENERATED.get(preset) or PRESETS[preset], overwrite=True)
    return out


def parse_layout(text: str, n_layers: int) -> tuple[tuple[str, tuple[int, int]], ...]:
    """'a:0-4,b:4-8' as ((node, (start, end)), ...); 'plan': () (the supervisor's choice)."""
    if text == "plan":
        return ()
    text = text.format(n=n_layers, h=n_layers // 2, q=n_layers // 4)
    out = []
    for part in text.split(","):
        node, _, layers = part.partition(":")
        start, _, end = layers.partition("-")
        out.append((NODES[node], (int(start), int(end))))
    return tuple(out)


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def prompt_ids(vocab_size: int, tokens: int, seed: int) -> list[int]:
    """A prompt of exactly `tokens` ids, different for every seed, so that no request finds
    an earlier one's prompt in the prompt cache (a hit would skip the chunks timed)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(tokens)]


def complete(fleet: LocalFleet, prompt: list[int], tokens: int) -> float:
    """One streamed completion of `tokens` tokens; the seconds to its first token, as the
    client sees it (the front door, rank 0's queue and sampling included)."""
    from openai import OpenAI

    client = OpenAI(base_url=fleet.front_door_url, api_key="none", max_retries=0, timeout=600)
    started = time.perf_counter()
    first = None
    for event in client.completions.create(model="bench", prompt=prompt, max_tokens=tokens,
                                           stream=True, extra_body={"ignore_eos": True}):
        if first is None and event.choices:
            first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("the stream carried no token")
    return first


class Requests:
    """Each request's own prompt of `prompt_tokens` ids, so every one runs all its chunks."""

    def __init__(self, fleet: LocalFleet, vocab_size: int, prompt_tokens: int,
                 tokens: int) -> None:
        self.fleet, self.vocab_size = fleet, vocab_size
        self.prompt_tokens, self.tokens = prompt_tokens, tokens
        self.sent = 0

    def one(self, tokens: int | None = None) -> float:
        self.sent += 1
        prompt = prompt_ids(self.vocab_size, self.prompt_tokens, self.sent)
        return complete(self.fleet, prompt, tokens or self.tokens)


def decode_rounds(fleet: LocalFleet, replica_id: str, at_least: int,
                  wait_s: float = 30.0) -> tuple[dict, dict[int, tuple[float, int]]]:
    """The replica's speed report and its decode rounds so far (rows -> (ms in all, rounds)),
    once they number `at_least` and two reads of the supervisor (which reads rank 0's
    metrics every 2 s) agree, or after `wait_s`."""
    deadline = time.monotonic() + wait_s
    last = None
    while True:
        found = next((r for r in fleet.status()["replicas"] if r["id"] == replica_id), None)
        speed = found and found["speed"]
        rounds = {int(rows): (seen["ms_per_token"] * seen["rounds"], seen["rounds"])
                  for rows, seen in (speed or {}).get("measured", {}).items()}
        total = sum(n for _, n in rounds.values())
        if speed and ((total >= at_least and rounds == last) or time.monotonic() > deadline):
            return speed, rounds
        if not speed and time.monotonic() > deadline:
            raise RuntimeError(f"no speed for replica {replica_id} after {wait_s:g} s")
        last = rounds if total >= at_least else None
        time.sleep(2.5)


def measure(fleet: LocalFleet, layout, requests: Requests, count: int,
            measured_ids: set[str], remeasure: bool = False) -> dict:
    """Waits for `layout` to serve, runs `count` single requests, then `count` pairs. Returns
    the replica's speed report (its predictions), its stages, the single requests' times to
    first token in ms, and the decode rounds' mean ms and count of each phase: the singles'
    (one stream: 1-row rounds) and the pairs' (two streams: every decode round they ran, of
    2 rows, or of 1 where a split ring keeps one stream's round in flight on each stage).
    A replica in `measured_ids` is an earlier placement's, still serving until this one
    replaces it, perhaps with the same stages. `remeasure`: every node calibrated again
    once the replica serves, so its predictions stand on figures of this minute."""
    wanted = [(node, list(rng)) for node, rng in layout]
    replica = fleet.wait_replica("bench", timeout_s=600, where=lambda r: (
        r["id"] not in measured_ids
        and (not wanted or [(s["node"], s["layer_range"]) for s in r["stages"]] == wanted)))
    measured_ids.add(replica["id"])
    # The replica it replaces drains and exits on the same cores: timed beside it, this
    # one's first requests would pay for that exit.
    fleet.wait(lambda: all(r["state"] in (STOPPED, FAILED) for r in fleet.status()["replicas"]
                           if r["id"] != replica["id"]), 120, "the replaced replica to stop")
    if remeasure:
        fleet.fleetctl("remeasure", "--wait-s", "600")
        print_calibrations(fleet.status()["measured"]["calibrations"], "calibrated again")
    requests.one(4)  # warm: the first rounds pay for lazy initialisation
    ttft_ms = [requests.one() * 1000 for _ in range(count)]
    _, singles = decode_rounds(fleet, replica["id"], 3 + count * (requests.tokens - 1))
    for _ in range(count):
        pair = [threading.Thread(target=requests.one) for _ in range(2)]
        for thread in pair:
            thread.start()
        for thread in pair:
            thread.join()
    before = sum(n for _, n in singles.values())
    speed, after = decode_rounds(fleet, replica["id"], before + count * (requests.tokens - 1))
    pairs = {rows: (ms - singles.get(rows, (0.0, 0))[0], n - singles.get(rows, (0.0, 0))[1])
             for rows, (ms, n) in after.items()}

    def mean(phase: dict[int, tuple[float, int]]) -> tuple[float | None, int]:
        n = sum(k for _, k in phase.values())
        return (sum(ms for ms, _ in phase.values()) / n if n else None), n

    return dict(speed=speed, stages=[(s["node"], tuple(s["layer_range"]))
                                     for s in replica["stages"]],
                ttft_ms=ttft_ms, single=mean({1: singles.get(1, (0.0, 0))}),
                pairs=mean(pairs), pair_rows={r: (ms / n, n) for r, (ms, n) in sorted(pairs.items())
                                              if n})


def print_calibrations(calibrations: dict, label: str) -> None:
    """Each node's calibration as `status` holds it, a comment line each."""
    for key, timing in calibrations.items():
        if isinstance(timing, dict):
            node, backend = key.split("|")[1:3]
            print(f"# {label} {node} ({backend}): decode {timing['decode_ms_per_layer']:.3g}"
                  f" ms per layer at 1 row, {timing['decode_batch_ms_per_layer']:.3g} at 2 rows,"
                  f" a prompt chunk {timing['prefill_ms_per_layer']:.3g}; rank 0's head"
                  f" {timing.get('head_ms', 0):.3g} / {timing.get('head_batch_ms', 0):.3g}"
                  f" ms a round; host work beyond the layers {timing.get('round_ms', 0):.3g} ms"
                  f" a round, {timing.get('hop_ms', 0):.3g} a hop's end", flush=True)


def halves(nodes: tuple[str, str]) -> dict[str, set[int]]:
    """The CPUs this process may use, split between two nodes: the first half, the rest."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin needs at least two CPUs")
    half = len(cpus) // 2
    return {nodes[0]: set(cpus[:half]), nodes[1]: set(cpus[half:])}


def search_fleet(count: int, kind: str, seed: int = 64):
    """`count` nodes for the search bench: "unequal" speeds, or "equal"; "roomy" or "tight"
    memory (ending in either), every pair linked."""
    import random
    from dataclasses import replace

    from supervisor.placement import LayerTypeMs, LinkSnapshot, NodeSnapshot

    rng = random.Random(seed)
    names = [f"n{i}" for i in range(count)]
    gb = 1e9
    nodes = []
    for name in names:
        memory = 200 * gb if kind.endswith("roomy") else rng.uniform(16, 40) * gb
        linear, full = ((rng.uniform(40, 200), rng.uniform(60, 300)) if kind.startswith("unequal")
                        else (100.0, 150.0))
        node = NodeSnapshot(name, int(memory), "torch-cuda", 1.0, 1.2, linear, tuple(
            LinkSnapshot(peer, 0.3, 1.2e9) for peer in names if peer != name))
        nodes.append(replace(node, layer_type_ms=(
            LayerTypeMs("full_attention", 1.5, 1.8, full),)))
    return nodes


def search_times(repeats: int) -> int:
    """--search: the placement search's own time, no fleet."""
    from dataclasses import replace

    from bench.common import median_s
    from engine.checkpoint.maker import CheckpointSpec, config_json
    from supervisor.fleet_config import CheckpointPaths, ModelSpec
    from supervisor.memory import model_shape_from_config
    from supervisor.placement import DoesNotFit, forget_placements, place

    checkpoint = CheckpointSpec(family="qwen3_5", hidden_size=5120, intermediate_size=17408,
                                num_hidden_layers=64, num_attention_heads=24,
                                num_key_value_heads=4, head_dim=256, vocab_size=248320,
                                linear_num_key_heads=16, linear_num_value_heads=48,
                                linear_key_head_dim=128, linear_value_head_dim=128,
                                dtype="bfloat16")
    shape = model_shape_from_config(config_json(checkpoint), 2)
    base = ModelSpec("qwen3.5-27b", CheckpointPaths(all_nodes="/m"), ("torch-cuda",),
                     context=32768, parallel=1, chunk=2048)
    rows = []
    print(f"# load average at the start: {load_average()}", flush=True)
    for count in (4, 6):
        for kind in ("unequal-roomy", "unequal-tight", "equal-roomy"):
            nodes = search_fleet(count, kind)
            for objective, chunks in (("decode", 16), ("prompt", 3), ("prompt", 16),
                                      ("prompt", 40)):
                spec = replace(base, objective=objective, prompt_tokens=2048 * chunks)
                try:
                    found = place(spec, shape, nodes)
                except DoesNotFit:
                    continue
                def search(spec=spec, nodes=nodes) -> None:
                    forget_placements()  # the search itself, not the answer kept
                    place(spec, shape, nodes)

                seconds = median_s(search, repeats=repeats, warmup=0)
                rows.append([count, kind, objective, chunks, seconds * 1000,
                             " -> ".join(found.ring), found.objective_ms])
                print(f"# {rows[-1]}", flush=True)
    table("The placement search's time (Qwen3.5-27B-shaped, 64 layers)",
          ["nodes", "fleet", "objective", "chunks", "ms (median)", "ring", "predicted ms"],
          rows)
    print(f"# load average at the end: {load_average()}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small", choices=[*GENERATED, *PRESETS])
    p.add_argument("--model", type=Path, default=None,
                   help="a checkpoint to serve instead of the preset (e.g. SmolLM2's)")
    p.add_argument("--checkpoints", type=Path, default=ROOT / "build",
                   help="where a preset's checkpoint is made once (bench-<preset>)")
    p.add_argument("--node-b", default="mlx-cpu", choices=["mlx-cpu", "torch-cpu"],
                   help="node-b's backend (node-a runs torch-cpu)")
    p.add_argument("--placements", default=";".join(DEFAULT_PLACEMENTS),
                   help="';'-separated, each 'a:0-4,b:4-8' ({n}: layers, {h}: half, {q}: a "
                        "quarter), or first 'plan': no placement, the supervisor's own")
    p.add_argument("--requests", type=int, default=2, help="of each kind, per placement")
    p.add_argument("--tokens", type=int, default=48, help="generated per request")
    p.add_argument("--calibration-budget-s", type=float, default=40.0,
                   help="per node: a budget spent before the planned runs cut them short")
    p.add_argument("--prompt-tokens", type=int, default=1792,
                   help="every request's prompt (random ids, one set per request), and the "
                        "model's prompt_tokens: the prompt the time to first token is "
                        "predicted for")
    p.add_argument("--chunk", type=int, default=256, help="the model's prompt rows per round")
    p.add_argument("--context", type=int, default=2048,
                   help="the model's context: calibration times decode over this many keys, "
                        "so keep it near what the requests reach (prompt + --tokens)")
    p.add_argument("--threads", type=int, default=1,
                   help="OpenMP threads of every process of the fleet (0: the defaults)")
    p.add_argument("--pin", action="store_true",
                   help="each node's agent and engines on cores of their own (node-a the "
                        "first half of this process's CPUs, node-b the rest), as on two "
                        "machines: calibration and serving then see the same cores")
    p.add_argument("--remeasure", action="store_true",
                   help="calibrate every node again (`fleetctl remeasure`) before each "
                        "placement is measured, so each prediction stands on figures of that "
                        "minute: a shared machine's cores change speed by 10-30 %% over minutes")
    p.add_argument("--keep", type=Path, default=None,
                   help="run the fleet in this directory and keep it (its logs: the agents' "
                        "calibrations, the supervisor's plan) instead of a temporary one")
    p.add_argument("--search", action="store_true",
                   help="time the placement search itself (no fleet) instead")
    p.add_argument("--repeats", type=int, default=3, help="--search: calls per figure")
    args = p.parse_args()
    if args.search:
        return search_times(args.repeats)
    if args.prompt_tokens + args.tokens > args.context:
        p.error(f"a prompt of {args.prompt_tokens} and {args.tokens} tokens do not fit a "
                f"context of {args.context}")
    if args.threads:  # before LocalFleet copies the environment for its processes
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    print(f"# load average at the start: {load_average()}", flush=True)
    model = args.model or checkpoint(args.preset, args.checkpoints)
    from engine.config import ModelConfig

    config = ModelConfig.from_dict(json.loads((model / "config.json").read_text()))
    n = config.num_hidden_layers
    layouts = [parse_layout(text, n) for text in args.placements.split(";")]
    if () in layouts[1:]:
        p.error("'plan' must come first: later, the replica of the placement before it "
                "would be taken for it")
    decode_rows, ttft_rows, errors = [], [], []
    # placement -> (decode at 1 stream, at 2 streams, ttft)
    measured_ms: dict[str, tuple[float, float, float]] = {}
    calibrations: dict = {}
    flags = ("--tick-s", "0.2", "--drain-s", "5",
             "--calibration-budget-s", str(args.calibration_budget_s))
    with (contextlib.nullcontext(args.keep) if args.keep
          else tempfile.TemporaryDirectory(prefix="bench-placement-") as root,
          LocalFleet(Path(root), supervisor_flags=flags,
                     agent_settings=dict(heartbeat_interval_s=0.5),
                     node_cpus=halves(("node-a", "node-b")) if args.pin else None) as fleet):
        requests = Requests(fleet, config.vocab_size, args.prompt_tokens, args.tokens)
        measured_replicas: set[str] = set()
        for i, layout in enumerate(layouts):
            stages = "\n".join(f'      - {{node: {node}, layers: "{a}:{b}"}}'
                               for node, (a, b) in layout)
            placement = f"    placement:\n{stages}\n" if layout else ""
            path = fleet.root / f"fleet-{i}.yaml"
            path.write_text(FLEET.format(address=fleet.address, state_dir=fleet.state_dir,
                                         checkpoint=model, placement=placement,
                                         context=args.context, chunk=args.chunk,
                                         prompt_tokens=args.prompt_tokens,
                                         backend_b=args.node_b,
                                         backends=", ".join(dict.fromkeys(
                                             ["torch-cpu", args.node_b]))))
            fleet.fleetctl("apply", str(path), "--wait-s", "600")
            seen = measure(fleet, layout, requests, args.requests, measured_replicas,
                           args.remeasure)
            speed, chosen, ttft_ms = seen["speed"], seen["stages"], seen["ttft_ms"]
            name = " -> ".join(f"{node} {a}:{b}" for node, (a, b) in chosen)
            if not layout:
                name = f"the plan's: {name}"
            row: list[object] = [name]
            for predicted, (measured, rounds) in (
                    (speed.get("predicted_ms_per_token"), seen["single"]),
                    (speed.get("predicted_ms_per_token_parallel"), seen["pairs"])):
                error = (predicted - measured) / measured * 100 \
                    if predicted and measured else None
                row += [predicted or "-", "-" if measured is None else measured, rounds,
                        "-" if error is None else f"{error:+.1f}"]
                if error is not None:
                    errors.append(abs(error))
            row.append("; ".join(f"{r}: {ms:.1f} x {n}" for r, (ms, n) in
                                 seen["pair_rows"].items()) or "-")
            decode_rows.append(row)
            predicted_ttft = speed.get("predicted_ttft_ms")
            measured_ttft = statistics.median(ttft_ms)
            ttft_error = ((predicted_ttft - measured_ttft) / measured_ttft * 100
                          if predicted_ttft else None)
            ttft_rows.append([name, f"{predicted_ttft:.0f}" if predicted_ttft else "-",
                              f"{measured_ttft:.0f}",
                              ", ".join(f"{x:.0f}" for x in ttft_ms),
                              "-" if ttft_error is None else f"{ttft_error:+.1f}"])
            if ttft_error is not None:
                errors.append(abs(ttft_error))
            measured_ms[name] = (seen["single"][0] or math.inf, seen["pairs"][0] or math.inf,
                                 measured_ttft)
            print(f"# {name}: decode {row[1:]}; ttft {ttft_rows[-1][1:]}", flush=True)
            print(f"# load average: {load_average()}", flush=True)
        calibrations = fleet.status()["measured"]["calibrations"]
    print_calibrations(calibrations, "calibrated")  # the inputs the predictions stand on
    what = (f"{model.name if args.model else args.preset}, torch-cpu node-a, {args.node_b} "
            f"node-b, context {args.context}, chunk {args.chunk}")
    table(f"Predicted against measured decode ms/token ({what})",
          ["placement", "predicted 1 stream", "measured", "rounds", "error %",
           "predicted 2 streams", "measured", "rounds", "error %", "pairs' rounds: rows: ms x rounds"],
          decode_rows)
    table(f"Predicted against measured time to first token, ms, a prompt of "
          f"{args.prompt_tokens} tokens ({what})",
          ["placement", "predicted", "measured (median)", "each request", "error %"],
          ttft_rows)
    figures = ("decode at 1 stream", "decode at 2 streams (the plan's objective)",
               "time to first token")
    for i, what in enumerate(figures):
        fastest = min(measured_ms, key=lambda k: measured_ms[k][i])
        plan = next((k for k in measured_ms if k.startswith("the plan's")), None)
        if plan:
            print(f"# {what}: fastest measured {fastest} ({measured_ms[fastest][i]:.4g} ms); "
                  f"the plan's {measured_ms[plan][i]:.4g} ms")
    print(f"# load average at the end: {load_average()}; threads: "
          f"{args.threads or 'the defaults'}; pinned: {'yes' if args.pin else 'no'}; "
          f"calibrated again before each placement: {'yes' if args.remeasure else 'no'}")
    if errors:
        print(f"\nmean absolute error: {sum(errors) / len(errors):.1f} % "
              f"(largest {max(errors):.1f} %) over {len(errors)} figures")
    return 0


if __name__ == "__main__":
    sys.exit(main())

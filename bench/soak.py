"""Sustained load through the front door with an engine killed in the middle (issue 29).

    python bench/soak.py                      # 200 clients, 300 s, rank 0 of one replica killed at 150 s
    python bench/soak.py --clients 50 --seconds 60

A local fleet as real processes on loopback (a supervisor, two torch-cpu agents, the front
door as `fleet-front-door` of its own), the generated `demo` checkpoint with `replicas: 2`.
Every client asks again as soon as it has its answer (whole replies and streams in turn,
a bounded count each), through the front door. Halfway, one replica's rank 0 is killed
(SIGKILL). Counted: whole answers; 503s that carry Retry-After (the documented refusal, which
a client retries); streams cut mid-reply by the kill (their tokens were out, so only the
documented SSE error can end them); every other outcome is a lost request. Also the slowest answer (the goal:
no hang past the dead-ring time beyond what queueing costs), and the front door's resident
memory through the run (the goal: flat).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp
import psutil

from bench.common import checkpoint, table
from supervisor.local import LocalFleet

FLEET = """version: 1
supervisor: {{address: "{address}", state_dir: "{state_dir}"}}
nodes:
  - {{name: node-a, labels: {{backend: torch-cpu}}}}
  - {{name: node-b, labels: {{backend: torch-cpu}}}}
models:
  - id: demo
    checkpoint: {checkpoint}
    backends: [torch-cpu]
    context: 512
    parallel: 4
    chunk: 64
    replicas: 2
"""
MAX_REQUESTS_PER_CLIENT = 10_000


class Tally:
    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.lost: list[str] = []
        self.seconds: list[float] = []  # each whole answer's time

    def lose(self, why: str) -> None:
        self.outcomes["lost"] += 1
        if len(self.lost) < 20:
            self.lost.append(why)


async def client(session: aiohttp.ClientSession, url: str, stream: bool, tokens: int,
                 until: float, tally: Tally) -> None:
    body = {"model": "demo", "max_tokens": tokens, "stream": stream,
            "messages": [{"role": "user", "content": "Say hello."}]}
    for _ in range(MAX_REQUESTS_PER_CLIENT):
        if time.monotonic() >= until:
            return
        started = time.monotonic()
        try:
            async with session.post(url, json=body) as reply:
                text = await reply.text()
                if reply.status == 503 and reply.headers.get("Retry-After"):
                    tally.outcomes["503 with Retry-After"] += 1
                    await asyncio.sleep(min(float(reply.headers["Retry-After"]), 1.0))
                    continue
                if reply.status != 200:
                    tally.lose(f"HTTP {reply.status}: {text[:160]!r}")
                    continue
        except (TimeoutError, aiohttp.ClientError) as exc:
            tally.lose(f"{type(exc).__name__}: {exc}")
            continue
        if stream and '"error"' in text and "mid-stream" in text:
            # A stream whose replica died after its first token: its tokens are out, so it
            # cannot be asked again elsewhere; the client gets the documented SSE error.
            tally.outcomes["stream cut mid-reply (SSE error)"] += 1
            continue
        if stream and (not text.rstrip().endswith("data: [DONE]") or '"error"' in text):
            tally.lose(f"an incomplete stream: {text[-160:]!r}")
            continue
        tally.outcomes["answered"] += 1
        tally.seconds.append(time.monotonic() - started)


def rank0_engines() -> list[psutil.Process]:
    """The engine processes serving an HTTP API (rank 0 of each replica)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "environ"]):
        try:
            if "engine.main" in " ".join(proc.info["cmdline"] or ()) and \
                    (proc.info["environ"] or {}).get("RANK") == "0":
                found.append(proc)
        except (psutil.Error, TypeError):
            continue
    return found


def serving_replicas(fleet: LocalFleet) -> set[str]:
    return {r["id"] for r in fleet.status()["replicas"]
            if r["model_id"] == "demo" and r["state"] == "serving"}


async def load(fleet: LocalFleet, args: argparse.Namespace) -> dict:
    tally = Tally()
    door = psutil.Process(fleet.front_door_proc.pid)
    memory: list[tuple[float, int]] = []
    start = time.monotonic()
    until = start + args.seconds
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    killed: dict = {}
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        url = fleet.front_door_url + "/chat/completions"
        tasks = [asyncio.create_task(client(session, url, i % 2 == 1, args.tokens, until, tally))
                 for i in range(args.clients)]
        while time.monotonic() < until:
            memory.append((time.monotonic() - start, door.memory_info().rss))
            if not killed and time.monotonic() - start >= args.seconds * args.kill_at:
                before = await asyncio.to_thread(serving_replicas, fleet)
                victim = rank0_engines()[0]
                victim.send_signal(signal.SIGKILL)
                killed = {"at_s": time.monotonic() - start, "pid": victim.pid,
                          "serving_before": sorted(before)}
                print(f"# killed rank 0 pid {victim.pid} at {killed['at_s']:.0f} s", flush=True)
            if killed and "replaced_after_s" not in killed:
                now = await asyncio.to_thread(serving_replicas, fleet)
                if len(now) >= 2 and now != set(killed["serving_before"]):
                    killed["replaced_after_s"] = time.monotonic() - start - killed["at_s"]
            print(f"# {time.monotonic() - start:5.0f} s: {dict(tally.outcomes)}", flush=True)
            await asyncio.sleep(5)
        await asyncio.gather(*tasks)
    return {"tally": tally, "memory": memory, "killed": killed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--kill-at", type=float, default=0.5, help="share of the run")
    parser.add_argument("--tokens", type=int, default=8, help="max_tokens a request")
    parser.add_argument("--request-timeout-s", type=float, default=120)
    args = parser.parse_args()
    model = checkpoint(None, "demo")
    with tempfile.TemporaryDirectory() as root, LocalFleet(
            Path(root), front_door_process=True,
            supervisor_flags=("--tick-s", "0.5", "--calibration-budget-s", "0")) as fleet:
        path = Path(root) / "fleet.yaml"
        path.write_text(FLEET.format(address=fleet.address, state_dir=fleet.state_dir,
                                     checkpoint=model))
        fleet.fleetctl("apply", "--no-wait", str(path))
        fleet.wait(lambda: len(serving_replicas(fleet)) == 2, 180, "two serving replicas")
        print("# two replicas serving; load starts", flush=True)
        result = asyncio.run(load(fleet, args))
    tally, memory, killed = result["tally"], result["memory"], result["killed"]
    seconds = sorted(tally.seconds)
    rss = [m for _, m in memory]
    table(f"{args.clients} clients through the front door for {args.seconds:.0f} s, "
          f"max_tokens {args.tokens}, one replica's rank 0 killed at "
          f"{killed.get('at_s', float('nan')):.0f} s",
          ["measure", "value"],
          [["answered", tally.outcomes["answered"]],
           ["503 with Retry-After", tally.outcomes["503 with Retry-After"]],
           ["stream cut mid-reply (SSE error)",
            tally.outcomes["stream cut mid-reply (SSE error)"]],
           ["lost", tally.outcomes["lost"]],
           ["answer p50 s", statistics.median(seconds) if seconds else "-"],
           ["answer p99 s", seconds[int(0.99 * (len(seconds) - 1))] if seconds else "-"],
           ["slowest answer s", seconds[-1] if seconds else "-"],
           ["replica replaced after s", killed.get("replaced_after_s", "not within the run")],
           ["front door RSS first / last / most MiB",
            f"{rss[0] / 2**20:.0f} / {rss[-1] / 2**20:.0f} / {max(rss) / 2**20:.0f}"]])
    for why in tally.lost:
        print(f"# lost: {why}")
    print(json.dumps({"memory_mib": [(round(t), round(m / 2**20, 1)) for t, m in memory]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
